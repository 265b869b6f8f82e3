"""KvEventRelay: the engine's KV events as one numbered stream that outlives engine restarts.

The engine numbers its events from 0 in each process; a gateway keeps a cursor across them. So the
front end numbers the batches itself (from 1, one batch per engine message), keeps the last
`capacity` of them (and no more than about `max_events` events: each holds a page's tokens) for
replay, and keeps the live blocks they describe (hash -> its BlockStored,
parents first) for a subscriber that cannot replay: one that asks for the current state (cursor 0),
fell out of the history, or holds a cursor from before this server started. Such a subscriber gets
a snapshot instead, an AllBlocksCleared followed by every live block, after which the live batches
follow with no gap.

Only unsalted pages are relayed. A page stored under a cache salt (a tenant, a request's salt) or an
adapter can be hit only by requests of that salt, which a gateway cannot send; announcing it would
mislead the gateway's routing and show it another tenant's prompt tokens.

An engine that stops loses its cache: the relay then records an AllBlocksCleared of its own at
once (the restarted engine's pool starts with one too), so no subscriber routes to pages that are
gone while the engine restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass

from engine.cache.kv_events import AllBlocksCleared, BlocksRemoved, BlockStored, KvEvent
from engine.defaults import KV_EVENT_CAPACITY

RELAY_CAPACITY = 1024  # batches kept for replay
RELAY_EVENTS = KV_EVENT_CAPACITY  # and at most about this many events in them (each holds a page's tokens)


@dataclass(frozen=True)
class RelayBatch:
    """One engine message's KV events under the relay's sequence number."""

    seq: int
    timestamp: float  # wall clock, seconds
    events: tuple[KvEvent, ...]
    first_event_id: int  # events are numbered on from here, across batches


class KvEventRelay:
    def __init__(self, capacity: int = RELAY_CAPACITY, max_events: int = RELAY_EVENTS) -> None:
        if capacity <= 0 or max_events <= 0:
            raise ValueError(f"the relay keeps at least one batch and event, got {capacity} and {max_events}")
        self._batches: deque[RelayBatch] = deque()
        self._capacity = capacity
        self._max_events = max_events
        self._events = 0  # events in the kept batches
        self._next = 1
        self._next_event_id = 1
        self._live: dict[int, BlockStored] = {}
        self._version = 0
        self._waiter: asyncio.Future[None] | None = None

    @property
    def last_seq(self) -> int:
        """The sequence number of the newest batch (0 before the first)."""
        return self._next - 1

    def live_blocks(self) -> list[BlockStored]:
        """The blocks the engine's prefix index holds, as far as its events say, parents first."""
        return list(self._live.values())

    def publish(self, events: list[KvEvent]) -> RelayBatch | None:
        """Number and keep one engine message's events; wakes every subscriber. None if empty."""
        kept = [k for k in (self._apply(e) for e in events) if k is not None]
        if not kept:
            return None
        batch = RelayBatch(self._next, time.time(), tuple(kept), self._next_event_id)
        self._batches.append(batch)
        self._events += len(kept)
        # The newest batch always stays, whatever its size; older ones go past either bound.
        while len(self._batches) > 1 and (
            len(self._batches) > self._capacity or self._events > self._max_events
        ):
            self._events -= len(self._batches.popleft().events)
        self._next += 1
        self._next_event_id += len(kept)
        self._notify()
        return batch

    def engine_stopped(self) -> None:
        """The engine process ended: its cache with it."""
        self.publish([AllBlocksCleared()])

    def since(self, seq: int) -> list[RelayBatch] | None:
        """The kept batches numbered `seq` and after; None when the caller must take a snapshot
        instead (0: it asks for the current state; or batches it needs are gone; or `seq` is ahead
        of anything published here)."""
        if seq <= 0 or seq > self._next:
            return None
        first = self._batches[0].seq if self._batches else self._next
        if seq < first:
            return None
        return [b for b in self._batches if b.seq >= seq]

    @property
    def version(self) -> int:
        """Goes up with every batch and every load change (`notify_load`)."""
        return self._version

    async def wait(self, version: int, timeout: float) -> int:
        """Until `version` is out of date (a batch, a load change) or `timeout` seconds pass; the
        current version."""
        if self._version == version:
            if self._waiter is None or self._waiter.done():
                self._waiter = asyncio.get_running_loop().create_future()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._waiter), timeout)
        return self._version

    def notify_load(self) -> None:
        """Wake subscribers without a batch: the engine's load changed."""
        self._notify()

    def _notify(self) -> None:
        self._version += 1
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        self._waiter = None

    def _apply(self, event: KvEvent) -> KvEvent | None:
        """Track one event; what of it is relayed (None: nothing)."""
        match event:
            case BlockStored():
                if event.salted:
                    return None
                self._live.pop(event.block_hash, None)
                self._live[event.block_hash] = event
            case BlocksRemoved():
                gone = tuple(h for h in event.block_hashes if self._live.pop(h, None) is not None)
                return BlocksRemoved(gone) if gone else None
            case AllBlocksCleared():
                self._live.clear()
        return event
