"""The LoRA adapters an engine holds, by name, up to a bound.

Loaded at start (`dyngen serve --lora NAME=PATH`) or at run time; a job names one (or none) at
enqueue and keeps that adapter object for its whole life, so unloading a name never changes a
running job's weights. The generator refuses to unload an adapter while a job uses it
(AdapterInUseError: the caller retries after those jobs end, or cancels them), and a name can be
loaded again only after it is unloaded. Paths are the server's own; nothing is fetched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.errors import AdapterExistsError, AdapterLimitError, AdapterNotFoundError, InvalidRequestError
from engine.model.config import ModelConfig
from engine.model.lora_adapter import LoraAdapter

# Names appear in requests, logs and metric labels: printable and bounded. ("~" is the service's:
# it scopes a tenant's adapters, and callers' names cannot hold it.)
ADAPTER_NAME = re.compile(r"[0-9A-Za-z_.~-]{1,64}")


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: Path
    description: str
    jobs: int  # jobs running or queued with it


class AdapterRegistry:
    def __init__(self, config: ModelConfig, max_adapters: int, device: torch.device | None = None) -> None:
        if max_adapters < 0:
            raise ValueError(f"max_adapters must be >= 0, got {max_adapters}")
        self._config = config
        self._device = device  # the model's: adapters' deltas live beside its activations
        self.max_adapters = max_adapters
        self._by_name: dict[str, LoraAdapter] = {}

    def load(self, name: str, path: Path) -> LoraAdapter:
        if not ADAPTER_NAME.fullmatch(name):
            raise InvalidRequestError("an adapter name must be 1 to 64 characters of [0-9A-Za-z_.~-]")
        if name in self._by_name:
            raise AdapterExistsError(f"adapter {name!r} is loaded already; unload it first")
        if len(self._by_name) >= self.max_adapters:
            raise AdapterLimitError(
                f"{len(self._by_name)} adapters are loaded, the most this server holds (--max-adapters); "
                "unload one first"
            )
        adapter = LoraAdapter.load(name, path, self._config, self._device)
        self._by_name[name] = adapter
        return adapter

    def get(self, name: str) -> LoraAdapter:
        adapter = self._by_name.get(name)
        if adapter is None:
            raise AdapterNotFoundError(f"no adapter {name!r} is loaded")
        return adapter

    def remove(self, name: str) -> LoraAdapter:
        adapter = self.get(name)
        del self._by_name[name]
        return adapter

    def adapters(self) -> list[LoraAdapter]:
        return sorted(self._by_name.values(), key=lambda a: a.name)
