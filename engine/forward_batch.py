"""One model call's input: a flattened batch of sequences over the paged KV cache.

Every sequence brings its new tokens (a prefill chunk, or one decode token), the
position of the first of them (how many of its tokens the cache already holds) and
its page table. All sequences run in one forward: their tokens are concatenated,
and each token knows its position and the cache slot its K/V goes to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.ids import PageId


@dataclass(frozen=True)
class SequenceInput:
    token_ids: Sequence[int]
    start_pos: int
    page_table: Sequence[PageId]
    # Whether the caller wants the logits after this sequence's last new token
    # (not for a prefill chunk that ends before the prompt does).
    want_logits: bool = True
    # How many of the last new tokens need logits (speculative verification wants all of them).
    logit_positions: int = 1

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class ForwardBatch:
    """Tensors for one forward; built once per step, shared by every layer."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: page_id * page_size + offset, where each new K/V goes
    page_tables: torch.Tensor  # [B, max_pages] int64, padded with 0
    logits_indices: torch.Tensor  # [N] int64: rows of the flattened batch whose logits are returned
    query_lens: tuple[int, ...]  # new tokens per sequence
    seq_lens: tuple[int, ...]  # tokens in the cache per sequence after this step
    page_size: int

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @staticmethod
    def build(seqs: Sequence[SequenceInput], page_size: int, device: torch.device) -> ForwardBatch:
        if not seqs:
            raise ValueError("a forward batch needs at least one sequence")
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        max_pages = max(len(s.page_table) for s in seqs)
        tables = [list(s.page_table) + [0] * (max_pages - len(s.page_table)) for s in seqs]
        for s in seqs:
            if not s.token_ids:
                raise ValueError("every sequence in a forward batch needs at least one new token")
            if s.end_pos > len(s.page_table) * page_size:
                raise ValueError(
                    f"page table of {len(s.page_table)} pages cannot hold {s.end_pos} tokens "
                    f"(page size {page_size})"
                )
            ids.extend(s.token_ids)
            pos = range(s.start_pos, s.end_pos)
            positions.extend(pos)
            slots.extend(s.page_table[p // page_size] * page_size + p % page_size for p in pos)
            if s.want_logits:
                if not 1 <= s.logit_positions <= len(s.token_ids):
                    raise ValueError(
                        f"logit_positions must be in [1, {len(s.token_ids)}], got {s.logit_positions}"
                    )
                logits_rows.extend(range(len(ids) - s.logit_positions, len(ids)))

        def tensor(values: Sequence[int] | Sequence[Sequence[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return ForwardBatch(
            input_ids=tensor(ids),
            positions=tensor(positions),
            slot_mapping=tensor(slots),
            page_tables=tensor(tables),
            logits_indices=tensor(logits_rows),
            query_lens=tuple(len(s.token_ids) for s in seqs),
            seq_lens=tuple(s.end_pos for s in seqs),
            page_size=page_size,
        )
