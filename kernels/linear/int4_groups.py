"""Group-wise 4-bit weights: 32 consecutive input values share one scale and one offset.

    w[n, 32 g + i] = scale[n, g] * q[n, 32 g + i] + offset[n, g],   q in 0..15

This is GGUF's Q4_1 block exactly (scale d, offset m) and Q4_0 with offset -8 d, so a
file's 4-bit blocks are kept as stored; other weights are quantized into it by the
min/max of each group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

GROUP_SIZE = 32


@dataclass(frozen=True)
class Int4Groups:
    q: torch.Tensor  # uint8 [out, in], values 0..15
    scale: torch.Tensor  # float32 [out, in // GROUP_SIZE]
    offset: torch.Tensor  # float32 [out, in // GROUP_SIZE]

    def __post_init__(self) -> None:
        out, inp = self.q.shape
        groups = (out, inp // GROUP_SIZE)
        if inp % GROUP_SIZE or tuple(self.scale.shape) != groups or tuple(self.offset.shape) != groups:
            raise ValueError(
                f"int4 groups: q {tuple(self.q.shape)}, scale {tuple(self.scale.shape)}, "
                f"offset {tuple(self.offset.shape)} do not form groups of {GROUP_SIZE}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.q.shape[0]), int(self.q.shape[1])

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in], rounded as GGUF's reference does: one rounding of scale * q + offset."""
        out, inp = self.shape
        q = self.q.view(out, -1, GROUP_SIZE).to(torch.float32)
        return (q * self.scale[..., None] + self.offset[..., None]).view(out, inp)

    @staticmethod
    def cat(parts: Sequence[Int4Groups]) -> Int4Groups:
        """Stack along the output rows (fused Q/K/V, gate/up)."""
        return Int4Groups(
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.offset for p in parts]),
        )

    @staticmethod
    def quantize(weight: torch.Tensor) -> Int4Groups:
        """Round-to-nearest asymmetric quantization by each group's min and max (Q4_1's scheme).

        Scale and offset are rounded to float16 first, as Q4_1 stores them, which also keeps the
        int4 kernel's zero (offset + 8 * scale) exact in float32.
        """
        out, inp = (int(d) for d in weight.shape)
        if inp % GROUP_SIZE:
            raise ValueError(f"int4 groups need in_features divisible by {GROUP_SIZE}, got {inp}")
        w = weight.to(torch.float32).reshape(out, -1, GROUP_SIZE)
        lo = w.amin(-1)
        hi = w.amax(-1)
        scale = ((hi - lo) / 15).to(torch.float16).to(torch.float32)
        lo = lo.to(torch.float16).to(torch.float32)
        inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
        q = torch.round((w - lo[..., None]) * inv[..., None]).clamp_(0, 15).to(torch.uint8)
        return Int4Groups(q.view(out, inp), scale.contiguous(), lo.contiguous())
