"""Paged attention in plain torch: the CPU path and the reference for other kernels.

The cache of a layer is [num_pages, kv_heads, page_size, head_dim] (see
engine.cache.kv_cache): one page of one head is a contiguous [page_size, head_dim] matrix.

Index tensors and masks are built once per forward and reused by every layer. Each
sequence's pages are gathered whole, one page of one head per row (one index_select of
page-sized blocks, far cheaper than a per-token gather), in the order (sequence, head,
page): that lands every sequence's keys of one head as one contiguous [keys, head_dim]
block, ready for a batched matmul with no further copy. Sequences then go in two groups:

- decode (one query token each): scores by one batched matmul, a float32 softmax under
  an additive padding bias, and one batched matmul with the values;
- the rest (prefill chunks, speculative verification): scaled_dot_product_attention,
  whose fused CPU kernel never materialises the [queries, keys] scores.

Grouped-query heads are folded into the query axis (the heads sharing a K/V head
become extra query rows with the same mask), so no K/V head is copied per query head.

An int8 cache (kernels.attention.kv_layer) is quantized in write_kv and read as whole int8 blocks
with their per-token scales (one more small index_select each). Decode converts the
blocks to the queries' dtype (exact) and applies the scales to the scores and the
probabilities (per key, not per element); longer queries dequantize the gathered blocks
in one vectorised op (int8 x scale in float32, then the queries' dtype) for SDPA.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention.batch import AttentionBatch
from kernels.attention.kv_layer import KVLayer, dequantize_kv, quantize_kv


class _GatherScratch:
    """Grow-only buffers the gathered K and V blocks are written into, one pair per thread (a
    forward runs on one thread): every layer of every forward reuses them. A fresh tensor per
    layer cost a large allocation each time (tens of MB per step across layers), and the C heap
    kept what they freed: the engine's RSS grew by hundreds of MB under a steady load."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, torch.dtype, torch.device, bool], torch.Tensor] = {}

    def take(
        self, which: int, rows: int, width: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A [rows, width] tensor of buffer `which` (0: K, 1: V), valid until that buffer's next take."""
        # Inference tensors (made under torch.inference_mode) cannot be written outside it: one set each.
        key = (which, dtype, device, torch.is_inference_mode_enabled())
        buf = self._buffers.get(key)
        need = rows * width
        if buf is None or buf.numel() < need:
            # A quarter more than asked: a batch that grows a little does not reallocate every step.
            buf = torch.empty(need + need // 4, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:need].view(rows, width)


_scratch = threading.local()


def _gather_scratch() -> _GatherScratch:
    scratch: _GatherScratch | None = getattr(_scratch, "buffers", None)
    if scratch is None:
        scratch = _scratch.buffers = _GatherScratch()
    return scratch


@dataclass(frozen=True)
class _Group:
    """Sequences attended together, padded to Q query rows, P pages and L = P * page_size keys."""

    rows: torch.Tensor  # [B * Q] rows of the flattened batch holding each query (padding -> 0)
    out_rows: torch.Tensor  # [N] flattened batch rows that are real queries
    out_select: torch.Tensor  # [N] positions in the flattened [B * Q] block that are real queries
    blocks: torch.Tensor  # [B * kv_heads * P] rows (page * kv_heads + head) to gather; padding -> page 0
    mask: torch.Tensor  # decode: [B, 1, 1, L] additive bias; others: [B, 1, per_kv * Q, L] bool
    batch: int
    queries: int
    keys: int


def _build_group(
    batch: AttentionBatch,
    members: list[int],
    starts: list[int],
    kv_heads: int,
    per_kv: int,
    dtype: torch.dtype,
) -> _Group:
    """`starts[i]`: the flattened batch row of sequence i's first query."""
    device = batch.device
    page_size = batch.page_size
    q_max = max(batch.query_lens[i] for i in members)
    p_max = max(-(-batch.seq_lens[i] // page_size) for i in members)
    # Every gathered key, to the end of the last page, masked past each sequence's length: cutting
    # the blocks to the longest sequence made them a strided view, which each matmul copied whole.
    l_max = p_max * page_size
    idx = torch.tensor(members, dtype=torch.int64, device=device)
    q_lens = torch.tensor([batch.query_lens[i] for i in members], dtype=torch.int64, device=device)
    s_lens = torch.tensor([batch.seq_lens[i] for i in members], dtype=torch.int64, device=device)
    q_start = torch.tensor([starts[i] for i in members], dtype=torch.int64, device=device)

    qi = torch.arange(q_max, device=device)
    q_valid = qi[None, :] < q_lens[:, None]  # [B, Q]
    rows = torch.where(q_valid, q_start[:, None] + qi[None, :], 0)
    pages = batch.page_tables[idx][:, :p_max]  # [B, P]; tables are padded with page 0 (masked)
    heads = torch.arange(kv_heads, dtype=torch.int64, device=device)
    blocks = pages[:, None, :] * kv_heads + heads[None, :, None]  # [B, kv, P]

    kj = torch.arange(l_max, device=device)
    k_valid = kj[None, :] < s_lens[:, None]  # [B, L]
    if q_max == 1:
        # A decode query sees every key its sequence holds: an additive bias is all it needs.
        bias = torch.zeros((len(members), 1, 1, l_max), dtype=dtype, device=device)
        mask = bias.masked_fill_(~k_valid[:, None, None, :], float("-inf"))
    else:
        # Query i of a sequence sits at position seq_len - q_len + i and sees keys up to it.
        q_pos = (s_lens - q_lens)[:, None] + qi[None, :]  # [B, Q]
        visible = (kj[None, None, :] <= q_pos[:, :, None]) & k_valid[:, None, :]
        # Padded query rows see key 0 so their softmax stays finite; their output is dropped.
        visible = visible | (~q_valid[:, :, None] & (kj == 0)[None, None, :])
        # Query rows are ordered (head within its K/V group, position): repeat the mask per head.
        mask = visible[:, None].expand(-1, per_kv, -1, -1).reshape(len(members), 1, per_kv * q_max, l_max)

    flat_valid = q_valid.reshape(-1)
    return _Group(
        rows=rows.reshape(-1),
        out_rows=rows.reshape(-1)[flat_valid],
        out_select=torch.nonzero(flat_valid).reshape(-1),
        blocks=blocks.reshape(-1),
        mask=mask,
        batch=len(members),
        queries=q_max,
        keys=l_max,
    )


class _PreparedTorchAttention:
    def __init__(self, batch: AttentionBatch, num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> None:
        self._kv_heads = num_kv_heads
        page_size = batch.page_size
        slots = batch.slot_mapping
        # Row of [num_pages * kv_heads * page_size, head_dim] that token t's head h goes to.
        heads = torch.arange(num_kv_heads, dtype=torch.int64, device=slots.device)
        self._write_rows = (
            ((slots // page_size)[:, None] * num_kv_heads + heads[None, :]) * page_size
            + (slots % page_size)[:, None]
        ).reshape(-1)
        self._batch = batch
        self._per_kv = num_heads // num_kv_heads
        self._dtype = dtype

    @functools.cached_property
    def _groups(self) -> list[_Group]:
        """Built on the first attend, once per forward: a backend that attends some steps
        itself (kernels.attention.native_attention) and only writes through this one never pays for them."""
        batch = self._batch
        decode = [i for i, n in enumerate(batch.query_lens) if n == 1]
        longer = [i for i, n in enumerate(batch.query_lens) if n > 1]
        starts = [0]
        for n in batch.query_lens[:-1]:
            starts.append(starts[-1] + n)
        return [
            _build_group(batch, members, starts, self._kv_heads, self._per_kv, self._dtype)
            for members in (decode, longer)
            if members
        ]

    @functools.cached_property
    def _in_order(self) -> bool:
        """The whole batch is one decode group in order: outputs need no scatter."""
        return len(self._groups) == 1 and self._groups[0].queries == 1

    def write_kv(self, cache: KVLayer, k: torch.Tensor, v: torch.Tensor) -> None:
        head_dim = cache.k.shape[-1]
        rows = self._write_rows
        if cache.k_scale is None or cache.v_scale is None:  # a float cache, in its own dtype
            cache.k.view(-1, head_dim).index_copy_(0, rows, k.reshape(-1, head_dim).to(cache.k.dtype))
            cache.v.view(-1, head_dim).index_copy_(0, rows, v.reshape(-1, head_dim).to(cache.v.dtype))
            return
        for x, store, scales in ((k, cache.k, cache.k_scale), (v, cache.v, cache.v_scale)):
            q, scale = quantize_kv(x.reshape(-1, head_dim))
            store.view(-1, head_dim).index_copy_(0, rows, q)
            scales.view(-1).index_copy_(0, rows, scale)

    def attend(self, q: torch.Tensor, cache: KVLayer) -> torch.Tensor:
        tokens, heads, head_dim = q.shape
        if self._in_order:
            return self._attend_group(self._groups[0], q, cache)
        out = torch.empty((tokens, heads * head_dim), dtype=q.dtype, device=q.device)
        for group in self._groups:
            out[group.out_rows] = self._attend_group(group, q, cache)
        return out

    @staticmethod
    def _gather(g: _Group, store: torch.Tensor, shape: tuple[int, int, int, int], which: int) -> torch.Tensor:
        """The group's whole page blocks of K or V as stored -> [B, kv, P * page_size, D] (one
        index_select into the thread's scratch buffer `which`: valid until the next layer's gather)."""
        page_size, head_dim = store.shape[2], store.shape[3]
        width = page_size * head_dim
        out = _gather_scratch().take(which, g.blocks.shape[0], width, store.dtype, store.device)
        torch.index_select(store.view(-1, width), 0, g.blocks, out=out)
        return out.view(shape)

    def _attend_group(self, g: _Group, q: torch.Tensor, cache: KVLayer) -> torch.Tensor:
        _, heads, head_dim = q.shape
        kv_heads = self._kv_heads
        per_kv = heads // kv_heads
        page_size = cache.page_size
        b, nq = g.batch, g.queries
        num_pages = g.blocks.shape[0] // (b * kv_heads)
        scale = head_dim**-0.5
        # [num_pages * kv, page_size * D] rows -> [B, kv, P * page_size, D], each (sequence, head) contiguous.
        shape = (b, kv_heads, num_pages * page_size, head_dim)
        k = self._gather(g, cache.k, shape, 0)[:, :, : g.keys]
        v = self._gather(g, cache.v, shape, 1)[:, :, : g.keys]
        ks = vs = None
        if cache.k_scale is None and k.dtype != q.dtype:  # a float16 cache under float32 queries
            k, v = k.to(q.dtype), v.to(q.dtype)
        if cache.k_scale is not None and cache.v_scale is not None:
            # Each key's scale, gathered with its block: [B, kv, keys] float32.
            ks, vs = (
                sc.view(-1, page_size).index_select(0, g.blocks).view(b, kv_heads, -1)[:, :, : g.keys].float()
                for sc in (cache.k_scale, cache.v_scale)
            )
        if nq == 1:
            qg = (q if self._in_order else q[g.rows]).reshape(b, kv_heads, per_kv, head_dim)
            if ks is None or vs is None:
                s = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale).add_(g.mask)  # [B, kv, per_kv, keys]
                p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
                return torch.matmul(p, v).reshape(b, heads * head_dim)
            # int8: the blocks are only converted (exact in any float dtype); a key's scale goes on its
            # scores and a value's on its probabilities: [B, kv, per_kv, keys] products instead of
            # [B, kv, keys, D] (measured ~15% less decode attention time in float32, ~30% in bfloat16).
            s = torch.matmul(qg, k.to(q.dtype).transpose(-1, -2)).to(torch.float32)
            s = s.mul_(ks.mul_(scale)[:, :, None]).add_(g.mask)
            p = torch.softmax(s, dim=-1).mul_(vs[:, :, None]).to(q.dtype)
            return torch.matmul(p, v.to(q.dtype)).reshape(b, heads * head_dim)
        if ks is not None and vs is not None:
            # SDPA takes K/V as they are: dequantize the gathered blocks (exact products in float32).
            k, v = dequantize_kv(k, ks, q.dtype), dequantize_kv(v, vs, q.dtype)
        # [B, Q, kv, per_kv, D] -> [B, kv, per_kv * Q, D]
        qg = q[g.rows].view(b, nq, kv_heads, per_kv, head_dim)
        qg = qg.permute(0, 2, 3, 1, 4).reshape(b, kv_heads, per_kv * nq, head_dim)
        ctx = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.mask, scale=scale)
        # [B, kv, per_kv, Q, D] -> [B, Q, kv, per_kv, D] -> rows
        ctx = ctx.view(b, kv_heads, per_kv, nq, head_dim).permute(0, 3, 1, 2, 4)
        ctx = ctx.reshape(b * nq, heads * head_dim)
        return ctx[g.out_select]


class TorchPagedAttention:
    """The AttentionBackend for CPU tensors (and the reference for the Triton path)."""

    def prepare(
        self, batch: AttentionBatch, num_heads: int, num_kv_heads: int, dtype: torch.dtype
    ) -> _PreparedTorchAttention:
        return _PreparedTorchAttention(batch, num_heads, num_kv_heads, dtype)
