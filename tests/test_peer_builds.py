"""llama.cpp as a peer is built once per instruction set: the CPU's own (GGML_NATIVE), or, for
`python -m benchmarks peers --isa avx2`, an AVX2-only part's in a folder of its own, so the two
builds never overwrite each other (benchmarks/peers/llamacpp.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks.peers.llamacpp import CMAKE_FLAGS, ISA_FLAGS, LlamaCppPeer
from kernels.isa import Isa


def test_each_instruction_set_has_its_own_build_folder_and_flags() -> None:
    root = Path("/cache/llama.cpp")
    native, avx2 = LlamaCppPeer(root), LlamaCppPeer(root, Isa.AVX2)
    assert native.server == root / "build" / "bin" / "llama-server"
    assert avx2.server == root / "build-avx2" / "bin" / "llama-server"
    assert not any("GGML_NATIVE" in f for f in CMAKE_FLAGS)  # each build names its own
    assert ISA_FLAGS[Isa.NATIVE] == ("-DGGML_NATIVE=ON",)
    # GGML_NATIVE off: ggml's defaults then are SSE4.2, AVX, AVX2, FMA, F16C, BMI2, no AVX-512.
    assert ISA_FLAGS[Isa.AVX2] == ("-DGGML_NATIVE=OFF",)
    assert set(ISA_FLAGS) == set(Isa)


def test_the_peers_parent_names_a_cap_without_loading_torch() -> None:
    """The peers and serving benchmarks' parent imports torch only where it measures (kernels/isa.py)."""
    script = "import sys, benchmarks.peers.run, benchmarks.peers.llamacpp; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "False"
