"""Quantized linears against float references, and int4 kept exact to GGUF Q4_0/Q4_1 blocks.

Tolerances are relative Frobenius errors of the output. Against the weights each kind
really multiplies by, only activation rounding remains (bfloat16 inside: ~2^-8 per
value); against the original float weights, the quantization error adds (int8 per
row ~0.5%, dynamic int8 with 7-bit activations ~1.5%, int4 groups of 32 ~8%; the native
block kinds add int8 activation blocks of 32, ~0.5%).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine.model.gguf_blocks import RawTensor, int4_groups
from kernels.linear.int4_groups import Int4Groups
from kernels.linear.int4_linear import Int4Linear
from kernels.linear.int8_weight_linear import Int8WeightLinear
from kernels.linear.make_linear import LinearKind, make_linear
from kernels.native.native_library import native_library, native_unavailable_reason

SHAPES = [(48, 64, 1), (40, 96, 5), (96, 128, 17)]  # (out, in, rows); 40 is not a multiple of 16
# Relative error vs the original float weights, with headroom over what these shapes give.
VS_FLOAT = {
    LinearKind.FLOAT: 1e-6,
    LinearKind.INT8_WEIGHT: 0.02,
    LinearKind.INT8_DYNAMIC: 0.05,
    LinearKind.INT4: 0.12,
    # Native kernels: the same weight error plus int8 activation blocks of 32 (~0.5%).
    LinearKind.INT4_Q8: 0.12,
    LinearKind.INT8_Q8: 0.03,
}
BF16_ACTIVATIONS = 1e-2  # vs the kernel's own weights, bfloat16 activations and outputs


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# The CPU's kinds; TRITON_Q4 (the GPU's) has its own tests under the interpreter (test_triton_q4_matmul.py).
CPU_KINDS = [k for k in LinearKind if k is not LinearKind.TRITON_Q4]


@pytest.mark.parametrize("kind", CPU_KINDS, ids=[k.value for k in CPU_KINDS])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}x{m}" for n, k, m in SHAPES])
def test_against_float(kind: LinearKind, shape: tuple[int, int, int]) -> None:
    out, inp, rows = shape
    g = torch.Generator().manual_seed(out * 1000 + inp)
    weight = torch.randn(out, inp, generator=g) * 0.05
    bias = torch.randn(out, generator=g)
    x = torch.randn(rows, inp, generator=g)
    if kind in (LinearKind.INT4_Q8, LinearKind.INT8_Q8) and native_library() is None:
        pytest.skip(f"native kernels unavailable: {native_unavailable_reason()}")
    lin = make_linear(kind, weight, bias)
    assert lin.kind is kind and (lin.out_features, lin.in_features) == (out, inp)
    y = lin(x)
    assert y.dtype == torch.float32 and tuple(y.shape) == (rows, out)
    ref = x @ weight.t() + bias
    assert rel(y, ref) <= VS_FLOAT[kind]
    # Any leading shape, and bfloat16 activations in, bfloat16 out.
    y3 = lin(x.view(1, rows, inp))
    assert tuple(y3.shape) == (1, rows, out) and torch.equal(y3[0], y)
    if kind is not LinearKind.FLOAT:
        yb = lin(x.to(torch.bfloat16))
        assert yb.dtype == torch.bfloat16 and rel(yb, ref) <= VS_FLOAT[kind] + 0.01


@pytest.mark.parametrize("bias", [False, True])
def test_a_bfloat16_float_linear_answers_in_the_callers_dtype(bias: bool) -> None:
    """The Linear contract for the float kind too: a bfloat16 weight (packed for oneDNN where the
    CPU does bf16) takes float32 rows, as the autotuner sends them, and answers in float32."""
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(40, 96, generator=g) * 0.05
    b = torch.randn(40, generator=g).to(torch.bfloat16) if bias else None
    lin = make_linear(LinearKind.FLOAT, weight.to(torch.bfloat16), b)
    x = torch.randn(5, 96, generator=g)
    ref = x @ weight.t() + (b.float() if b is not None else 0)
    y = lin(x)
    assert y.dtype == torch.float32 and rel(y, ref) <= BF16_ACTIVATIONS
    yb = lin(x.to(torch.bfloat16))
    assert yb.dtype == torch.bfloat16 and rel(yb, ref) <= BF16_ACTIVATIONS


def test_int8_weight_against_its_own_weights() -> None:
    weight = torch.randn(64, 96, generator=torch.Generator().manual_seed(1))
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(2))
    lin = Int8WeightLinear.quantize(weight)
    w = lin.effective_weight()
    # Half a step of round-to-nearest, plus the scales' rounding to bfloat16 (2^-9 relative).
    step = weight.abs().amax(1, keepdim=True) / 127
    assert bool(((w - weight).abs() <= step * 0.501 + weight.abs() * 2**-8).all())
    ref = x.to(torch.bfloat16).float() @ w.t()
    assert rel(lin(x), ref) <= BF16_ACTIVATIONS


def test_int4_requantized_groups_round_to_nearest() -> None:
    weight = torch.randn(32, 128, generator=torch.Generator().manual_seed(3))
    groups = Int4Groups.quantize(weight)
    err = (groups.dequantize() - weight).abs().view(32, -1, 32)
    step = groups.scale[..., None]
    # Half a step, plus the float16 rounding of the group's minimum and step.
    assert bool((err <= step * 0.5 + groups.offset.abs()[..., None] * 2e-3 + step * 0.02).all())
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(4))
    ref = x.to(torch.bfloat16).float() @ groups.dequantize().t()
    assert rel(Int4Linear(groups)(x), ref) <= BF16_ACTIVATIONS


QTYPES = (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1)


@pytest.mark.parametrize("qtype", QTYPES, ids=[t.name for t in QTYPES])
def test_int4_is_exactly_the_gguf_blocks(qtype: gguf.GGMLQuantizationType) -> None:
    rng = np.random.default_rng(5)
    weight = (rng.standard_normal((48, 160)) * 0.05).astype(np.float32)
    weight[3, :32] = 0.125  # a constant group (zero step)
    blocks = gguf.quants.quantize(weight, qtype)
    expected = torch.from_numpy(np.asarray(gguf.quants.dequantize(blocks, qtype), dtype=np.float32))
    raw = RawTensor(qtype, (48, 160), torch.from_numpy(np.ascontiguousarray(blocks)))
    groups = int4_groups(raw)
    assert groups is not None
    assert torch.equal(groups.dequantize(), expected)
    # The kernel's own weights (read through an identity activation) are the file's, bit for bit,
    # when it computes in float32; bfloat16 compute rounds scale and zero (see kernels/linear/int4_linear.py).
    exact = Int4Linear(groups, from_file=True, compute_dtype=torch.float32)
    assert torch.equal(exact(torch.eye(160)).t(), expected)
    fast = Int4Linear(groups, from_file=True)
    assert fast.describe() == "int4[file]"
    x = torch.randn(4, 160, generator=torch.Generator().manual_seed(6))
    assert rel(fast(x), x.to(torch.bfloat16).float() @ expected.t()) <= BF16_ACTIVATIONS


def test_other_block_types_are_not_int4_groups() -> None:
    q8 = gguf.quants.quantize(np.ones((16, 32), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    raw = RawTensor(gguf.GGMLQuantizationType.Q8_0, (16, 32), torch.from_numpy(np.ascontiguousarray(q8)))
    assert int4_groups(raw) is None
