"""One layer's view of the paged KV cache, as the attention backends read and write it.

K and V are [num_pages, kv_heads, page_size, head_dim] (head-major pages, see
engine.cache.kv_cache). A float cache holds them in the model's dtype, a float16 one in float16
(rounded to nearest as written; attention computes in the queries' dtype). An int8 cache holds
them as int8 with one scale per token and head ([num_pages, kv_heads, page_size],
float16), symmetric: x ~ q * scale with scale = absmax(x over head_dim) / 127 and
q = round(x / scale) in [-127, 127], so |x - q * scale| <= scale / 2 per element.

Defined in kernels/ (not the engine) so the backends depend on nothing of the engine.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class KVCacheKind(enum.Enum):
    FLOAT = "float"  # K/V in the model's dtype
    FLOAT16 = "float16"  # K/V in float16 whatever the model's dtype: half a float32 cache's bytes
    # K/V in bfloat16: float16's bytes, fewer mantissa bits; the native attention then multiplies
    # by bfloat16 pairs where the CPU has them (AVX512_BF16), ~2x the products per instruction
    BFLOAT16 = "bfloat16"
    INT8 = "int8"  # K/V int8, a float16 scale per token and head


KV_SCALE_DTYPE = torch.float16
# Smallest scale stored: a float16 normal, so an all-zero row divides by something and a
# subnormal scale never rounds down far enough to push x / scale past 127.5.
_MIN_SCALE = torch.finfo(KV_SCALE_DTYPE).tiny


@dataclass(frozen=True)
class KVLayer:
    """K/V of one layer; the scales are None for a float cache and set for an int8 one."""

    k: torch.Tensor  # [num_pages, kv_heads, page_size, head_dim]: model dtype or int8
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # [num_pages, kv_heads, page_size] float16 (int8 only)
    v_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.k_scale is None) != (self.v_scale is None):
            raise ValueError("K and V scales go together")
        if (self.k_scale is not None) != (self.k.dtype == torch.int8):
            raise ValueError(f"an int8 cache needs scales and only it has them (K is {self.k.dtype})")

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def page_size(self) -> int:
        return int(self.k.shape[2])


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (int8 [..., head_dim], float16 scale [...]): symmetric absmax / 127.

    Rounds half up (floor(x / scale + 0.5)), as the Triton write kernel does, so both paths
    store the same bytes. The division is by the float16-rounded scale that is stored.
    """
    xf = x.to(torch.float32)
    scale = (xf.abs().amax(dim=-1) / 127.0).clamp_min(_MIN_SCALE).to(KV_SCALE_DTYPE)
    q = torch.floor(xf / scale.to(torch.float32).unsqueeze(-1) + 0.5).clamp_(-127.0, 127.0)
    return q.to(torch.int8), scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [..., head_dim] times float16 scale [...] -> `dtype`; the product is exact in float32."""
    out = q.to(torch.float32).mul_(scale.to(torch.float32).unsqueeze(-1))
    return out if dtype == torch.float32 else out.to(dtype)
