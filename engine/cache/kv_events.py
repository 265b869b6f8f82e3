"""KV events: what the prefix cache holds, as a stream a cache-aware router can follow.

The page pool appends an event whenever a page becomes findable (BlockStored: its chain hash, its
parent's hash and its tokens) or stops being findable (BlocksRemoved: evicted for new content,
unregistered before a rewrite, or displaced by a colliding hash), and a new pool starts with
AllBlocksCleared, so a subscriber that followed an engine before its restart drops what it knew.
A page deduplicated onto an identical one stores nothing new.

The log is a bounded ring numbered from 0: `since(n)` replays from event n, or says the caller is
too far behind (the events it missed are gone) and must start again from a snapshot of the pool.
Hashes are the pool's own chain hashes (engine/cache/prefix_hash.py), salted per cache salt and
adapter, so equal tokens under two salts are two blocks.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hash: int
    parent_hash: int | None  # None: a first page without a salt
    token_ids: tuple[int, ...]
    salted: bool = False  # stored under a cache salt or an adapter: only such requests can hit it


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlocksRemoved | AllBlocksCleared


class KvEventLog:
    """The last `capacity` KV events, each numbered (its sequence number) from 0."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"a KV event log holds at least one event, got capacity {capacity}")
        self._events: deque[KvEvent] = deque(maxlen=capacity)
        self._next = 0  # the number the next event gets

    @property
    def next_seq(self) -> int:
        return self._next

    def append(self, event: KvEvent) -> None:
        self._events.append(event)
        self._next += 1

    def since(self, seq: int) -> list[tuple[int, KvEvent]] | None:
        """Events numbered `seq` and after, oldest first; None if some of them are no longer held.
        Costs the events returned, not the log's length (the engine asks after every iteration)."""
        if seq < self._next - len(self._events):
            return None
        n = max(0, self._next - seq)
        newest = list(itertools.islice(reversed(self._events), n))
        return [(self._next - n + i, e) for i, e in enumerate(reversed(newest))]
