"""The KV cache: a pool of fixed-size pages per layer, addressed by slot.

Layout per layer: [num_pages, num_kv_heads, page_size, head_dim]. A token's slot is
page * page_size + offset, and its K/V for head h sit at [page, h, offset]. Pages are
head-major so that one page of one head is a contiguous [page_size, head_dim] matrix:
attention can gather whole pages and multiply them in place, with no per-token copy.
Which page belongs to which sequence is the page tables' business (the caller's);
this module only owns the storage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


class PagedKVCache:
    def __init__(self, shape: CacheShape, dtype: torch.dtype, device: torch.device) -> None:
        if shape.page_size <= 0 or shape.num_pages <= 0:
            raise ValueError(f"page size and page count must be positive, got {shape}")
        self.shape = shape
        self.dtype = dtype
        dims = (shape.num_layers, shape.num_pages, shape.num_kv_heads, shape.page_size, shape.head_dim)
        self.k = torch.zeros(dims, dtype=dtype, device=device)
        self.v = torch.zeros(dims, dtype=dtype, device=device)

    @property
    def page_size(self) -> int:
        return self.shape.page_size

    @property
    def num_pages(self) -> int:
        return self.shape.num_pages
