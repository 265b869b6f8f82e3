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

    def query_rows(self) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Each query row's sequence (None when every sequence brings one token: row i is
        sequence i) and how many keys it sees, itself included: token i of a chunk sits at position
        seq_len - query_len + i and sees the keys up to it. int64, on the CPU."""
        seq_lens = torch.tensor(self.seq_lens, dtype=torch.int64)
        if all(n == 1 for n in self.query_lens):
            return None, seq_lens
        query_lens = torch.tensor(self.query_lens, dtype=torch.int64)
        row_seq = torch.repeat_interleave(torch.arange(len(self.query_lens)), query_lens)
        first_row = torch.cumsum(query_lens, 0) - query_lens
        within = torch.arange(int(query_lens.sum())) - first_row[row_seq]
        return row_seq, ((seq_lens - query_lens)[row_seq] + within + 1).contiguous()
