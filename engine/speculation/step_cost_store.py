"""The warm-up's step-cost table, kept per machine: timed at a server's first start, read back after.

Timing plain steps of 1 to 32 rows is most of a warm engine's warm-up (0.25 s on a 2-core Zen 4,
0.4-0.9 s on its AVX2-only paths), and a restarted engine's streams wait for it. What the table
depends on is fixed for a machine and a model: the CPU (its threads and flags), torch, the model
and its linear kinds, the cache's kind, the row counts timed, the native kernels' source and the
OpenMP waiting. Each start still corrects the table from its own decode steps (`StepCost.observed`),
as it does a freshly timed one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.speculation.draft_policy import StepCost
from kernels.cache_dir import keyed_file, read_keyed, write_json
from kernels.cpu_features import cpu_features
from kernels.native.native_library import source_digest

# How the table is made: a change invalidates the tables made the old way.
METHOD = "plain decode steps of one-token jobs; best of 4; retimed when a size costs more per row"


@dataclass(frozen=True)
class StepCostKey:
    cpu: str
    torch_version: str
    model: str  # name, activations' dtype and linear kinds
    device: str
    cache: str  # the KV cache's kind and dtype
    rows: tuple[int, ...]
    native_source: str
    omp: str  # OpenMP's waiting: spinning workers make small steps cheaper
    method: str = METHOD

    @staticmethod
    def make(model: str, device: str, cache: str, rows: Sequence[int]) -> StepCostKey:
        omp = f"{os.environ.get('OMP_WAIT_POLICY', '')}|{os.environ.get('GOMP_SPINCOUNT', '')}"
        return StepCostKey(
            cpu_features().identity,
            torch.__version__,
            model,
            device,
            cache,
            tuple(rows),
            source_digest(),
            omp,
        )

    def path(self, folder: Path | None) -> Path:
        return keyed_file(folder, "step-cost", asdict(self))


def read_step_cost(key: StepCostKey, folder: Path | None) -> StepCost | None:
    """The table kept for `key`, or None (none yet, or unreadable)."""
    data = read_keyed(key.path(folder), asdict(key))
    if data is None:
        return None
    try:
        seconds, per_key = data["seconds"], data["per_key"]
        if not isinstance(seconds, list) or not isinstance(per_key, float | int):
            return None
        return StepCost(key.rows, tuple(float(s) for s in seconds), float(per_key))
    except (KeyError, ValueError, TypeError):
        return None


def write_step_cost(key: StepCostKey, folder: Path | None, cost: StepCost) -> None:
    write_json(key.path(folder), {"key": asdict(key), "seconds": list(cost.seconds), "per_key": cost.per_key})
