"""What a timing taken on this machine depends on, and the file it is kept in between starts.

The warm-up times steps (the step-cost table, prompt slices by depth) that are fixed for a machine
and a model: the CPU (its threads and flags), torch, the model and its linear kinds, the device, the
cache's kind, the native kernels' source and the OpenMP waiting. A timing is kept under its key
and read back by a later start; a key that differs in anything is timed again.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kernels.cache_dir import keyed_file, read_keyed, write_json
from kernels.cpu_features import cpu_features
from kernels.native.native_library import source_digest


@dataclass(frozen=True)
class TimingKey:
    what: str  # what was timed, and how: a change invalidates what was timed the old way
    model: str  # name, activations' dtype and linear kinds
    device: str
    cache: str  # the KV cache's kind and dtype
    cpu: str
    torch_version: str
    native_source: str
    omp: str  # OpenMP's waiting: spinning workers make small steps cheaper

    @staticmethod
    def make(what: str, model: str, device: str, cache: str) -> TimingKey:
        omp = f"{os.environ.get('OMP_WAIT_POLICY', '')}|{os.environ.get('GOMP_SPINCOUNT', '')}"
        return TimingKey(
            what, model, device, cache, cpu_features().identity, torch.__version__, source_digest(), omp
        )

    def path(self, folder: Path | None, prefix: str) -> Path:
        return keyed_file(folder, prefix, asdict(self))

    def read(self, folder: Path | None, prefix: str) -> dict[str, object] | None:
        """What was kept under this key, or None (none yet, or unreadable)."""
        return read_keyed(self.path(folder, prefix), asdict(self))

    def write(self, folder: Path | None, prefix: str, values: dict[str, object]) -> None:
        write_json(self.path(folder, prefix), {"key": asdict(self), **values})
