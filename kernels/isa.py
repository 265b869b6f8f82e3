"""The instruction set dyngen is capped to: the CPU's own, or an AVX2-only part's (no torch here,
so the benchmarks' parent processes can name a cap without loading torch).

`DYNGEN_CPU_ISA=avx2` caps what dyngen treats as this CPU's instruction set to an AVX2-only
part's (x86-64-v3: no AVX-512, AVX-VNNI or AMX), so the AVX2 paths can be measured on a newer
part: kernels/cpu_features.py drops the flags such a part lacks, and the native kernels build
for x86-64-v3. torch, oneDNN and MKL choose their kernels when they load, so a process capped
this way also needs `isa_environment`'s variables set before it starts (the peers benchmark's
`--isa avx2` does both).
"""

from __future__ import annotations

import enum
import os

ISA_ENV = "DYNGEN_CPU_ISA"


class Isa(enum.Enum):
    NATIVE = "native"  # what the CPU has
    AVX2 = "avx2"  # an AVX2-only part's set, whatever the CPU has beyond it


# Per cap: the /proc/cpuinfo flag prefixes it removes (extensions an AVX2-only x86 part, Zen 3 or
# Haswell to Comet Lake, lacks), the native kernels' -march, and the variables that cap torch's
# kernel dispatch, oneDNN's and MKL's instruction sets.
BEYOND: dict[Isa, tuple[str, ...]] = {Isa.NATIVE: (), Isa.AVX2: ("avx512", "avx10", "avx_", "amx")}
MARCH = {Isa.NATIVE: "native", Isa.AVX2: "x86-64-v3"}
_DISPATCH: dict[Isa, dict[str, str]] = {
    Isa.NATIVE: {},
    Isa.AVX2: {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    },
}


def isa_cap() -> Isa:
    """The instruction set `DYNGEN_CPU_ISA` caps this process to (native when unset)."""
    value = os.environ.get(ISA_ENV, Isa.NATIVE.value).strip().lower()
    try:
        return Isa(value)
    except ValueError:
        known = ", ".join(i.value for i in Isa)
        raise ValueError(f"{ISA_ENV}={value!r} is not one of {known}") from None


def isa_environment(isa: Isa) -> dict[str, str]:
    """Variables a child process needs, set before it starts, to run capped at `isa`: dyngen's own
    cap and the libraries' dispatch."""
    return {} if isa is Isa.NATIVE else {ISA_ENV: isa.value, **_DISPATCH[isa]}
