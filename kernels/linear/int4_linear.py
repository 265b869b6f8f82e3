"""Group-wise int4 linear over torch's CPU int4 kernel (groups of 32 along the input).

torch._weight_int4pack_mm_for_cpu computes with w = (q - 8) * scale + zero per group,
so a group stored as w = d * q + m (GGUF Q4_1; Q4_0 is m = -8 d) maps onto scale = d,
zero = m + 8 d. With float32 activations that reproduces the stored weights exactly
(d and m are float16 in the file, so m + 8 d is exact in float32), but that path is
scalar and 15-60x slower here; bfloat16 activations take the vectorised path, where
scale and zero are rounded to bfloat16. The default computes in bfloat16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.linear.int4_groups import GROUP_SIZE, Int4Groups
from kernels.linear.linear_kind import LinearKind

COMPUTE_DTYPE = torch.bfloat16
_ZERO_POINT = 8  # the kernel's fixed midpoint: w = (q - 8) * scale + zero
_INNER_K_TILES = 2  # a packing hint for the CUDA layout; the CPU packing ignores it
_ROW_MULTIPLE = 16  # the CPU packing wants out_features divisible by 16; extra rows are zero


class Int4Linear:
    kind = LinearKind.INT4

    def __init__(
        self,
        groups: Int4Groups,
        bias: torch.Tensor | None = None,
        from_file: bool = False,
        compute_dtype: torch.dtype = COMPUTE_DTYPE,
    ) -> None:
        self.out_features, self.in_features = groups.shape
        self.bias = bias
        self.from_file = from_file
        self.compute_dtype = compute_dtype
        pad = -self.out_features % _ROW_MULTIPLE
        if pad:
            groups = Int4Groups(
                F.pad(groups.q, (0, 0, 0, pad)),
                F.pad(groups.scale, (0, 0, 0, pad)),
                F.pad(groups.offset, (0, 0, 0, pad)),
            )
        self.packed = torch._convert_weight_to_int4pack_for_cpu(groups.q.to(torch.int32), _INNER_K_TILES)
        zero = groups.offset + _ZERO_POINT * groups.scale
        # [in // GROUP_SIZE, out, 2]: (scale, zero) per group, as the kernel wants it.
        self.scale_zero = (
            torch.stack([groups.scale, zero], dim=-1).transpose(0, 1).to(compute_dtype).contiguous()
        )

    def describe(self) -> str:
        return "int4[file]" if self.from_file else "int4[requant]"

    def weight_bytes(self) -> int:
        return self.packed.numel() + self.scale_zero.numel() * self.scale_zero.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(self.compute_dtype)
        y = torch._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP_SIZE, self.scale_zero)
        y = y[:, : self.out_features].to(x.dtype)
        if self.bias is not None:
            y.add_(self.bias)  # in place: the output keeps the caller's dtype
        return y.reshape(*x.shape[:-1], self.out_features)
