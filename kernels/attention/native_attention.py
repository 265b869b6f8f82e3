"""Paged attention on the CPU with the native decode kernel (kernels/native/csrc/cpu_kernels.c).

A step where every sequence brings one new token (steady decoding) is attended by one
native call that walks each sequence's page table in place: no page gather, no padding
mask, one softmax pass per (sequence, K/V head), in float32 over a float32, float16 or int8
cache. Steps with query chunks (prefill, mixed steps, speculative verification) over a float32
or float16 cache are attended in place too, flash-style, where the build has that kernel (512-bit
builds). Everything else (K/V writes, int8 caches' chunks, other dtypes, other builds)
is the torch path's, so the two never disagree on layout or on what is written.
"""

from __future__ import annotations

import torch

from kernels.attention.batch import AttentionBatch
from kernels.attention.kv_layer import KVLayer
from kernels.attention.torch_attention import TorchPagedAttention
from kernels.native.native_library import NativeLibrary


class _PreparedNativeAttention:
    def __init__(
        self, lib: NativeLibrary, batch: AttentionBatch, num_heads: int, num_kv_heads: int, dtype: torch.dtype
    ) -> None:
        self._lib = lib
        self._torch = TorchPagedAttention().prepare(batch, num_heads, num_kv_heads, dtype)
        self._float = dtype == torch.float32
        self._decode = self._float and all(n == 1 for n in batch.query_lens)
        if self._float:
            self._tables = batch.page_tables.contiguous()
            self._lens = torch.tensor(batch.seq_lens, dtype=torch.int64)
            self._query_lens = torch.tensor(batch.query_lens, dtype=torch.int64)
        self._chunks = not self._decode  # until the library says it has no kernel for them

    def write_kv(self, cache: KVLayer, k: torch.Tensor, v: torch.Tensor) -> None:
        self._torch.write_kv(cache, k, v)

    def attend(self, q: torch.Tensor, cache: KVLayer) -> torch.Tensor:
        head_dim = int(q.shape[-1])
        if not self._float or (not cache.quantized and cache.k.dtype not in (torch.float32, torch.float16)):
            return self._torch.attend(q, cache)
        if not self._decode:
            out = None
            if self._chunks and not cache.quantized:  # query chunks over a float32/float16 cache, in place
                out = self._lib.paged_attention(
                    q, cache.k, cache.v, self._tables, self._lens, self._query_lens, head_dim**-0.5
                )
                self._chunks = out is not None  # no kernel here: ask once per forward, not per layer
            return out if out is not None else self._torch.attend(q, cache)
        return self._lib.decode_attention(
            q.contiguous(),
            cache.k,
            cache.v,
            cache.k_scale,
            cache.v_scale,
            self._tables,
            self._lens,
            head_dim**-0.5,
        )


class NativePagedAttention:
    """The AttentionBackend for CPU tensors when the native kernels are built."""

    def __init__(self, lib: NativeLibrary) -> None:
        self._lib = lib

    def prepare(
        self, batch: AttentionBatch, num_heads: int, num_kv_heads: int, dtype: torch.dtype
    ) -> _PreparedNativeAttention:
        return _PreparedNativeAttention(self._lib, batch, num_heads, num_kv_heads, dtype)
