"""CpuFeatures: flags parsed from /proc/cpuinfo text, derived properties, the summary line."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.cpu_features import CpuFeatures, cpu_features
from kernels.isa import ISA_ENV, Isa, isa_cap, isa_environment

REPO = Path(__file__).resolve().parents[1]

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
flags\t\t: fma f16c avx2 avx_vnni avx512f avx512_vnni avx512_bf16 avx512vl amx_bf16 amx_tile amx_int8
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


def test_capped_at_avx2_a_newer_part_has_only_an_avx2_parts_extensions() -> None:
    full = CpuFeatures.parse(SAPPHIRE_RAPIDS, "AVX512", 4)
    assert full.march == "native" and full.capped(Isa.NATIVE) is full
    capped = full.capped(Isa.AVX2)
    assert capped.flags == {"fma", "f16c", "avx2"}
    assert capped.avx2 and not (capped.avx512f or capped.vnni or capped.amx or capped.native_bf16)
    assert capped.march == "x86-64-v3" and capped.model_name == full.model_name
    assert f"capped at avx2 by {ISA_ENV}" in capped.summary() and "bf16 emulated" in capped.summary()


def test_the_cap_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ISA_ENV, raising=False)
    assert isa_cap() is Isa.NATIVE and isa_environment(Isa.NATIVE) == {}
    monkeypatch.setenv(ISA_ENV, " AVX2 ")
    assert isa_cap() is Isa.AVX2
    monkeypatch.setenv(ISA_ENV, "avx512")
    with pytest.raises(ValueError, match="DYNGEN_CPU_ISA='avx512' is not one of native, avx2"):
        isa_cap()


@pytest.mark.skipif(not cpu_features().avx2, reason="an AVX2 cap needs an AVX2 CPU")
def test_a_process_started_capped_sees_an_avx2_part_in_dyngen_and_torch() -> None:
    env = {**os.environ, **isa_environment(Isa.AVX2), "PYTHONPATH": str(REPO)}
    script = (
        "import json, torch; from kernels.cpu_features import cpu_features; f = cpu_features(); "
        "print(json.dumps([f.torch_capability, f.march, sorted(f.flags)]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    capability, march, flags = json.loads(out.stdout.splitlines()[-1])
    assert capability == "AVX2" and march == "x86-64-v3"
    assert "avx2" in flags and not any(f.startswith(("avx512", "amx", "avx_")) for f in flags)
