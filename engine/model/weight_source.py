"""The seam between a model file format and the model: a config plus named tensors.

Tensor names follow the Hugging Face Llama layout (``model.layers.N.self_attn.q_proj.weight``
and so on), and tensors are float32 in that layout (rotary halves, not interleaved),
whatever the file stored, so the model is built the same way from any source.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch

from engine.model.config import ModelConfig
from kernels.int4_groups import Int4Groups


class WeightSource(Protocol):
    """A model on disk: its config, its tensor count, and its tensors one by one."""

    @property
    def path(self) -> Path: ...

    @property
    def config(self) -> ModelConfig: ...

    def tensor_count(self) -> int: ...

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (canonical name, float32 tensor) pairs, dequantized where needed."""
        ...

    def stored_int4(self, name: str) -> Int4Groups | None:
        """A weight's 4-bit groups exactly as the file stores them (GGUF Q4_0/Q4_1), else None."""
        ...
