"""A floating-point linear layer, prepacked for oneDNN where that is measurably faster.

On the CPU, bfloat16 matmuls through oneDNN with the weight reordered once at load
(its blocked layout) run 15-25% faster at this model's shapes than plain
F.linear, which reorders on every call; float32 gains nothing from it, so float32
and non-CPU weights take the plain path (W @ x^T, faster than F.linear here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.linear.linear_kind import LinearKind

# The batch size oneDNN tunes the packed layout for; any batch size works with it.
_PACK_HINT_ROWS = 64


def _can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


class FloatLinear:
    """y = x @ weight.T (+ bias) for x of shape [..., in_features], computed in the weight's
    dtype and returned in x's (the Linear contract: the autotuner times every kind with float32
    rows, and a bfloat16 model with quantized kinds mixes both)."""

    kind = LinearKind.FLOAT

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = (int(d) for d in weight.shape)
        self.bias = bias
        self.dtype = weight.dtype
        self._packed: torch.Tensor | None = None
        self._weight: torch.Tensor | None = weight
        if _can_pack(weight):
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT_ROWS)
            self._weight = None  # the packed copy replaces it; don't hold both

    def describe(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def weight_bytes(self) -> int:
        w = self._packed if self._packed is not None else self._weight
        assert w is not None
        return w.numel() * w.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.dtype:
            return self._apply(x)
        return self._apply(x.to(self.dtype)).to(x.dtype)

    def _apply(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
            return out
        assert self._weight is not None
        if x.dim() == 2 and self.bias is None:
            out2: torch.Tensor = torch.mm(self._weight, x.t()).t()
            return out2
        return F.linear(x, self._weight, self.bias)
