"""The attention seam: one typed dispatch in front of the torch and Triton paths.

A backend is asked once per forward to prepare for a batch (page tables, lengths and
masks are the same for every layer), and the prepared object is then called once per
layer with that layer's queries and cache. New K/V are written into their page slots
before attention, so a prefill chunk attends to itself as well as to earlier pages.
"""

from __future__ import annotations

import enum
from typing import Protocol

import torch

from engine.forward_batch import ForwardBatch


class AttentionKind(enum.Enum):
    AUTO = "auto"
    TORCH = "torch"


class PreparedAttention(Protocol):
    def write_kv(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store this step's k, v ([T, kv_heads, head_dim]) into the layer's cache slots."""
        ...

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q [T, heads, head_dim] against the paged cache -> [T, heads * head_dim]."""
        ...


class AttentionBackend(Protocol):
    def prepare(
        self, batch: ForwardBatch, num_heads: int, num_kv_heads: int, dtype: torch.dtype
    ) -> PreparedAttention: ...


def select_attention(kind: AttentionKind, device: torch.device) -> AttentionBackend:
    """The backend for a cache on `device`; AUTO picks the fastest one available there."""
    from kernels.torch_attention import TorchPagedAttention

    match kind:
        case AttentionKind.AUTO | AttentionKind.TORCH:
            return TorchPagedAttention()
