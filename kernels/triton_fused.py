"""Launchers of the fused per-token kernels (kernels.triton_fused_kernels).

`add_rms_norm` replaces `x = x + delta; h = rms_norm(x, w)` (two passes over the
residual stream and a float32 copy) with one pass; `rotary_` rotates Q or K in place,
on the fused QKV output's views, instead of building rotated copies.
"""

from __future__ import annotations

import torch
import triton

from kernels.attention.triton_attention import check_device
from kernels.triton_fused_kernels import add_rms_norm_kernel, rotary_kernel

NORM_BLOCK_T = 4  # tokens per program; the hidden vector of each is one row of the tile
ROTARY_BLOCK_T = 8


def add_rms_norm(
    delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += delta in place; returns rms_norm(residual) * weight. Tensors [T, hidden]."""
    check_device(residual)
    tokens, hidden = residual.shape
    if delta.shape != residual.shape or weight.shape != (hidden,):
        raise ValueError(f"shapes differ: delta {tuple(delta.shape)}, residual {tuple(residual.shape)}")
    if delta.stride(1) != 1:
        delta = delta.contiguous()
    assert residual.stride(1) == 1 and weight.is_contiguous()
    out = torch.empty_like(residual)
    add_rms_norm_kernel[(triton.cdiv(tokens, NORM_BLOCK_T),)](
        delta, residual, weight, out, tokens, delta.stride(0), residual.stride(0), out.stride(0), eps,
        HIDDEN=hidden, HIDDEN_P2=int(triton.next_power_of_2(hidden)), BLOCK_T=NORM_BLOCK_T,
    )  # fmt: skip
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> None:
    """Rotate x [T, heads, head_dim] in place with tables cos/sin [max_positions, head_dim] at positions [T]."""
    check_device(x)
    tokens, heads, head_dim = x.shape
    half = head_dim // 2
    if half != int(triton.next_power_of_2(half)):
        raise ValueError(f"head_dim {head_dim} must be twice a power of two")
    assert x.stride(2) == 1 and cos.stride(1) == 1 and sin.stride() == cos.stride()
    rotary_kernel[(triton.cdiv(tokens, ROTARY_BLOCK_T),)](
        x, cos, sin, positions, tokens, x.stride(0), x.stride(1), cos.stride(0),
        HEADS=heads, HEADS_P2=int(triton.next_power_of_2(heads)), HALF=half, BLOCK_T=ROTARY_BLOCK_T,
    )  # fmt: skip
