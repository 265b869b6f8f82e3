"""The seam between a model file format and the model: a config plus named tensors.

Tensor names follow the Hugging Face Llama layout (``model.layers.N.self_attn.q_proj.weight``
and so on), and tensors are float32 in that layout (rotary halves, not interleaved),
whatever the file stored, so the model is built the same way from any source.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import torch

from engine.model.config import ModelConfig
from kernels.linear.int4_groups import Int4Groups


class LazyTensors(Mapping[str, torch.Tensor]):
    """Tensors by name, loaded by `load` at each lookup (nothing is kept: the caller keeps what it
    uses); `loaded` is told each name as it is loaded (a progress bar)."""

    def __init__(
        self,
        names: Sequence[str],
        load: Callable[[str], torch.Tensor],
        loaded: Callable[[str], None] | None = None,
    ) -> None:
        self._names = tuple(names)
        self._known = frozenset(names)
        self._load = load
        self._loaded = loaded

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._known:
            raise KeyError(name)
        tensor = self._load(name)
        if self._loaded is not None:
            self._loaded(name)
        return tensor

    def __contains__(self, name: object) -> bool:
        return name in self._known

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class LazyInt4(Mapping[str, Int4Groups]):
    """A source's stored 4-bit groups by name, split from the file's blocks at the first lookup of
    each name (a model whose packed linears were kept from an earlier start never asks)."""

    def __init__(self, names: Sequence[str], load: Callable[[str], Int4Groups | None]) -> None:
        self._names = tuple(names)
        self._load = load
        self._memo: dict[str, Int4Groups | None] = {}

    def __getitem__(self, name: str) -> Int4Groups:
        if name not in self._memo:
            self._memo[name] = self._load(name) if name in self._names else None
        groups = self._memo[name]
        if groups is None:
            raise KeyError(name)
        return groups

    def __iter__(self) -> Iterator[str]:
        return (n for n in self._names if n in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)


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

    def tensor_map(self) -> Mapping[str, torch.Tensor]:
        """The same tensors by name, each read (and dequantized) only when asked for: a model
        that runs a weight's stored blocks never pays for its float copy."""
        ...

    def stored_int4(self, name: str) -> Int4Groups | None:
        """A weight's 4-bit groups exactly as the file stores them (GGUF Q4_0/Q4_1), else None."""
        ...
