"""The warm-up's step-cost table, kept per machine: timed at a server's first start, read back after.

Timing plain steps of 1 to 32 rows is most of a warm engine's warm-up (0.25 s on a 2-core Zen 4,
0.4-0.9 s on its AVX2-only paths), and a restarted engine's streams wait for it. What the table
depends on is fixed for a machine and a model (engine/timing_key.py), and the row counts timed.
Each start still corrects the table from its own decode steps (`StepCost.observed`), as it does a
freshly timed one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.speculation.draft_policy import StepCost
from engine.timing_key import TimingKey

# How the table is made: a change invalidates the tables made the old way.
METHOD = "plain decode steps of one-token jobs; best of 4; retimed when a size costs more per row"
PREFIX = "step-cost"


@dataclass(frozen=True)
class StepCostKey:
    timing: TimingKey
    rows: tuple[int, ...]

    @staticmethod
    def make(model: str, device: str, cache: str, rows: Sequence[int]) -> StepCostKey:
        return StepCostKey(TimingKey.make(step_cost_what(rows), model, device, cache), tuple(rows))

    def path(self, folder: Path | None) -> Path:
        return self.timing.path(folder, PREFIX)


def step_cost_what(rows: Sequence[int]) -> str:
    """The timing key's `what` of a table of these row counts."""
    return f"{METHOD}; rows {','.join(str(n) for n in rows)}"


def read_step_cost(key: StepCostKey, folder: Path | None) -> StepCost | None:
    """The table kept for `key`, or None (none yet, or unreadable)."""
    data = key.timing.read(folder, PREFIX)
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
    key.timing.write(folder, PREFIX, {"seconds": list(cost.seconds), "per_key": cost.per_key})
