"""The KV cache: a pool of fixed-size pages per layer, addressed by slot.

Layout per layer: [num_pages, num_kv_heads, page_size, head_dim]. A token's slot is
page * page_size + offset, and its K/V for head h sit at [page, h, offset]. Pages are
head-major so that one page of one head is a contiguous [page_size, head_dim] matrix:
attention can gather whole pages and multiply them in place, with no per-token copy.
Which page belongs to which sequence is the page tables' business (the caller's);
this module only owns the storage.

Kinds (kernels.attention.kv_layer.KVCacheKind): FLOAT keeps K/V in the model's dtype; FLOAT16 in
float16 (half a float32 cache's bytes, which decode attention reads every step); BFLOAT16 in
bfloat16 (the same bytes; where the CPU multiplies bfloat16 pairs natively, the native attention
does so); INT8 keeps
them as int8 in the same layout plus a float16 scale per token and head
([layers, num_pages, kv_heads, page_size]), quantized as they are written and
dequantized inside attention: ~3.8x the tokens of a float32 cache in the same memory.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import assert_never

import torch

from engine.errors import CacheTooLargeError
from kernels.attention.kv_layer import KV_SCALE_DTYPE, KVCacheKind, KVLayer

__all__ = ["CacheShape", "KVCacheKind", "PagedKVCache", "choose_kv_cache"]


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def bytes_per_token(self, dtype: torch.dtype, kind: KVCacheKind = KVCacheKind.FLOAT) -> int:
        """K and V of one token over all layers, scales included; `dtype` is the model's."""
        per_head = self.head_dim * _elem(storage_dtype(kind, dtype))
        if kind is KVCacheKind.INT8:
            per_head += _elem(KV_SCALE_DTYPE)
        return 2 * self.num_layers * self.num_kv_heads * per_head

    def pages_within(
        self, budget_bytes: int, dtype: torch.dtype, kind: KVCacheKind = KVCacheKind.FLOAT
    ) -> int:
        """Whole pages of this geometry that fit in `budget_bytes` (num_pages is ignored)."""
        return budget_bytes // (self.page_size * self.bytes_per_token(dtype, kind))


def storage_dtype(kind: KVCacheKind, dtype: torch.dtype) -> torch.dtype:
    """What a cache of `kind` stores K/V as, for a model computing in `dtype`."""
    match kind:
        case KVCacheKind.FLOAT:
            return dtype
        case KVCacheKind.FLOAT16:
            return torch.float16
        case KVCacheKind.BFLOAT16:
            return torch.bfloat16
        case KVCacheKind.INT8:
            return torch.int8
        case _:
            assert_never(kind)


def choose_kv_cache(setting: str, dtype: torch.dtype, quantized: bool, tiles: bool = False) -> KVCacheKind:
    """`--kv-cache`'s value as a kind. auto, for a float32 model with quantized linears: decode
    attention reads every cached K/V row each step, so fewer bytes a row pay where the kernel
    keeps up with them.
    - Where the attention runs on AMX tiles (`tiles`: the model's `tile_attention`): int8. Its
      scores are one int8 tile product a block of 16 keys straight from the cache, at a quarter
      of float32's bytes. On the Intel AMX part here, against bfloat16 on the same tiles: the
      chat trace at 8 requests/s served 786-861 against 698-749 tok/s, W1 +9-13%, 48 streams of
      ~800-token prompts +9-15%, batch-1 editing +8% without drafts and +3-7% adaptive;
      perplexity +0.58% against +0.42% of the float cache's (KL 0.0039 against 0.0035,
      benchmarks/quality/perplexity.py), inside the 1% gate.
    - Elsewhere: float16, 2 bytes a value (half the bytes made W1 ~10% faster, with perplexity,
      KL divergence and top-1 agreement against the float path moved by less than their noise).
      The vector path dequantizes int8 in registers: 100 decode rows of the chat trace's mix took
      114-120 ms over 30 layers against float16's 85-88 (tiles off, same part). Where the CPU
      multiplies bfloat16 pairs, engine.model.kv_cache_tune times float16 against bfloat16 on
      the model and may take bfloat16 instead.
    A float32 model with float linears keeps a float32 cache, so its greedy tokens stay those of
    the float reference; a bfloat16 or float16 model's cache is already 2 bytes a value."""
    if setting != "auto":
        return KVCacheKind(setting)
    if quantized and dtype == torch.float32:
        return KVCacheKind.INT8 if tiles else KVCacheKind.FLOAT16
    return KVCacheKind.FLOAT


def _machine_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _zeroed(dims: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros that cost nothing until written. On the CPU the memory is an anonymous map, which
    the OS hands out zeroed page by page as it is first touched, so a 1.4 GiB cache is not
    written whole at start (1.9 s here). Plain pages: numpy's large arrays ask for huge pages,
    whose first touch compacted memory for ~9 ms each here."""
    if device.type != "cpu":
        return torch.zeros(dims, dtype=dtype, device=device)
    nbytes = math.prod(dims) * _elem(dtype)
    if nbytes == 0:
        return torch.zeros(dims, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(dims)


class PagedKVCache:
    def __init__(
        self,
        shape: CacheShape,
        dtype: torch.dtype,
        device: torch.device,
        kind: KVCacheKind = KVCacheKind.FLOAT,
    ) -> None:
        """`dtype`: the model's activations; a FLOAT cache stores K/V in it, an INT8 one in int8."""
        if shape.page_size <= 0 or shape.num_pages <= 0:
            raise ValueError(f"page size and page count must be positive, got {shape}")
        self.shape = shape
        self.dtype = dtype
        self.kind = kind
        dims = (shape.num_layers, shape.num_pages, shape.num_kv_heads, shape.page_size, shape.head_dim)
        store = storage_dtype(kind, dtype)
        wanted = shape.num_slots * shape.bytes_per_token(dtype, kind)
        what = f"a KV cache of {shape.num_slots} tokens ({wanted / 2**30:.1f} GiB)"
        memory = _machine_memory() if device.type == "cpu" else None
        if memory is not None and wanted > memory:
            raise CacheTooLargeError(
                f"{what} is more than this machine's memory ({memory / 2**30:.1f} GiB); ask for fewer cache tokens"
            )
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        try:
            self.k = _zeroed(dims, store, device)
            self.v = _zeroed(dims, store, device)
            if kind is KVCacheKind.INT8:
                self.k_scale = _zeroed(dims[:-1], KV_SCALE_DTYPE, device)
                self.v_scale = _zeroed(dims[:-1], KV_SCALE_DTYPE, device)
        except (OSError, MemoryError, RuntimeError) as exc:  # the OS or the device said no
            raise CacheTooLargeError(
                f"{what} cannot be allocated ({exc}); ask for fewer cache tokens"
            ) from exc
        # Built once: the forward asks for every layer's view twice per step.
        self._layers = tuple(
            KVLayer(
                self.k[i],
                self.v[i],
                None if self.k_scale is None else self.k_scale[i],
                None if self.v_scale is None else self.v_scale[i],
            )
            for i in range(shape.num_layers)
        )

    @property
    def page_size(self) -> int:
        return self.shape.page_size

    @property
    def num_pages(self) -> int:
        return self.shape.num_pages

    def layer(self, i: int) -> KVLayer:
        """Layer i's K/V (and scales): what PreparedAttention.write_kv / attend take."""
        return self._layers[i]

    @property
    def bytes_per_token(self) -> int:
        return self.shape.bytes_per_token(self.dtype, self.kind)

    @property
    def nbytes(self) -> int:
        scales = [t for t in (self.k_scale, self.v_scale) if t is not None]
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, *scales))

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy pages src[i] -> dst[i] in every layer (copy on write); an int8 cache's scales go too."""
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} source pages for {len(dst)} destinations")
        device = self.k.device
        s = torch.tensor(src, dtype=torch.int64, device=device)
        d = torch.tensor(dst, dtype=torch.int64, device=device)
        for t in (self.k, self.v, self.k_scale, self.v_scale):
            if t is not None:
                t.index_copy_(1, d, t.index_select(1, s))

    def copy_prefix(self, src: int, dst: int, tokens: int) -> None:
        """Copy the first `tokens` slots of page `src` into page `dst` in every layer (scales too):
        a partial prefix hit takes the K/V another sequence computed for the same leading tokens."""
        if not 0 < tokens <= self.page_size:
            raise ValueError(f"can copy 1..{self.page_size} slots of a page, not {tokens}")
        for t in (self.k, self.v, self.k_scale, self.v_scale):
            if t is not None:
                t[:, dst, :, :tokens] = t[:, src, :, :tokens]

    @property
    def stored_dtype(self) -> str:
        """The dtype K/V are stored in: "bfloat16", "float32", "int8", ..."""
        return str(storage_dtype(self.kind, self.dtype)).removeprefix("torch.")

    def describe(self) -> str:
        """What the cache holds, for logs and GetModelInfo."""
        match self.kind:
            case KVCacheKind.FLOAT:
                what = f"float ({str(self.dtype).removeprefix('torch.')})"
            case KVCacheKind.FLOAT16:
                what = "float16"
            case KVCacheKind.BFLOAT16:
                what = "bfloat16"
            case KVCacheKind.INT8:
                what = "int8 (float16 scale per token and head)"
            case _:
                assert_never(self.kind)
        s = self.shape
        return (
            f"{what}: {s.num_slots} tokens in {s.num_pages} pages of {s.page_size}, "
            f"{self.bytes_per_token} bytes/token, {self.nbytes / 2**20:.1f} MiB"
        )
