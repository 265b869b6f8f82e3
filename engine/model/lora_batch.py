"""Which rows of one forward run which LoRA adapter, and the deltas added to their projections.

A forward carries jobs of several adapters and of the base model at once. Its rows are grouped
by adapter (a job's tokens are contiguous in the flattened batch, so a group is a union of
ranges, kept as one index per row); each projection adds, per group, scale * B (A x) for that
group's rows only: one small gather, two thin matmuls and one scatter-add per adapter and
projection, never a forward per adapter. Base-model rows get nothing added.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.model.lora_adapter import LoraAdapter


@dataclass(frozen=True)
class LoraGroup:
    adapter: LoraAdapter
    rows: torch.Tensor | None  # int64 rows of the flattened batch; None: every row


@dataclass(frozen=True)
class LoraBatch:
    groups: tuple[LoraGroup, ...]

    @staticmethod
    def build(spans: Sequence[tuple[LoraAdapter | None, int]]) -> LoraBatch | None:
        """From each sequence's (adapter, token count), in batch order; None when no row has one."""
        total = sum(n for _, n in spans)
        rows: dict[int, tuple[LoraAdapter, list[int]]] = {}
        start = 0
        for adapter, n in spans:
            if adapter is not None:
                rows.setdefault(adapter.uid, (adapter, []))[1].extend(range(start, start + n))
            start += n
        if not rows:
            return None
        return LoraBatch(
            tuple(
                LoraGroup(a, None if len(r) == total else torch.tensor(r, dtype=torch.int64))
                for a, r in rows.values()
            )
        )

    def touches(self, layer: int, projection: str) -> bool:
        return any(g.adapter.delta(layer, projection) is not None for g in self.groups)

    def apply_(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y [rows, out] += each group's delta of x [rows, in] on that group's rows (in place)."""
        for g in self.groups:
            delta = g.adapter.delta(layer, projection)
            if delta is None:
                continue
            if g.rows is None:
                y.add_(delta(x).to(y.dtype))
            else:
                y.index_add_(0, g.rows, delta(x.index_select(0, g.rows)).to(y.dtype))
