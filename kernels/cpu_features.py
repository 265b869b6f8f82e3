"""What the CPU under us can do, read from /proc/cpuinfo and torch, never guessed.

Kernel choices depend on it: bfloat16 matmuls are only fast with AVX512_BF16 or AMX
(on AVX2-only parts torch emulates them), and fbgemm's int8 kernels saturate their
16-bit intermediate sums without VNNI unless activations use 7 bits (reduce_range).

Under `DYNGEN_CPU_ISA=avx2` (kernels/isa.py) the features are an AVX2-only part's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.isa import BEYOND, ISA_ENV, MARCH, Isa, isa_cap

CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class CpuFeatures:
    model_name: str
    flags: frozenset[str]
    torch_capability: str  # torch.backends.cpu.get_cpu_capability(): "AVX2", "AVX512", "DEFAULT", ...
    threads: int
    isa: Isa = Isa.NATIVE

    @property
    def march(self) -> str:
        """The native kernels' compiler target (`-march=`)."""
        return MARCH[self.isa]

    @property
    def avx2(self) -> bool:
        return "avx2" in self.flags

    @property
    def avx512f(self) -> bool:
        return "avx512f" in self.flags

    @property
    def avx512_bf16(self) -> bool:
        return "avx512_bf16" in self.flags

    @property
    def amx(self) -> bool:
        return "amx_tile" in self.flags

    @property
    def vnni(self) -> bool:
        """Int8 dot products that accumulate straight into 32 bits (no 16-bit saturation)."""
        return "avx512_vnni" in self.flags or "avx_vnni" in self.flags

    @property
    def native_bf16(self) -> bool:
        return self.avx512_bf16 or "amx_bf16" in self.flags

    @property
    def identity(self) -> str:
        """What timings measured on this CPU depend on: its model, torch's kernels, threads and flags."""
        return f"{self.model_name}|{self.torch_capability}|{self.threads}|{' '.join(sorted(self.flags))}"

    def summary(self) -> str:
        """One line for logs and benchmark tables."""
        marks = ("avx2", "avx512f", "avx512_bf16", "amx", "vnni")
        have = " ".join(m if getattr(self, m) else f"-{m}" for m in marks)
        return (
            f"{self.model_name} | torch {torch.__version__} {self.torch_capability} | {have} | "
            f"bf16 {'native' if self.native_bf16 else 'emulated'} | {self.threads} threads"
            + ("" if self.isa is Isa.NATIVE else f" | capped at {self.isa.value} by {ISA_ENV}")
        )

    def capped(self, isa: Isa) -> CpuFeatures:
        """These features as a part with only `isa`'s extensions would have them."""
        if isa is Isa.NATIVE:
            return self
        flags = frozenset(f for f in self.flags if not f.startswith(BEYOND[isa]))
        return CpuFeatures(self.model_name, flags, self.torch_capability, self.threads, isa)

    @staticmethod
    def parse(cpuinfo: str, torch_capability: str, threads: int) -> CpuFeatures:
        """Features from the text of /proc/cpuinfo (the first processor's flags and model name)."""
        flags: frozenset[str] = frozenset()
        name = "unknown CPU"
        for line in cpuinfo.splitlines():
            key, sep, value = line.partition(":")
            if not sep:
                continue
            key = key.strip()
            if key == "model name" and name == "unknown CPU":
                name = value.strip()
            elif key in ("flags", "Features") and not flags:  # "Features" on arm64
                flags = frozenset(value.split())
        return CpuFeatures(name, flags, torch_capability, threads)


@functools.cache
def cpu_features() -> CpuFeatures:
    """This machine's features (read once per process)."""
    try:
        text = CPUINFO.read_text()
    except OSError:  # not Linux: flags unknown, torch's capability still says what it dispatches
        text = ""
    features = CpuFeatures.parse(text, torch.backends.cpu.get_cpu_capability(), torch.get_num_threads())
    return features.capped(isa_cap())
