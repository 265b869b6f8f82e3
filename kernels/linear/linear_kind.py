"""The linear kinds and the Linear protocol every implementation satisfies (kernels/linear/make_linear.py
builds one of a kind; the implementations import only this)."""

from __future__ import annotations

import enum
from typing import Protocol

import torch


class LinearKind(enum.Enum):
    FLOAT = "float"  # the weight's own dtype (float32 or bfloat16)
    INT8_WEIGHT = "int8_weight"  # int8 weights, per-row scales; bfloat16 activations inside
    INT8_DYNAMIC = "int8_dynamic"  # fbgemm: int8 weights and per-call int8 activations
    INT4 = "int4"  # 4-bit groups of 32 (GGUF Q4_0/Q4_1 kept as stored); bfloat16 inside
    # Native kernels (kernels/linear/block_linear.py): weight blocks x int8 activation blocks of 32.
    INT4_Q8 = "int4_q8"  # the INT4 groups, integer dot products
    INT8_Q8 = "int8_q8"  # int8 weight blocks of 32 (GGUF Q8_0's scheme)
    # GPU (kernels/linear/triton_q4_linear.py): the INT4 groups dequantized inside a Triton matmul.
    TRITON_Q4 = "triton_q4"


class Linear(Protocol):
    @property
    def kind(self) -> LinearKind: ...

    @property
    def in_features(self) -> int: ...

    @property
    def out_features(self) -> int: ...

    def describe(self) -> str:
        """What runs: "float32", "int8_dynamic", "int4[file]" (the file's own blocks), ..."""
        ...

    def weight_bytes(self) -> int:
        """Bytes of weight (and scales) a call streams."""
        ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features], in x's dtype."""
        ...
