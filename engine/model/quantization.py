"""Which linear kind runs each projection: the --quant modes and the plan they resolve to.

A plan names one kind per layer class (fused QKV, O, fused gate/up, down, the head).
INT4 keeps the file's own 4-bit blocks where it has them (GGUF Q4_0/Q4_1, exactly) and
re-quantizes other weights by group min/max; its head is int8 (the shipped file stores
the head as Q8_0; re-quantized to int4 it costs +6% perplexity). Where the native CPU
kernels build (kernels/native/native_library.py), INT4 and INT8 run them: weight blocks times
int8 activation blocks of 32, integer dot products. Elsewhere they fall back to torch's
weight-only kernels (bfloat16 inside). AUTO lets the load-time autotune pick, per weight
shape and step size, the fastest of the kinds that pass the quality gate.

Dynamic int8 (fbgemm) is the fastest kind on an AVX2 CPU but no mode picks it: its one
7-bit scale per activation tensor costs +169% perplexity on the shipped model (+7% as
the head alone), measured by `python -m benchmarks quality`.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import assert_never

import torch

from engine.errors import InvalidRequestError
from kernels.cpu_features import CpuFeatures
from kernels.linear.make_linear import Linear, LinearKind


class QuantMode(enum.Enum):
    AUTO = "auto"
    NONE = "none"
    INT8 = "int8"
    INT4 = "int4"


class LinearRole(enum.Enum):
    QKV = "qkv"
    OUT = "o"  # the attention output projection
    GATE_UP = "gate_up"
    DOWN = "down"
    HEAD = "head"


@dataclass(frozen=True)
class LinearPlan:
    """A kind per projection class; or, with candidates, the kinds the load-time autotune may pick
    among (kernels/linear/linear_autotune.py), per weight shape and step size."""

    qkv: LinearKind
    o: LinearKind
    gate_up: LinearKind
    down: LinearKind
    head: LinearKind
    body_candidates: tuple[LinearKind, ...] = ()  # QKV, O, gate/up, down
    head_candidates: tuple[LinearKind, ...] = ()

    @staticmethod
    def uniform(kind: LinearKind) -> LinearPlan:
        return LinearPlan(kind, kind, kind, kind, kind)

    @staticmethod
    def tuned(body: tuple[LinearKind, ...], head: tuple[LinearKind, ...]) -> LinearPlan:
        b, h = body[0], head[0]
        return LinearPlan(b, b, b, b, h, body, head)

    def kind(self, role: LinearRole) -> LinearKind:
        kind: LinearKind = getattr(self, role.value)
        return kind

    def candidates(self, role: LinearRole) -> tuple[LinearKind, ...]:
        tuned = self.head_candidates if role is LinearRole.HEAD else self.body_candidates
        return tuned or (self.kind(role),)

    def uses(self, kind: LinearKind) -> bool:
        return any(kind in self.candidates(r) for r in LinearRole)

    @property
    def quantized(self) -> bool:
        return any(k is not LinearKind.FLOAT for r in LinearRole for k in self.candidates(r))

    @property
    def autotuned(self) -> bool:
        return any(len(self.candidates(r)) > 1 for r in LinearRole)


# What `--quant auto` may choose from: the kinds whose perplexity stays within 1% of the
# float32 path on `python -m benchmarks quality` (shipped model, 10k tokens: int8 weight-only
# +0.35%, int4 file blocks with an int8 weight-only head +0.17%; dynamic int8 fails).
# Among these the load-time autotune picks the fastest per weight shape and step size.
AUTO_BODY_KINDS = (LinearKind.FLOAT, LinearKind.INT4, LinearKind.INT8_WEIGHT)
AUTO_HEAD_KINDS = (LinearKind.FLOAT, LinearKind.INT8_WEIGHT)
NATIVE_BODY_KINDS = (LinearKind.INT4_Q8, LinearKind.INT8_Q8)  # where the native kernels build
# The head there: int8 weight-only (torch) beside the int8 blocks. The float32 head, 4x int8's
# bytes on float32 FMAs at under half the int8 dot's rate, never won a bucket here, and timing it
# cost a first start 0.6 s (49152 x 576 x 64 rows in float32 is 33 ms a call).
NATIVE_HEAD_KINDS = (LinearKind.INT8_WEIGHT, LinearKind.INT8_Q8)


def plan_for(
    mode: QuantMode, cpu: CpuFeatures, native: bool | None = None, device: torch.device | None = None
) -> LinearPlan:
    """The plan of `mode` on `device` (default: the CPU); `native` says whether the native kernels
    are available (None: try to build them)."""
    if device is not None and device.type != "cpu":
        return _gpu_plan(mode, device)
    if native is None:
        from kernels.native.native_library import native_library

        native = native_library() is not None
    i8 = LinearKind.INT8_Q8 if native else LinearKind.INT8_WEIGHT
    i4 = LinearKind.INT4_Q8 if native else LinearKind.INT4
    match mode:
        case QuantMode.NONE:
            return LinearPlan.uniform(LinearKind.FLOAT)
        case QuantMode.INT8:
            return LinearPlan.uniform(i8)
        case QuantMode.INT4:
            return LinearPlan(i4, i4, i4, i4, i8)
        case QuantMode.AUTO:
            if native:
                # The body among the block kinds only: a decode step runs each layer as one native
                # call only when all four projections are block linears (llama.py _native_layers),
                # which outweighs any one linear's edge: with `down` on torch's int4 kernel at one row
                # (chosen alone, a tie the fewer weight bytes won) single stream ran 232 tok/s; all
                # block kinds, 390 (Zen 5, 2 cores).
                return LinearPlan.tuned(NATIVE_BODY_KINDS, NATIVE_HEAD_KINDS)
            return LinearPlan.tuned(AUTO_BODY_KINDS, AUTO_HEAD_KINDS)
        case _:
            assert_never(mode)


# On a GPU: float linears in the model's dtype (torch's matmuls), or the file's 4-bit blocks kept
# 4-bit in GPU memory and dequantized inside a Triton matmul (kernels/linear/triton_q4_linear.py).
# Auto times both per shape and step size, as on the CPU (the choices keyed on the GPU); the head
# stays float (no 4-bit head in the quality gate).
GPU_BODY_KINDS = (LinearKind.TRITON_Q4, LinearKind.FLOAT)


def _gpu_plan(mode: QuantMode, device: torch.device) -> LinearPlan:
    """The plan of `mode` on a GPU."""
    f, q4 = LinearKind.FLOAT, LinearKind.TRITON_Q4
    match mode:
        case QuantMode.NONE:
            return LinearPlan.uniform(f)
        case QuantMode.INT4:
            return LinearPlan(q4, q4, q4, q4, f)
        case QuantMode.AUTO:
            return LinearPlan.tuned(GPU_BODY_KINDS, (f,))
        case QuantMode.INT8:
            raise InvalidRequestError(
                f"--quant int8 runs on the CPU only; on {device} use --quant none, int4 or auto"
            )
        case _:
            assert_never(mode)


def describe_linears(linears: Sequence[tuple[LinearRole, Linear]]) -> str:
    """'qkv int4[file], o int4[file], ..., head int8_dynamic'; mixed kinds are counted."""
    parts = []
    for role in LinearRole:
        kinds = Counter(lin.describe() for r, lin in linears if r is role)
        if len(kinds) == 1:
            parts.append(f"{role.value} {next(iter(kinds))}")
        elif kinds:
            parts.append(f"{role.value} " + "+".join(f"{k} x{n}" for k, n in sorted(kinds.items())))
    return ", ".join(parts)
