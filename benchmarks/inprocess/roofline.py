"""The matmul roofline of a decode workload: how fast it could go if only its matmuls cost time.

The bound takes this machine's GEMM rate in the dtype, measured in the same run on a
large square product (the best case for the BLAS), and the FLOPs every generated token
needs through the model's linears (prefill and attention left out, so the bound is
generous). No engine that computes those matmuls in that dtype can beat it here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.model.config import ModelConfig

_SIZE = 2048


@dataclass(frozen=True)
class Roofline:
    gemm_gflops: float  # measured peak GEMM rate in the dtype
    gflop_per_token: float  # linear-layer FLOPs of one decoded token

    @property
    def tokens_per_second(self) -> float:
        return self.gemm_gflops / self.gflop_per_token


def decode_gflop_per_token(c: ModelConfig) -> float:
    per_layer = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
    per_layer += 3 * c.hidden_size * c.intermediate_size
    params = c.num_layers * per_layer + c.vocab_size * c.hidden_size
    return 2 * params / 1e9


def peak_gemm_gflops(dtype: torch.dtype, seconds: float = 2.0) -> float:
    """Best rate of repeated [2048 x 2048] @ [2048 x 2048] products in `dtype`."""
    a = torch.randn(_SIZE, _SIZE).to(dtype)
    b = torch.randn(_SIZE, _SIZE).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * _SIZE**3 / best / 1e9


def measure(config: ModelConfig, dtype: torch.dtype) -> Roofline:
    return Roofline(peak_gemm_gflops(dtype), decode_gflop_per_token(config))
