"""Paged attention on the CPU with the native kernel (kernels/native/csrc/cpu_kernels.c).

Every query row is attended by one native call that walks its sequence's page table in place:
no page gather, no padding mask, one softmax pass per (row, K/V head), in float32 over a float32,
float16 or int8 cache. A step with query chunks (prefill, mixed steps, speculative verification)
runs each chunk token as a row of its own, seeing the keys up to its position, so it gets bit for
bit what decoding that token alone would: a job's tokens do not depend on how its tokens were
split into steps, which is what makes a resumed job (prompt and output prefilled again), a prefix
cache hit and a verified draft give the tokens of an uninterrupted decode. (It replaced a flash-style
chunk kernel that rounded apart from decoding: a 512-token prefill takes 6-10% longer, a 2048-token
one 21-26%, on the Zen 5 part with a float16 cache.)
K/V writes and other activation dtypes are the torch path's, so the two never disagree on layout
or on what is written.
"""

from __future__ import annotations

import torch

from kernels.attention.batch import AttentionBatch
from kernels.attention.kv_layer import KVLayer
from kernels.attention.torch_attention import TorchPagedAttention
from kernels.native.native_library import CACHE_DTYPES, NativeLibrary


class _PreparedNativeAttention:
    def __init__(
        self, lib: NativeLibrary, batch: AttentionBatch, num_heads: int, num_kv_heads: int, dtype: torch.dtype
    ) -> None:
        self._lib = lib
        self._torch = TorchPagedAttention().prepare(batch, num_heads, num_kv_heads, dtype)
        self._float = dtype == torch.float32
        self._row_seq: torch.Tensor | None = None  # each row's sequence, where rows are chunk tokens
        if not self._float:
            return
        self._tables = batch.page_tables.contiguous()
        self._row_seq, self._lens = batch.query_rows()

    def write_kv(self, cache: KVLayer, k: torch.Tensor, v: torch.Tensor) -> None:
        self._torch.write_kv(cache, k, v)

    def attend(self, q: torch.Tensor, cache: KVLayer) -> torch.Tensor:
        head_dim = int(q.shape[-1])
        if not self._float or (not cache.quantized and cache.k.dtype not in CACHE_DTYPES):
            return self._torch.attend(q, cache)
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()  # rows may be strided (views of the fused QKV), heads may not
        return self._lib.decode_attention(
            q,
            cache.k,
            cache.v,
            cache.k_scale,
            cache.v_scale,
            self._tables,
            self._lens,
            head_dim**-0.5,
            self._row_seq,
        )


class NativePagedAttention:
    """The AttentionBackend for CPU tensors when the native kernels are built."""

    def __init__(self, lib: NativeLibrary) -> None:
        self._lib = lib

    def tiles_for(self, heads: int, kv_heads: int, head_dim: int, page_size: int) -> bool:
        """Whether a bfloat16 or int8 cache of this geometry is attended on AMX tiles here."""
        return self._lib.tile_attends(heads, kv_heads, head_dim, page_size)

    def prepare(
        self, batch: AttentionBatch, num_heads: int, num_kv_heads: int, dtype: torch.dtype
    ) -> _PreparedNativeAttention:
        return _PreparedNativeAttention(self._lib, batch, num_heads, num_kv_heads, dtype)
