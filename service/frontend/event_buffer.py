"""One job's events between the engine and the job's stream, bounded for slow readers.

Slow-reader policy: nothing is dropped and the engine never waits. Past `max_items`
waiting events, a new text delta is merged into the last waiting delta (text
appended, token ids and logprobs extended) and a new prefill progress replaces the
last waiting one. A reader that falls behind then gets fewer, larger messages with
the same content; the buffer holds at most `max_items` + 2 messages (a start and a
finish), and their total size is bounded by what the job generates (max_new_tokens).
"""

from __future__ import annotations

import asyncio
from collections import deque

from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb


class EngineDownError(Exception):
    """The engine process is not running (starting, restarting, or stopped)."""


class EngineRefusedConfigError(EngineDownError):
    """The first engine exited 2: it refused what it was told to load (a missing model, say), which
    no restart mends; it printed the reason on stderr as one line."""


class EngineLostError(EngineDownError):
    """The engine process ended with this call sent and unanswered."""


JobItem = pb.GenerateEvent | EngineDownError

DEFAULT_MAX_ITEMS = 64


class EventBuffer:
    def __init__(self, max_items: int = DEFAULT_MAX_ITEMS) -> None:
        self.max_items = max_items
        self._items: deque[JobItem] = deque()
        self._ready = asyncio.Event()
        self.merged = 0  # events folded into an earlier one (how far readers fell behind)

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: JobItem) -> None:
        if len(self._items) >= self.max_items and self._merge(item):
            self.merged += 1
            return
        self._items.append(item)
        self._ready.set()

    def _merge(self, item: JobItem) -> bool:
        tail = self._items[-1]
        if isinstance(item, EngineDownError) or isinstance(tail, EngineDownError):
            return False
        if item.HasField("delta") and tail.HasField("delta"):
            tail.delta.text += item.delta.text
            tail.delta.token_ids.extend(item.delta.token_ids)
            tail.delta.logprobs.extend(item.delta.logprobs)
            return True
        if item.HasField("prefill") and tail.HasField("prefill"):
            tail.prefill.CopyFrom(item.prefill)
            return True
        return False

    async def get(self) -> JobItem:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()
