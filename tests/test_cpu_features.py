"""CpuFeatures: flags parsed from /proc/cpuinfo text, derived properties, the summary line."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.cpu_features import CpuFeatures, cpu_features

ZEN3 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx fma avx2 f16c bmi2
processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx fma avx2 f16c bmi2
"""
SAPPHIRE_RAPIDS = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8481C
flags\t\t: avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
"""


def test_avx2_only_part() -> None:
    f = CpuFeatures.parse(ZEN3, "AVX2", 2)
    assert f.model_name == "AMD EPYC 7B13"
    assert f.avx2 and not (f.avx512f or f.avx512_bf16 or f.amx or f.vnni or f.native_bf16)
    line = f.summary()
    assert "AMD EPYC 7B13" in line and "AVX2" in line and "bf16 emulated" in line and "\n" not in line
    assert "-avx512f" in line and " avx2 " in line


def test_bf16_and_amx_part() -> None:
    f = CpuFeatures.parse(SAPPHIRE_RAPIDS, "AVX512", 4)
    assert f.avx2 and f.avx512f and f.avx512_bf16 and f.amx and f.vnni and f.native_bf16
    assert "bf16 native" in f.summary()


def test_unreadable_cpuinfo_gives_no_flags() -> None:
    f = CpuFeatures.parse("", "DEFAULT", 1)
    assert f.flags == frozenset() and f.model_name == "unknown CPU" and not f.native_bf16


def test_frozen_and_this_machine_agrees_with_torch() -> None:
    here = cpu_features()
    with pytest.raises(dataclasses.FrozenInstanceError):
        here.threads = 3  # type: ignore[misc]
    assert here.torch_capability == torch.backends.cpu.get_cpu_capability()
    if here.torch_capability.startswith("AVX512"):
        assert here.avx512f
    if here.torch_capability == "AVX2":
        assert here.avx2
