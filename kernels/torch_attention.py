"""Paged attention in plain torch: the CPU path and the reference for other kernels.

Sequences are split into two groups: decode (one query token) and the rest (prefill
chunks, speculative verification). Each group is handled with batched tensor ops:
its K/V are gathered from the pages into a padded [B, L] block through one
index_select per layer, then one scaled_dot_product_attention call. Grouped-query
heads are folded into the query axis (the heads sharing a K/V head become extra
query rows with the same mask), so no K/V head is copied per query head and the
fused CPU kernel sees few, larger blocks. The gather indices and masks are built
once per forward and reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.forward_batch import ForwardBatch


@dataclass(frozen=True)
class _Group:
    """Sequences attended together, padded to Q query rows and L keys."""

    rows: torch.Tensor  # [B, Q] rows of the flattened batch holding each query (padding -> 0)
    out_rows: torch.Tensor  # [N] flattened batch rows that are real queries
    out_select: torch.Tensor  # [N] positions in the flattened [B * Q] block that are real queries
    slots: torch.Tensor  # [B * L] cache slots to gather (padding -> 0)
    mask: torch.Tensor  # [B, 1, per_kv * Q, L] bool: True where visible
    batch: int
    queries: int
    keys: int


def _build_group(batch: ForwardBatch, members: list[int], per_kv: int) -> _Group:
    device = batch.input_ids.device
    starts = [0]
    for n in batch.query_lens:
        starts.append(starts[-1] + n)
    q_max = max(batch.query_lens[i] for i in members)
    l_max = max(batch.seq_lens[i] for i in members)
    idx = torch.tensor(members, dtype=torch.int64, device=device)
    q_lens = torch.tensor([batch.query_lens[i] for i in members], dtype=torch.int64, device=device)
    s_lens = torch.tensor([batch.seq_lens[i] for i in members], dtype=torch.int64, device=device)
    q_start = torch.tensor([starts[i] for i in members], dtype=torch.int64, device=device)

    qi = torch.arange(q_max, device=device)
    q_valid = qi[None, :] < q_lens[:, None]  # [B, Q]
    rows = torch.where(q_valid, q_start[:, None] + qi[None, :], 0)

    kj = torch.arange(l_max, device=device)
    page_size = batch.page_size
    tables = batch.page_tables[idx]  # [B, P]
    page_idx = (kj // page_size).clamp(max=tables.shape[1] - 1)
    slots = tables[:, page_idx] * page_size + (kj % page_size)[None, :]
    k_valid = kj[None, :] < s_lens[:, None]  # [B, L]
    slots = torch.where(k_valid, slots, 0)

    # Query i of a sequence sits at position seq_len - q_len + i and sees keys up to it.
    q_pos = (s_lens - q_lens)[:, None] + qi[None, :]  # [B, Q]
    visible = (kj[None, None, :] <= q_pos[:, :, None]) & k_valid[:, None, :]
    # Padded query rows see key 0 so their softmax stays finite; their output is dropped.
    visible = visible | (~q_valid[:, :, None] & (kj == 0)[None, None, :])
    # Query rows are ordered (head within its K/V group, position): repeat the mask per head.
    mask = visible[:, None].expand(-1, per_kv, -1, -1).reshape(len(members), 1, per_kv * q_max, l_max)

    flat_valid = q_valid.reshape(-1)
    return _Group(
        rows=rows,
        out_rows=rows.reshape(-1)[flat_valid],
        out_select=torch.nonzero(flat_valid).reshape(-1),
        slots=slots.reshape(-1),
        mask=mask,
        batch=len(members),
        queries=q_max,
        keys=l_max,
    )


class _PreparedTorchAttention:
    def __init__(self, batch: ForwardBatch, num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> None:
        self._slot_mapping = batch.slot_mapping
        self._heads = num_heads
        self._kv_heads = num_kv_heads
        decode = [i for i, n in enumerate(batch.query_lens) if n == 1]
        longer = [i for i, n in enumerate(batch.query_lens) if n > 1]
        per_kv = num_heads // num_kv_heads
        self._groups = [_build_group(batch, members, per_kv) for members in (decode, longer) if members]
        # When the whole batch is one group in order, outputs need no scatter.
        self._in_order = len(self._groups) == 1 and self._groups[0].queries == 1

    def write_kv(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        k_cache.index_copy_(0, self._slot_mapping, k)
        v_cache.index_copy_(0, self._slot_mapping, v)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        tokens, heads, head_dim = q.shape
        kv_heads = self._kv_heads
        per_kv = heads // kv_heads
        scale = head_dim**-0.5
        if self._in_order:
            return self._attend_group(self._groups[0], q, k_cache, v_cache, per_kv, scale)
        out = torch.empty((tokens, heads * head_dim), dtype=q.dtype, device=q.device)
        for group in self._groups:
            out[group.out_rows] = self._attend_group(group, q, k_cache, v_cache, per_kv, scale)
        return out

    def _attend_group(
        self,
        g: _Group,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        per_kv: int,
        scale: float,
    ) -> torch.Tensor:
        _, heads, head_dim = q.shape
        kv_heads = self._kv_heads
        # [B, Q, kv, per_kv, D] -> [B, kv, per_kv * Q, D]
        qg = q[g.rows.reshape(-1)].view(g.batch, g.queries, kv_heads, per_kv, head_dim)
        qg = qg.permute(0, 2, 3, 1, 4).reshape(g.batch, kv_heads, per_kv * g.queries, head_dim)
        k = k_cache.index_select(0, g.slots).view(g.batch, g.keys, kv_heads, head_dim).transpose(1, 2)
        v = v_cache.index_select(0, g.slots).view(g.batch, g.keys, kv_heads, head_dim).transpose(1, 2)
        ctx = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.mask, scale=scale)
        # [B, kv, per_kv, Q, D] -> [B, Q, kv, per_kv, D] -> rows
        ctx = ctx.view(g.batch, kv_heads, per_kv, g.queries, head_dim).permute(0, 3, 1, 2, 4)
        ctx = ctx.reshape(g.batch * g.queries, heads * head_dim)
        if g.queries == 1:
            return ctx
        return ctx[g.out_select]


class TorchPagedAttention:
    """The AttentionBackend for CPU tensors (and the reference for the Triton path)."""

    def prepare(
        self, batch: ForwardBatch, num_heads: int, num_kv_heads: int, dtype: torch.dtype
    ) -> _PreparedTorchAttention:
        return _PreparedTorchAttention(batch, num_heads, num_kv_heads, dtype)
