"""Rotary position embedding with the model's base and scaling (none, linear, llama3)."""

from __future__ import annotations

import math

import torch

from engine.model.config import ModelConfig, RopeScalingKind


def inverse_frequencies(config: ModelConfig, freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    """Per-pair rotation speeds, float32, computed as the reference computes them."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv = 1.0 / (config.rope_theta**exponents)
    s = config.rope_scaling
    match s.kind:
        case RopeScalingKind.NONE:
            pass
        case RopeScalingKind.LINEAR:
            inv = inv / s.factor
        case RopeScalingKind.LLAMA3:
            # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
            low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
            high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
            blend = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            blended = (1 - blend) * scaled / s.factor + blend * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv = torch.where(medium, blended, scaled)
    if freq_factors is not None:
        inv = inv / freq_factors.to(torch.float32)
    return inv


class RotaryEmbedding:
    """cos/sin tables for every position up to the model's context, looked up per token."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, freq_factors: torch.Tensor | None = None
    ) -> None:
        inv = inverse_frequencies(config, freq_factors)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        angles = positions[:, None] * inv[None, :]
        full = torch.cat((angles, angles), dim=-1)
        self.cos = full.cos().to(dtype)
        self.sin = full.sin().to(dtype)
        self.half = config.head_dim // 2
        # sin with its first half negated: rotating (x1, x2) to (-x2, x1) and scaling by sin
        # becomes (x2, x1) * sin_signed, one op fewer per call and bit-identical.
        self.sin_signed = torch.cat((-self.sin[:, : self.half], self.sin[:, self.half :]), dim=-1)

    def to(self, device: torch.device) -> None:
        self.cos, self.sin, self.sin_signed = (t.to(device) for t in (self.cos, self.sin, self.sin_signed))

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for each token, [T, 1, head_dim] (broadcast over heads), for `apply`."""
        return self.cos[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, head_dim] (halves layout: pair i is (i, i + head_dim/2))."""
        swapped = torch.cat((x[..., self.half :], x[..., : self.half]), dim=-1)
        return x * cos + swapped * sin_signed
