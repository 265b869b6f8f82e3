"""The LoRA adapters an engine holds, by name, up to a bound.

Loaded at start (`dyngen serve --lora NAME=PATH`, the operator's own paths) or at run time from
inside the operator's adapter folder (`--adapter-dir`; none: run-time loads are refused). A job
names one (or none) at enqueue and keeps that adapter object for its whole life, so unloading a
name never changes a running job's weights. The generator refuses to unload an adapter while a
job uses it (AdapterInUseError: the caller retries after those jobs end, or cancels them), and a
name can be loaded again only after it is unloaded.

A run-time load is three steps, so that reading a file never holds up the engine loop: `reserve`
(the name and a slot, at once), `read` (the files, in a worker thread: touches no state here),
then `install` or `release` (between iterations). Nothing is fetched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.adapters.adapter_folder import AdapterFolder
from engine.adapters.lora_adapter import DEFAULT_ADAPTER_LIMITS, AdapterLimits, LoraAdapter
from engine.errors import (
    AdapterExistsError,
    AdapterLimitError,
    AdapterNotFoundError,
    FailedPreconditionError,
    InvalidRequestError,
)
from engine.model.config import ModelConfig

# Names appear in requests, logs and metric labels: printable and bounded. ("~" is the service's:
# it scopes a tenant's adapters, and callers' names cannot hold it.)
ADAPTER_NAME = re.compile(r"[0-9A-Za-z_.~-]{1,64}")


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    label: str  # how it was named: a run-time load's relative path, or a --lora folder
    description: str
    jobs: int  # jobs running or queued with it


class AdapterRegistry:
    def __init__(
        self,
        config: ModelConfig,
        max_adapters: int,
        device: torch.device | None = None,
        limits: AdapterLimits = DEFAULT_ADAPTER_LIMITS,
        root: Path | None = None,
    ) -> None:
        if max_adapters < 0:
            raise ValueError(f"max_adapters must be >= 0, got {max_adapters}")
        self._config = config
        self._device = device  # the model's: adapters' deltas live beside its activations
        self.max_adapters = max_adapters
        self.limits = limits
        self.root = root  # the operator's adapter folder; None: no run-time loads
        self._by_name: dict[str, LoraAdapter] = {}
        self._reserved: set[str] = set()  # names being read in a worker thread

    def confined(self, relative: str) -> AdapterFolder:
        """The folder a run-time load names, inside the adapter folder (AdapterPathError if not;
        FailedPreconditionError where the server has no adapter folder)."""
        if self.root is None:
            raise FailedPreconditionError(
                "run-time adapter loading is off: the server was started without --adapter-dir"
            )
        return AdapterFolder.confined(self.root, relative)

    def reserve(self, name: str) -> None:
        """Hold `name` and a slot for a load in progress (refused as a load would be)."""
        if not ADAPTER_NAME.fullmatch(name):
            raise InvalidRequestError("an adapter name must be 1 to 64 characters of [0-9A-Za-z_.~-]")
        if name in self._by_name or name in self._reserved:
            raise AdapterExistsError(f"adapter {name!r} is loaded already; unload it first")
        if len(self._by_name) + len(self._reserved) >= self.max_adapters:
            raise AdapterLimitError(
                f"{len(self._by_name) + len(self._reserved)} adapters are loaded, the most this server "
                "holds (--max-adapters); unload one first"
            )
        self._reserved.add(name)

    def read(self, name: str, folder: AdapterFolder) -> LoraAdapter:
        """The adapter's files, checked and read (safe in a worker thread: no state here changes)."""
        return LoraAdapter.load(name, folder, self._config, self._device, self.limits)

    def install(self, adapter: LoraAdapter) -> None:
        self._reserved.discard(adapter.name)
        self._by_name[adapter.name] = adapter

    def release(self, name: str) -> None:
        """Give back a reservation whose read failed."""
        self._reserved.discard(name)

    def load(self, name: str, path: Path | AdapterFolder) -> LoraAdapter:
        """Reserve, read and install in one call (start-time adapters and the in-process CLI)."""
        self.reserve(name)
        try:
            adapter = self.read(
                name, path if isinstance(path, AdapterFolder) else AdapterFolder.trusted(path)
            )
        except BaseException:
            self.release(name)
            raise
        self.install(adapter)
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
