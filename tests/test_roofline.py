"""The W1 bound counts the shipped model's linear FLOPs per decoded token correctly."""

from __future__ import annotations

import torch

from benchmarks.inprocess.roofline import Roofline, decode_gflop_per_token, peak_gemm_gflops
from engine.model.gguf_source import GGUFSource
from engine.model.shipped_model import default_model_path


def test_decode_flops_of_the_shipped_model() -> None:
    config = GGUFSource(default_model_path()).config
    # 30 layers x (576 x (576 + 2 x 192) + 576 x 576 + 3 x 576 x 1536) + 49152 x 576 weights, 2 FLOP each.
    layer = 576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536
    assert decode_gflop_per_token(config) == 2 * (30 * layer + 49152 * 576) / 1e9


def test_bound_is_rate_over_work() -> None:
    assert Roofline(gemm_gflops=150.0, gflop_per_token=0.25).tokens_per_second == 600.0
    assert peak_gemm_gflops(torch.float32, seconds=0.05) > 0
