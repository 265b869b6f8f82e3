"""Dynamic int8 linear (fbgemm): int8 weights per output row, activations quantized per call.

Each call quantizes the float32 activations to uint8 with one scale from their min/max,
multiplies in int8 with int32 sums, and returns float32. Without VNNI, fbgemm's AVX2
kernel adds pairs of u8*s8 products in 16 bits, which saturates for full-range
activations; reduce_range keeps them to 7 bits so it cannot.
"""

from __future__ import annotations

import warnings

import torch

from kernels.linear.linear_kind import LinearKind


class Int8DynamicLinear:
    kind = LinearKind.INT8_DYNAMIC

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, reduce_range: bool = True
    ) -> None:
        self.out_features, self.in_features = (int(d) for d in weight.shape)
        self.reduce_range = reduce_range
        w = weight.to(torch.float32)
        scales = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
        zero_points = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():
            # torch marks quantized tensor creation deprecated; it is still the prepack's only input.
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(w, scales.double(), zero_points, 0, torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(
            qweight, None if bias is None else bias.to(torch.float32)
        )
        self._weight_bytes = qweight.numel() + scales.numel() * 4

    def describe(self) -> str:
        return "int8_dynamic"

    def weight_bytes(self) -> int:
        return self._weight_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.float32)
        y: torch.Tensor = torch.ops.quantized.linear_dynamic(rows, self._packed, self.reduce_range)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)
