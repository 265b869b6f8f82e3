"""The linear-layer seam: one typed dispatch in front of float and quantized matmuls.

The model holds a `Linear` per projection and calls it with activations of any
leading shape; which kernel runs (and in which dtype it computes inside) is the
layer's business. Every kind takes and returns the caller's activation dtype.

Measured per decode step of SmolLM2-135M on a 2-core AVX2 CPU (torch 2.13, see
`python -m benchmarks quant`): no kind wins at every batch size or on every
CPU, so the kind is chosen per layer at load (engine.model.quantization).
"""

from __future__ import annotations

from typing import assert_never

import torch

from kernels.cpu_features import CpuFeatures, cpu_features
from kernels.linear.block_linear import Int4BlockLinear, Int8BlockLinear
from kernels.linear.float_linear import FloatLinear
from kernels.linear.int4_groups import Int4Groups
from kernels.linear.int4_linear import Int4Linear
from kernels.linear.int8_dynamic_linear import Int8DynamicLinear
from kernels.linear.int8_weight_linear import Int8WeightLinear
from kernels.linear.linear_kind import Linear, LinearKind
from kernels.linear.triton_q4_linear import TritonQ4Linear
from kernels.native.native_library import native_library, native_unavailable_reason

__all__ = ["Linear", "LinearKind", "make_linear"]


def make_linear(
    kind: LinearKind,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    stored: Int4Groups | None = None,
    cpu: CpuFeatures | None = None,
    device: torch.device | None = None,
) -> Linear:
    """A linear of `kind` for `weight` [out, in].

    FLOAT keeps `weight` as given (its dtype is the compute dtype); the quantized kinds
    quantize it from float32, except the INT4 kinds with `stored` groups (a file's 4-bit
    blocks), which are used exactly as they are and need no `weight` (None).
    `device` (default the CPU) is where TRITON_Q4 holds its weights; the other kinds ignore it.
    """

    def float_weight() -> torch.Tensor:
        if weight is None:
            raise ValueError(f"{kind.value} needs the float weight")
        return weight

    def groups() -> Int4Groups:
        return stored if stored is not None else Int4Groups.quantize(float_weight())

    match kind:
        case LinearKind.FLOAT:
            return FloatLinear(float_weight(), bias)
        case LinearKind.INT8_WEIGHT:
            return Int8WeightLinear.quantize(float_weight(), bias)
        case LinearKind.INT8_DYNAMIC:
            features = cpu if cpu is not None else cpu_features()
            return Int8DynamicLinear(float_weight(), bias, reduce_range=not features.vnni)
        case LinearKind.INT4:
            return Int4Linear(groups(), bias, from_file=stored is not None)
        case LinearKind.INT4_Q8 | LinearKind.INT8_Q8:
            lib = native_library()
            if lib is None:
                raise RuntimeError(f"{kind.value} needs the native kernels: {native_unavailable_reason()}")
            if kind is LinearKind.INT8_Q8:
                return Int8BlockLinear(lib, float_weight(), bias)
            return Int4BlockLinear(lib, groups(), bias, from_file=stored is not None)
        case LinearKind.TRITON_Q4:
            on = device if device is not None else torch.device("cpu")
            return TritonQ4Linear(groups(), on, bias, from_file=stored is not None)
        case _:
            assert_never(kind)
