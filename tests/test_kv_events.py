"""KV events (engine/cache/kv_events.py): the page pool says which pages become findable and which
stop being so, numbered for replay; the cache manager hands them out.

The pool alone first (stored, deduplicated, evicted, unregistered, replay, a subscriber too far
behind), then a generator on a tiny random model: every page its jobs leave findable in the prefix
index was announced, and every announced page that is no longer findable was removed.
"""

from __future__ import annotations

import random

import pytest

from engine.cache.kv_events import AllBlocksCleared, BlocksRemoved, BlockStored, KvEvent, KvEventLog
from engine.cache.pages import PagePool
from engine.cache.prefix_hash import chain_hash, salt_root
from engine.generator import DynamicGenerator, GeneratorConfig
from engine.ids import PageId
from engine.jobs import JobSpec
from engine.model.loader import LoadedModel
from engine.scheduler import SchedulerConfig
from tests.tiny_llama import TINY_VOCAB

PS = 4


def events(pool: PagePool, since: int = 0) -> list[KvEvent]:
    got = pool.kv_events(since)
    assert got is not None
    return [e for _, e in got]


def test_a_new_pool_starts_cleared_and_a_registered_page_is_stored_with_its_chain() -> None:
    pool = PagePool(4, PS)
    assert events(pool) == [AllBlocksCleared()]
    a, b = pool.allocate(2) or []
    pool.register_full(a, None, [1, 2, 3, 4])
    pool.register_full(b, a, [5, 6, 7, 8])
    first = chain_hash(None, (1, 2, 3, 4))
    assert events(pool, 1) == [
        BlockStored(first, None, (1, 2, 3, 4)),
        BlockStored(chain_hash(first, (5, 6, 7, 8)), first, (5, 6, 7, 8)),
    ]


def test_a_salted_chain_starts_at_its_salt() -> None:
    pool = PagePool(2, PS)
    (a,) = pool.allocate(1) or []
    pool.register_full(a, None, [1, 2, 3, 4], salt="tenant-a")
    root = salt_root("tenant-a")
    assert events(pool, 1) == [BlockStored(chain_hash(root, (1, 2, 3, 4)), root, (1, 2, 3, 4), salted=True)]


def test_a_deduplicated_page_stores_nothing_new_and_eviction_and_unregister_remove() -> None:
    pool = PagePool(3, PS)
    a, b = pool.allocate(2) or []
    assert pool.register_full(a, None, [1, 2, 3, 4]) == a
    assert pool.register_full(b, None, [1, 2, 3, 4]) == a  # the same content: b is given back
    h = chain_hash(None, (1, 2, 3, 4))
    assert events(pool, 1) == [BlockStored(h, None, (1, 2, 3, 4))]
    pool.release([a, a])  # both holders let go: CACHED, still findable
    assert pool.kv_events(2) == []
    assert pool.allocate(3) is not None  # the cached page is evicted for new content
    assert events(pool, 2) == [BlocksRemoved((h,))]

    other = PagePool(2, PS)
    (c,) = other.allocate(1) or []
    other.register_full(c, None, [9, 9, 9, 9])
    other.unregister(c)  # rolled back before a rewrite: no longer findable
    assert events(other, 2) == [BlocksRemoved((chain_hash(None, (9, 9, 9, 9)),))]


def test_replay_from_a_number_gives_the_same_events_and_a_subscriber_too_far_behind_is_told() -> None:
    log = KvEventLog(3)
    stored = [BlockStored(i, None, (i,)) for i in range(5)]
    for e in stored:
        log.append(e)
    assert log.next_seq == 5
    assert log.since(2) == [(2, stored[2]), (3, stored[3]), (4, stored[4])]
    assert log.since(4) == [(4, stored[4])]
    assert log.since(5) == []  # caught up
    assert log.since(1) is None  # event 1 is gone: start again from a snapshot
    with pytest.raises(ValueError, match="at least one event"):
        KvEventLog(0)


def test_the_events_follow_what_the_prefix_index_holds_through_evictions(tiny: LoadedModel) -> None:
    # A pool of 24 pages of 4 tokens under jobs sharing prefixes: pages are registered, shared,
    # evicted for new content and registered again.
    sched = SchedulerConfig(max_batch_size=4, max_chunk_size=64)
    gen = DynamicGenerator(tiny.model, tiny.tokenizer, GeneratorConfig(PS, 24, scheduler=sched))
    rng = random.Random(7)
    removed = 0
    prefixes = [[rng.randrange(3, TINY_VOCAB) for _ in range(10)] for _ in range(3)]
    for round_ in range(4):
        specs = [
            JobSpec(
                tuple(p + [rng.randrange(3, TINY_VOCAB) for _ in range(3)]), max_new_tokens=6, ignore_eos=True
            )
            for p in prefixes
        ]
        gen.generate(specs)
        got = gen.scheduler.cache.events(0)
        assert got is not None, f"round {round_}: the log holds every event of this small run"
        live: dict[int, BlockStored] = {}
        for _, e in got:
            if isinstance(e, AllBlocksCleared):
                live.clear()
            elif isinstance(e, BlockStored):
                live[e.block_hash] = e
            else:
                removed += 1
                for h in e.block_hashes:
                    del live[h]  # only an announced page is ever removed
        findable = {gen.pool.page_hash(PageId(p)) for p in range(gen.pool.num_pages)} - {None}
        assert set(live) == findable
    assert removed, "the run evicted pages"
