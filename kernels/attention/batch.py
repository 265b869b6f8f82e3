"""What attention reads of one forward: where new K/V go, the page tables, the lengths.

Defined here so the kernels depend on nothing of the engine: the engine's forward batch
(engine.forward_batch.ForwardBatch) extends this with the token inputs and builds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionBatch:
    """Per-forward attention metadata, shared by every layer. Sequences are in batch order and
    their new tokens are the rows of the flattened batch, one sequence after another."""

    slot_mapping: torch.Tensor  # [T] int64: page_id * page_size + offset, where each new K/V goes
    page_tables: torch.Tensor  # [B, max_pages] int64, padded with page 0 (never read past seq_lens)
    query_lens: tuple[int, ...]  # new tokens per sequence
    seq_lens: tuple[int, ...]  # tokens in the cache per sequence after this step
    page_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def device(self) -> torch.device:
        return self.slot_mapping.device
