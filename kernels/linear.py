"""The linear-layer seam: one typed dispatch in front of float and quantized matmuls.

The model holds a `Linear` per projection and calls it with activations of any
leading shape; which kernel runs (and in which dtype it computes inside) is the
layer's business. Every kind takes and returns the caller's activation dtype.

Measured per decode step of SmolLM2-135M on a 2-core AVX2 CPU (torch 2.13, see
`python -m benchmarks quant`): no kind wins at every batch size or on every
CPU, so the kind is chosen per layer at load (engine.model.quantization).
"""

from __future__ import annotations

import enum
from typing import Protocol, assert_never

import torch

from kernels.cpu_features import CpuFeatures, cpu_features
from kernels.int4_groups import Int4Groups


class LinearKind(enum.Enum):
    FLOAT = "float"  # the weight's own dtype (float32 or bfloat16)
    INT8_WEIGHT = "int8_weight"  # int8 weights, per-row scales; bfloat16 activations inside
    INT8_DYNAMIC = "int8_dynamic"  # fbgemm: int8 weights and per-call int8 activations
    INT4 = "int4"  # 4-bit groups of 32 (GGUF Q4_0/Q4_1 kept as stored); bfloat16 inside
    # Native kernels (kernels/block_linear.py): weight blocks x int8 activation blocks of 32.
    INT4_Q8 = "int4_q8"  # the INT4 groups, integer dot products
    INT8_Q8 = "int8_q8"  # int8 weight blocks of 32 (GGUF Q8_0's scheme)


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


def make_linear(
    kind: LinearKind,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    stored: Int4Groups | None = None,
    cpu: CpuFeatures | None = None,
) -> Linear:
    """A linear of `kind` for `weight` [out, in].

    FLOAT keeps `weight` as given (its dtype is the compute dtype); the quantized kinds
    quantize it from float32, except the INT4 kinds with `stored` groups (a file's 4-bit
    blocks), which are used exactly as they are and need no `weight` (None).
    """
    if stored is not None and kind is LinearKind.INT4:
        from kernels.int4_linear import Int4Linear

        return Int4Linear(stored, bias, from_file=True)
    if kind in (LinearKind.INT4_Q8, LinearKind.INT8_Q8):
        from kernels.native_library import native_library, native_unavailable_reason

        lib = native_library()
        if lib is None:
            raise RuntimeError(f"{kind.value} needs the native kernels: {native_unavailable_reason()}")
        if stored is not None and kind is LinearKind.INT4_Q8:
            from kernels.block_linear import Int4BlockLinear

            return Int4BlockLinear(lib, stored, bias, from_file=True)
    if weight is None:
        raise ValueError(f"{kind.value} needs the float weight")
    match kind:
        case LinearKind.FLOAT:
            from kernels.float_linear import FloatLinear

            return FloatLinear(weight, bias)
        case LinearKind.INT8_WEIGHT:
            from kernels.int8_weight_linear import Int8WeightLinear

            return Int8WeightLinear.quantize(weight, bias)
        case LinearKind.INT8_DYNAMIC:
            from kernels.int8_dynamic_linear import Int8DynamicLinear

            features = cpu if cpu is not None else cpu_features()
            return Int8DynamicLinear(weight, bias, reduce_range=not features.vnni)
        case LinearKind.INT4:
            from kernels.int4_linear import Int4Linear

            return Int4Linear(Int4Groups.quantize(weight), bias)
        case LinearKind.INT4_Q8 | LinearKind.INT8_Q8:
            from kernels.block_linear import Int4BlockLinear, Int8BlockLinear

            assert lib is not None  # checked above
            if kind is LinearKind.INT8_Q8:
                return Int8BlockLinear(lib, weight, bias)
            return Int4BlockLinear(lib, Int4Groups.quantize(weight), bias)
        case _:
            assert_never(kind)
