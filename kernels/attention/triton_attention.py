"""Paged attention with Triton kernels: the CUDA path behind the AttentionBackend protocol.

Per forward, `prepare` turns the batch into small int32 tensors (lengths, query
starts, page tables, which sequences decode and which carry several queries); every
layer then launches at most four kernels: the K/V write, the split decode kernel and
its reduction, and the multi-query kernel. Nothing is gathered or padded on the host:
the kernels read K/V through the page tables in place.

The caches are the PagedKVCache layout per layer, [num_pages, kv_heads, page_size,
head_dim] (head-major pages, head_dim contiguous); slot s of head h is
[s // page_size, h, s % page_size]. The kernels take the page, head and
offset-in-page strides, so any such view with a contiguous head_dim works. An int8
cache (kernels.attention.kv_layer.KVLayer with scales) is quantized by its own write kernel and
dequantized inside the attention kernels (QUANT), which also take the scales' strides.

Triton has no CPU backend: on CPU tensors the kernels only run under the interpreter
(TRITON_INTERPRET=1 set before this module is imported), which is how the tests
compare them with the torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.runtime import JITFunction

from kernels.attention.batch import AttentionBatch
from kernels.attention.kv_layer import KVLayer
from kernels.attention.triton_attention_kernels import (
    decode_partial_kernel,
    decode_reduce_kernel,
    prefill_kernel,
    write_kv_int8_kernel,
    write_kv_kernel,
)

WRITE_BLOCK_T = 16  # tokens per program of the K/V write


@dataclass(frozen=True)
class Tiles:
    """Tile sizes of the attention kernels (compile-time constants; powers of two)."""

    block_n: int = 32  # keys per step of the inner loops
    block_rows: int = 64  # multi-query tile rows (tokens x query heads of one K/V head); >= 16 for tl.dot
    # Keys per decode split: long sequences are cut into pieces run by separate programs so a
    # batch of a few long sequences still fills the device; short ones are a single split.
    split_len: int = 512

    def __post_init__(self) -> None:
        if self.split_len < self.block_n or self.split_len % self.block_n:
            raise ValueError(f"split_len must be a positive multiple of block_n, got {self}")
        if self.block_rows < 16:
            raise ValueError(f"block_rows must be at least 16, got {self}")


GPU_TILES = Tiles()
# The interpreter pays per operation, not per element: larger tiles mean fewer programs and
# loop steps. Same kernels, other constants; the tests run both.
INTERPRETER_TILES = Tiles(block_n=64, block_rows=256)


def interpreted() -> bool:
    """Whether the kernels were defined under TRITON_INTERPRET (and so run on CPU tensors)."""
    return not isinstance(decode_partial_kernel, JITFunction)


def check_device(t: torch.Tensor) -> None:
    if t.device.type == "cpu" and not interpreted():
        raise RuntimeError(
            "Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before kernels.triton_* is imported"
        )


@dataclass(frozen=True)
class PagedMeta:
    """Per-forward metadata the kernels read; int32 on the cache's device."""

    page_tables: torch.Tensor  # [B, max_pages]
    seq_lens: torch.Tensor  # [B] keys per sequence after this step's write
    query_lens: torch.Tensor  # [B]
    query_starts: torch.Tensor  # [B] first row of each sequence in the flattened batch
    decode_ids: torch.Tensor  # [n_decode] sequences with one query
    decode_rows: torch.Tensor  # [n_decode] their rows
    multi_ids: torch.Tensor  # [n_multi] sequences with several queries
    page_size: int
    max_decode_len: int
    max_multi_query: int

    @staticmethod
    def build(batch: AttentionBatch, device: torch.device) -> PagedMeta:
        starts = [0]
        for n in batch.query_lens[:-1]:
            starts.append(starts[-1] + n)
        decode = [i for i, n in enumerate(batch.query_lens) if n == 1]
        multi = [i for i, n in enumerate(batch.query_lens) if n > 1]

        def ints(values: list[int] | tuple[int, ...]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        return PagedMeta(
            page_tables=batch.page_tables.to(device=device, dtype=torch.int32),
            seq_lens=ints(batch.seq_lens),
            query_lens=ints(batch.query_lens),
            query_starts=ints(starts),
            decode_ids=ints(decode),
            decode_rows=ints([starts[i] for i in decode]),
            multi_ids=ints(multi),
            page_size=batch.page_size,
            max_decode_len=max((batch.seq_lens[i] for i in decode), default=0),
            max_multi_query=max((batch.query_lens[i] for i in multi), default=0),
        )


def _p2(n: int) -> int:
    return int(triton.next_power_of_2(n))


def _check_cache(cache: torch.Tensor, kv_heads: int, head_dim: int, page_size: int | None = None) -> None:
    assert cache.dim() == 4, (
        f"cache must be [num_pages, kv_heads, page_size, head_dim], got {tuple(cache.shape)}"
    )
    assert cache.shape[1] == kv_heads and cache.shape[3] == head_dim, (tuple(cache.shape), kv_heads, head_dim)
    assert page_size is None or cache.shape[2] == page_size, (tuple(cache.shape), page_size)
    assert cache.stride(3) == 1, "head_dim must be contiguous"


def _check_layer(cache: KVLayer, kv_heads: int, head_dim: int, page_size: int | None = None) -> None:
    _check_cache(cache.k, kv_heads, head_dim, page_size)
    _check_cache(cache.v, kv_heads, head_dim, cache.page_size)
    for scales in (cache.k_scale, cache.v_scale):
        if scales is not None:
            assert tuple(scales.shape) == tuple(cache.k.shape[:3]), (
                tuple(scales.shape),
                tuple(cache.k.shape),
            )
            assert scales.stride(2) == 1, "a page's scales must be contiguous"


def _scale_args(cache: KVLayer) -> tuple[torch.Tensor, torch.Tensor, int, int, int, int]:
    """Scale pointers and (page, head) strides; a float cache passes K/V and zeros (never read)."""
    if cache.k_scale is None or cache.v_scale is None:
        return cache.k, cache.v, 0, 0, 0, 0
    ks, vs = cache.k_scale, cache.v_scale
    return ks, vs, ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1)


def write_kv(cache: KVLayer, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v [T, kv_heads, head_dim] into the layer's cache [num_pages, kv_heads, page_size, head_dim] at `slots` [T].

    A float cache gets a copy; an int8 one gets each row quantized, with its scale.
    """
    check_device(cache.k)
    tokens, kv_heads, head_dim = k.shape
    page_size = cache.page_size
    row = kv_heads * head_dim
    if k.stride(2) != 1 or k.stride(1) != head_dim:
        k = k.contiguous()
    if v.stride(2) != 1 or v.stride(1) != head_dim:
        v = v.contiguous()
    _check_layer(cache, kv_heads, head_dim)
    kc, vc = cache.k, cache.v
    cache_strides = (kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2))
    if cache.quantized:
        ks, vs, *scale_strides = _scale_args(cache)
        write_kv_int8_kernel[(triton.cdiv(tokens, WRITE_BLOCK_T), kv_heads)](
            k, v, kc, vc, ks, vs, slots, tokens, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            *cache_strides, *scale_strides,
            PAGE_SIZE=page_size, HEAD_DIM=head_dim, BLOCK_T=WRITE_BLOCK_T,
        )  # fmt: skip
        return
    grid = (triton.cdiv(tokens, WRITE_BLOCK_T),)
    write_kv_kernel[grid](
        k, v, kc, vc, slots, tokens, k.stride(0), v.stride(0), *cache_strides,
        PAGE_SIZE=page_size, HEAD_DIM=head_dim, ROW=row, ROW_P2=_p2(row), BLOCK_T=WRITE_BLOCK_T,
    )  # fmt: skip


def paged_attention(
    q: torch.Tensor,
    cache: KVLayer,
    meta: PagedMeta,
    tiles: Tiles = GPU_TILES,
) -> torch.Tensor:
    """q [T, heads, head_dim] against the paged cache -> [T, heads * head_dim] in q's dtype."""
    k_cache, v_cache = cache.k, cache.v
    check_device(k_cache)
    tokens, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads cannot share {kv_heads} K/V heads")
    if head_dim != _p2(head_dim) or head_dim < 16:
        raise ValueError(f"head_dim {head_dim} must be a power of two >= 16")
    if q.stride(2) != 1:
        q = q.contiguous()
    _check_layer(cache, kv_heads, head_dim, meta.page_size)
    per_kv = heads // kv_heads
    per_kv_p2 = _p2(per_kv)
    scale = head_dim**-0.5
    out = torch.zeros((tokens, heads * head_dim), dtype=q.dtype, device=q.device)
    ks, vs, *scale_strides = _scale_args(cache)
    strides = (
        *(q.stride(0), q.stride(1)),
        *(k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)),
        *(v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)),
        *scale_strides,
        meta.page_tables.stride(0),
    )

    n_decode = int(meta.decode_ids.shape[0])
    if n_decode:
        splits = max(1, triton.cdiv(meta.max_decode_len, tiles.split_len))
        # Partial results of the splits; a single split writes the output directly.
        parts = (n_decode, heads, splits) if splits > 1 else (1, 1, 1)
        part_m = torch.empty(parts, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((*parts, head_dim), dtype=torch.float32, device=q.device)
        decode_partial_kernel[(n_decode, kv_heads, splits)](
            q, k_cache, v_cache, ks, vs, meta.page_tables, meta.seq_lens, meta.decode_ids, meta.decode_rows,
            part_m, part_l, part_acc, out, *strides, out.stride(0), splits, scale,
            PAGE_SIZE=meta.page_size, PER_KV=per_kv, PER_KV_P2=per_kv_p2, HEAD_DIM=head_dim,
            BLOCK_N=tiles.block_n, SPLIT_LEN=tiles.split_len, SINGLE_SPLIT=splits == 1,
            QUANT=cache.quantized,
        )  # fmt: skip
        if splits > 1:
            decode_reduce_kernel[(n_decode, kv_heads)](
                part_m, part_l, part_acc, meta.decode_rows, out, out.stride(0), splits,
                PER_KV=per_kv, PER_KV_P2=per_kv_p2, HEAD_DIM=head_dim, SPLITS_P2=_p2(splits),
            )  # fmt: skip

    n_multi = int(meta.multi_ids.shape[0])
    if n_multi:
        block_q = max(1, tiles.block_rows // per_kv_p2)
        q_blocks = triton.cdiv(meta.max_multi_query, block_q)
        prefill_kernel[(n_multi, kv_heads, q_blocks)](
            q, k_cache, v_cache, ks, vs, out, meta.page_tables, meta.seq_lens, meta.query_lens,
            meta.query_starts, meta.multi_ids, *strides, out.stride(0), scale,
            PAGE_SIZE=meta.page_size, PER_KV=per_kv, PER_KV_P2=per_kv_p2, HEAD_DIM=head_dim,
            BLOCK_Q=block_q, BLOCK_N=tiles.block_n, UPCAST_DOT=interpreted(), QUANT=cache.quantized,
        )  # fmt: skip
    return out


class _PreparedTritonAttention:
    def __init__(self, batch: AttentionBatch, tiles: Tiles) -> None:
        self._slots = batch.slot_mapping
        self._meta = PagedMeta.build(batch, batch.slot_mapping.device)
        self._tiles = tiles

    def write_kv(self, cache: KVLayer, k: torch.Tensor, v: torch.Tensor) -> None:
        _check_layer(cache, k.shape[1], k.shape[2], self._meta.page_size)
        write_kv(cache, k, v, self._slots)

    def attend(self, q: torch.Tensor, cache: KVLayer) -> torch.Tensor:
        return paged_attention(q, cache, self._meta, self._tiles)


class TritonPagedAttention:
    """The AttentionBackend for CUDA caches (or CPU ones under TRITON_INTERPRET=1)."""

    def __init__(self, tiles: Tiles | None = None) -> None:
        self.tiles = tiles or (INTERPRETER_TILES if interpreted() else GPU_TILES)

    def prepare(
        self, batch: AttentionBatch, num_heads: int, num_kv_heads: int, dtype: torch.dtype
    ) -> _PreparedTritonAttention:
        return _PreparedTritonAttention(batch, self.tiles)
