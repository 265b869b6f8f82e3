"""Weight-only int8 linear: int8 weights with one scale per output row, float activations.

torch._weight_int8pack_mm has a vectorised CPU kernel for bfloat16 activations only;
float32 activations take a scalar path measured 10-40x slower at this model's shapes,
so activations are cast to bfloat16 inside and the result cast back.
"""

from __future__ import annotations

import torch

from kernels.linear.linear_kind import LinearKind

COMPUTE_DTYPE = torch.bfloat16


class Int8WeightLinear:
    kind = LinearKind.INT8_WEIGHT

    def __init__(
        self,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None = None,
        compute_dtype: torch.dtype = COMPUTE_DTYPE,
    ) -> None:
        self.out_features, self.in_features = (int(d) for d in qweight.shape)
        self.qweight = qweight.to(torch.int8).contiguous()
        self.compute_dtype = compute_dtype
        self.scales = scales.to(compute_dtype).contiguous()
        self.bias = bias

    @staticmethod
    def quantize(
        weight: torch.Tensor, bias: torch.Tensor | None = None, compute_dtype: torch.dtype = COMPUTE_DTYPE
    ) -> Int8WeightLinear:
        """Symmetric per-row quantization: scale = max |w| / 127, round to nearest."""
        w = weight.to(torch.float32)
        scales = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
        q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        return Int8WeightLinear(q, scales, bias, compute_dtype)

    def effective_weight(self) -> torch.Tensor:
        """The float32 weight the kernel multiplies by."""
        return self.qweight.to(torch.float32) * self.scales.to(torch.float32)[:, None]

    def describe(self) -> str:
        return "int8_weight"

    def weight_bytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * self.scales.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(self.compute_dtype)
        y = torch._weight_int8pack_mm(rows, self.qweight, self.scales).to(x.dtype)
        if self.bias is not None:
            y.add_(self.bias)  # in place: the output keeps the caller's dtype
        return y.view(*x.shape[:-1], self.out_features)
