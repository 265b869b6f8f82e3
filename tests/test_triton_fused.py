"""The fused Triton kernels (residual add + RMSNorm, rotary in place) against the model's torch ops.

Run on the CPU under the Triton interpreter; TRITON_INTERPRET is set before the kernel
modules are imported (see test_triton_attention).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from engine.model.config import ModelConfig
from engine.model.llama import rms_norm
from engine.model.rope import RotaryEmbedding
from kernels.triton_fused import add_rms_norm, rotary_

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = ["fp32", "bf16", "fp16"]
# (atol, rtol) against the torch ops on the same inputs. fp32: summation order only.
# Half precision: an element may round the other way at one step, a unit in the last place.
TOLERANCE = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 1e-2),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize(("tokens", "hidden"), [(1, 64), (7, 576), (13, 96)])
def test_add_rms_norm_matches_torch(tokens: int, hidden: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(tokens * hidden)
    residual = (torch.randn(tokens, hidden, generator=gen) * 3).to(dtype)
    delta = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    expected_res = residual + delta
    expected = rms_norm(expected_res, weight, 1e-5)

    got = add_rms_norm(delta, residual, weight, 1e-5)
    if dtype == torch.bfloat16:
        # The interpreter rounds float32 -> bfloat16 toward zero (a GPU rounds to nearest even):
        # one unit in the last place at most.
        torch.testing.assert_close(residual, expected_res, atol=0.0, rtol=2**-7)
    else:
        # The residual add is one rounding in the same dtype: exact.
        assert torch.equal(residual, expected_res)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=rtol)


def tiny_config(head_dim: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=16,
        hidden_size=4 * head_dim,
        intermediate_size=8,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=300,
        tie_word_embeddings=True,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [1, 3, 9])
def test_rotary_in_place_matches_torch(head_dim: int, heads: int, dtype: torch.dtype) -> None:
    rope = RotaryEmbedding(tiny_config(head_dim), dtype)
    tokens = 11
    gen = torch.Generator().manual_seed(head_dim + heads)
    positions = torch.tensor([0, 1, 15, 16, 17, 63, 64, 65, 255, 256, 299])
    # A strided view, like the Q slice of the fused QKV output.
    qkv = torch.randn(tokens, (heads + 2) * head_dim, generator=gen).to(dtype)
    x = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    cos, sin = rope.tables(positions)
    expected = rope.apply(x.clone(), cos, sin)
    untouched = qkv[:, heads * head_dim :].clone()

    rotary_(x, rope.cos, rope.sin, positions)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(x.float(), expected.float(), atol=atol, rtol=rtol)
    assert torch.equal(qkv[:, heads * head_dim :], untouched)
