"""Which linear kind runs each projection: the --quant modes and the plan they resolve to.

A plan names one kind per layer class (fused QKV, O, fused gate/up, down, the head).
INT4 keeps the file's own 4-bit blocks where it has them (GGUF Q4_0/Q4_1, exactly)
and re-quantizes other weights by group min/max; the head stays int8 because the
shipped file stores it in 8 bits (Q8_0) and it decides every sampled token.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import assert_never

import torch

from kernels.cpu_features import CpuFeatures
from kernels.linear import Linear, LinearKind


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
    among (kernels/linear_autotune.py), per weight shape and step size."""

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


def int8_kind(cpu: CpuFeatures) -> LinearKind:
    """fbgemm's dynamic int8 where it has x86 kernels (AVX2 and up), else weight-only int8.

    Measured on an AVX2-only CPU it beats float32 and the weight-only kinds at 1, 8 and
    64 rows per step (benchmarks/single_stream.py --matmuls).
    """
    if cpu.avx2 and "fbgemm" in torch.backends.quantized.supported_engines:
        return LinearKind.INT8_DYNAMIC
    return LinearKind.INT8_WEIGHT


def resolve_quant(mode: QuantMode, cpu: CpuFeatures) -> QuantMode:
    """The concrete mode AUTO stands for on this CPU."""
    match mode:
        case QuantMode.AUTO:
            return QuantMode.NONE
        case QuantMode.NONE | QuantMode.INT8 | QuantMode.INT4:
            return mode
        case _:
            assert_never(mode)


def plan_for(mode: QuantMode, cpu: CpuFeatures) -> LinearPlan:
    match resolve_quant(mode, cpu):
        case QuantMode.NONE | QuantMode.AUTO:
            return LinearPlan.uniform(LinearKind.FLOAT)
        case QuantMode.INT8:
            return LinearPlan.uniform(int8_kind(cpu))
        case QuantMode.INT4:
            i4 = LinearKind.INT4
            return LinearPlan(i4, i4, i4, i4, int8_kind(cpu))


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
