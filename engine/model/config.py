"""The model's shape, read from GGUF metadata or a Hugging Face config.json."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RopeScalingKind(enum.Enum):
    NONE = "none"
    LINEAR = "linear"
    LLAMA3 = "llama3"


@dataclass(frozen=True)
class RopeScaling:
    kind: RopeScalingKind = RopeScalingKind.NONE
    factor: float = 1.0
    # llama3 only: the band of wavelengths that is smoothly interpolated.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know about a Llama-family model."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling = RopeScaling()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
