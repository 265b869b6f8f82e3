"""Run-time adapter loads in flight: read in a worker thread while the engine keeps stepping,
installed by the engine loop between iterations (so no forward sees half a change).

One worker: loads are rare, and a second would only compete with the forward for the cores.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from engine.adapters.adapter_folder import AdapterFolder
from engine.adapters.adapter_registry import AdapterRegistry
from engine.adapters.lora_adapter import LoraAdapter


@dataclass(frozen=True)
class FinishedLoad:
    request: int  # the front end's request number, answered with the result
    name: str
    adapter: LoraAdapter | None
    error: BaseException | None


class AdapterLoads:
    def __init__(self, registry: AdapterRegistry) -> None:
        self._registry = registry
        self._pool: ThreadPoolExecutor | None = None  # started with the first load
        self._pending: list[tuple[int, str, Future[LoraAdapter]]] = []

    def start(self, request: int, name: str, relative: str) -> None:
        """Check the path and reserve the name and a slot now (refusals raise here, at once); read
        the files in the worker."""
        folder: AdapterFolder = self._registry.confined(relative)
        self._registry.reserve(name)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="adapter-load")
        self._pending.append((request, name, self._pool.submit(self._registry.read, name, folder)))

    @property
    def busy(self) -> bool:
        return bool(self._pending)

    def finished(self) -> list[FinishedLoad]:
        """Loads whose read ended, installed (or their reservation released), in order of start."""
        done: list[FinishedLoad] = []
        waiting: list[tuple[int, str, Future[LoraAdapter]]] = []
        for request, name, future in self._pending:
            if not future.done():
                waiting.append((request, name, future))
                continue
            error = future.exception()
            if error is None:
                adapter = future.result()
                self._registry.install(adapter)
                done.append(FinishedLoad(request, name, adapter, None))
            else:
                self._registry.release(name)
                done.append(FinishedLoad(request, name, None, error))
        self._pending = waiting
        return done

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
