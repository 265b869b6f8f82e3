"""One model call's input: a flattened batch of sequences over the paged KV cache.

Every sequence brings its new tokens (a prefill chunk, or one decode token), the
position of the first of them (how many of its tokens the cache already holds) and
its page table. All sequences run in one forward: their tokens are concatenated,
and each token knows its position and the cache slot its K/V goes to.

The attention half of the batch (`kernels.attention.batch.AttentionBatch`) belongs to the
kernels; `ForwardBatch` adds the token inputs the model reads and is built here.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, repeat

import torch

from engine.adapters.lora_adapter import LoraAdapter
from engine.ids import PageId
from engine.model.lora_batch import LoraBatch
from kernels.attention.batch import AttentionBatch


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
    adapter: LoraAdapter | None = None  # the job's LoRA adapter (None: the base model)
    # Vectors replacing the token embeddings of some new tokens: (index into token_ids, rows [n, hidden]).
    # Those tokens' ids may be negative pseudo ids (engine/prompt/prompt_embeddings.py): never looked up.
    embeds: tuple[tuple[int, torch.Tensor], ...] = ()

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class ForwardBatch(AttentionBatch):
    """Tensors for one forward; built once per step, shared by every layer."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    logits_indices: torch.Tensor  # [N] int64: rows of the flattened batch whose logits are returned
    lora: LoraBatch | None = None  # the rows of each LoRA adapter (None: the base model only)
    # Prompt embeddings: (rows of the flattened batch [K], their vectors [K, hidden]); None: none.
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @staticmethod
    def build(seqs: Sequence[SequenceInput], page_size: int, device: torch.device) -> ForwardBatch:
        """One Python loop over the sequences (C-level extends inside), none over tokens: each
        token's slot is looked up in the padded page tables by a few tensor ops."""
        if not seqs:
            raise ValueError("a forward batch needs at least one sequence")
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        # Filled by C-level extends (array, not list: ~5x cheaper to turn into a tensor).
        ids = array.array("q")
        positions = array.array("q")
        max_pages = max(len(s.page_table) for s in seqs)
        tables = array.array("q")
        rows = 0
        embed_rows: list[torch.Tensor] = []
        embed_values: list[torch.Tensor] = []
        for s in seqs:
            q = len(s.token_ids)
            for offset, values in s.embeds:
                embed_rows.append(torch.arange(rows + offset, rows + offset + values.shape[0]))
                embed_values.append(values)
            if not q:
                raise ValueError("every sequence in a forward batch needs at least one new token")
            end = s.start_pos + q
            num_pages = len(s.page_table)
            if end > num_pages * page_size:
                raise ValueError(
                    f"page table of {num_pages} pages cannot hold {end} tokens (page size {page_size})"
                )
            if s.want_logits:
                if not 1 <= s.logit_positions <= q:
                    raise ValueError(f"logit_positions must be in [1, {q}], got {s.logit_positions}")
                logits_rows.extend(range(rows + q - s.logit_positions, rows + q))
            ids.extend(s.token_ids)
            positions.extend(range(s.start_pos, end))
            tables.extend(s.page_table)
            if num_pages < max_pages:
                tables.extend(repeat(0, max_pages - num_pages))
            query_lens.append(q)
            seq_lens.append(end)
            rows += q
        n = len(seqs)
        table_t = _tensor(tables).view(n, max_pages)
        pos_t = _tensor(positions)
        # Each token's page: its sequence's table row at column position // page_size.
        if rows == n:  # decode steps only: row i is sequence i
            first_of_row = torch.arange(0, n * max_pages, max_pages)
        else:
            first_of_row = _tensor(
                array.array(
                    "q", chain.from_iterable(repeat(i * max_pages, q) for i, q in enumerate(query_lens))
                )
            )
        ids_t = _tensor(ids)
        embeds = None
        if embed_rows:
            ids_t = ids_t.clamp(min=0)  # pseudo ids under embeddings: any real id, overwritten
            embeds = (torch.cat(embed_rows).to(device), torch.cat(embed_values).to(device))
        pages = table_t.view(-1)[first_of_row + torch.div(pos_t, page_size, rounding_mode="floor")]
        slots = pages * page_size + pos_t % page_size
        logits_t = _tensor(array.array("q", logits_rows))
        if device.type != "cpu":  # one copy to the device for all of the step's index tensors
            slots, table_flat, ids_t, pos_t, logits_t = one_copy(
                [slots, table_t.view(-1), ids_t, pos_t, logits_t], device
            )
            table_t = table_flat.view(n, max_pages)
        return ForwardBatch(
            slot_mapping=slots,
            page_tables=table_t,
            query_lens=tuple(query_lens),
            seq_lens=tuple(seq_lens),
            page_size=page_size,
            input_ids=ids_t,
            positions=pos_t,
            logits_indices=logits_t,
            lora=LoraBatch.build([(s.adapter, len(s.token_ids)) for s in seqs])
            if any(s.adapter is not None for s in seqs)
            else None,
            embeds=embeds,
        )


def one_copy(parts: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """`parts` (int64, 1-D, on the host) on `device` through one host-to-device copy: packed into
    one buffer (pinned where CUDA is, so the copy runs asynchronously), copied, split into views."""
    host = torch.cat([p.reshape(-1) for p in parts])
    if device.type == "cuda":
        host = host.pin_memory()
    moved = host.to(device, non_blocking=device.type == "cuda")
    return list(torch.split(moved, [p.numel() for p in parts]))


def _tensor(values: array.array[int]) -> torch.Tensor:
    """An int64 CPU tensor over `values` (no copy; the tensor keeps the array alive)."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(values, dtype=torch.int64)
