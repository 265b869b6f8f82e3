"""The page pool: ref counts, prefix matching, dedup, LRU eviction, and a model-checked state machine.

The state machine tracks what KV each page physically holds (the tokens it was computed
over) and asserts that every page a job gets from match_prefix or dedup holds exactly
that job's prefix: the property prefix sharing must never break, even when every hash
collides.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from engine.cache import pages, pool_invariants, prefix_hash, prefix_lookup
from engine.cache.pages import PagePool, PageState, PoolStats, chain_hash
from engine.ids import PageId


def fill(pool: PagePool, tokens: Sequence[int]) -> list[PageId]:
    """What a job does for a prompt with no prefix hit: allocate, then register each full page in order."""
    ps = pool.page_size
    table = pool.allocate(-(-len(tokens) // ps))
    assert table is not None
    for i in range(len(tokens) // ps):
        parent = table[i - 1] if i else None
        table[i] = pool.register_full(table[i], parent, tokens[i * ps : (i + 1) * ps])
    return table


def states(pool: PagePool) -> list[PageState]:
    return [pool.state(PageId(p)) for p in range(pool.num_pages)]


def weak_hashes(
    monkeypatch: pytest.MonkeyPatch,
    chain: Callable[[int | None, Sequence[int]], int],
    root: Callable[[str], int | None] | None = None,
) -> None:
    """Give the pool colliding hashes, in every module that hashes a page (each imports them by name)."""
    for module in (pages, prefix_lookup, pool_invariants):
        monkeypatch.setattr(module, "chain_hash", chain)
        if root is not None:
            monkeypatch.setattr(module, "salt_root", root)


# -- chain_hash ------------------------------------------------------------------------------


def test_chain_hash_is_deterministic_and_chained() -> None:
    h0 = chain_hash(None, [1, 2, 3])
    assert h0 == chain_hash(None, (1, 2, 3))
    assert 0 <= h0 < 2**64
    assert h0 != chain_hash(None, [3, 2, 1])
    assert chain_hash(h0, [4, 5, 6]) != chain_hash(None, [4, 5, 6])
    assert chain_hash(h0, [4, 5, 6]) != chain_hash(chain_hash(None, [1, 2, 4]), [4, 5, 6])


# -- allocate / release ----------------------------------------------------------------------


def test_fresh_pool() -> None:
    pool = PagePool(4, 2)
    assert pool.available() == 4
    assert states(pool) == [PageState.FREE] * 4
    assert pool.stats() == PoolStats(4, 4, 0, 0, 0, 0, 0, 0, 0)
    pool.check_invariants([])


@pytest.mark.parametrize(("num_pages", "page_size"), [(0, 4), (4, 0), (-1, 1)])
def test_pool_needs_positive_sizes(num_pages: int, page_size: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        PagePool(num_pages, page_size)


def test_allocate_and_release_unregistered_pages() -> None:
    pool = PagePool(4, 2)
    a = pool.allocate(3)
    assert a == [0, 1, 2]
    assert all(pool.ref_count(p) == 1 and not pool.is_shared(p) for p in a)
    assert pool.available() == 1
    assert pool.allocate(0) == []
    pool.check_invariants([a])
    pool.release(a)
    assert states(pool) == [PageState.FREE] * 4  # nothing registered: nothing to cache
    pool.check_invariants([])


def test_failed_allocation_takes_nothing() -> None:
    pool = PagePool(4, 2)
    table = fill(pool, [1, 2, 3, 4])
    pool.release(table)
    held = pool.allocate(1)
    assert held is not None
    before_states, before_stats = states(pool), pool.stats()
    assert pool.available() == 3
    assert pool.allocate(4) is None
    assert states(pool) == before_states
    assert pool.stats() == before_stats
    assert pool.page_hash(table[0]) is not None  # the cached pages kept their content


def test_allocate_rejects_negative() -> None:
    with pytest.raises(ValueError, match="cannot allocate"):
        PagePool(2, 2).allocate(-1)


def test_release_of_unheld_page_changes_nothing() -> None:
    pool = PagePool(4, 2)
    a = pool.allocate(2)
    assert a is not None
    with pytest.raises(ValueError, match="held 1 times"):
        pool.release([a[0], a[1], a[1]])
    assert [pool.ref_count(p) for p in a] == [1, 1]
    with pytest.raises(ValueError, match="outside the pool"):
        pool.release([PageId(9)])
    with pytest.raises(ValueError, match="held 0 times"):
        pool.release([PageId(3)])


# -- prefix matching -------------------------------------------------------------------------


def test_match_shares_referenced_pages() -> None:
    pool = PagePool(8, 2)
    a = fill(pool, [1, 2, 3, 4, 5])  # two full pages and a partial one
    b = pool.match_prefix([1, 2, 3, 4, 5, 6])
    assert b == a[:2]
    assert all(pool.is_shared(p) and pool.ref_count(p) == 2 for p in b)
    assert not pool.is_shared(a[2])  # the partial page is never matched
    pool.check_invariants([a, b])
    s = pool.stats()
    assert (s.prefix_lookups, s.prefix_query_tokens, s.prefix_hit_tokens) == (1, 6, 4)
    assert s.prefix_hit_rate == pytest.approx(4 / 6)


def test_match_revives_cached_pages() -> None:
    pool = PagePool(8, 2)
    a = fill(pool, [1, 2, 3, 4])
    pool.release(a)
    assert [pool.state(p) for p in a] == [PageState.CACHED] * 2
    assert pool.available() == 8
    b = pool.match_prefix([1, 2, 3, 4, 9])
    assert b == a
    assert [pool.state(p) for p in b] == [PageState.REFERENCED] * 2
    assert [pool.ref_count(p) for p in b] == [1, 1]
    assert pool.available() == 6
    pool.check_invariants([b])


def test_max_tokens_limits_the_match() -> None:
    pool = PagePool(8, 2)
    prompt = [1, 2, 3, 4]
    table = fill(pool, prompt)
    for max_tokens, expected in [(None, 2), (4, 2), (3, 1), (2, 1), (1, 0), (0, 0)]:
        got = pool.match_prefix(prompt, max_tokens=max_tokens)
        assert got == table[:expected], max_tokens
        pool.release(got)
    with pytest.raises(ValueError, match="max_tokens"):
        pool.match_prefix(prompt, max_tokens=-1)


def test_match_is_chained_over_the_whole_prefix() -> None:
    pool = PagePool(8, 2)
    table = fill(pool, [1, 2, 3, 4, 5, 6])
    assert pool.match_prefix([1, 2, 9, 9, 5, 6]) == table[:1]  # stops at the first differing page
    assert pool.match_prefix([9, 9, 3, 4, 5, 6]) == []  # same later pages, other prefix: no hit
    assert pool.match_prefix([1]) == []
    assert pool.match_prefix([]) == []


def test_match_with_colliding_hashes_checks_tokens_and_parents(monkeypatch: pytest.MonkeyPatch) -> None:
    weak_hashes(monkeypatch, lambda parent, tokens: 7)
    pool = PagePool(8, 2)
    a = fill(pool, [1, 2])
    assert pool.match_prefix([5, 6]) == []  # same hash, other tokens
    hit = pool.match_prefix([1, 2, 1, 2])
    assert hit == a  # the second page proposes a[0] again, but a[0] sits on the root, not on a[0]
    pool.release(hit)
    b = fill(pool, [1, 2, 3, 4])  # b[0] dedups onto a[0]; b[1] takes the index entry for 7
    assert b[0] == a[0] and pool.page_hash(b[1]) == 7
    # The index now proposes b[1] for every page; as a first page it sits on the wrong parent.
    assert pool.match_prefix([3, 4]) == []
    assert pool.match_prefix([1, 2, 3, 4]) == []
    pool.check_invariants([a, b])
    pool.release(b)
    pool.release(a)
    # a[0] lost the index entry, so nobody can find it: FREE rather than crowding the cache.
    assert [pool.state(p) for p in b] == [PageState.FREE, PageState.CACHED]
    pool.check_invariants([])


def test_dedup_with_colliding_hashes_checks_parents(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checking only a page's own tokens would hand g a page computed over f's prefix."""
    weak_hashes(monkeypatch, lambda parent, tokens: 7)
    pool = PagePool(8, 2)
    f, g = pool.allocate(2), pool.allocate(2)
    assert f is not None and g is not None
    g[0] = pool.register_full(g[0], None, [9, 9])
    f[0] = pool.register_full(f[0], None, [1, 2])
    f[1] = pool.register_full(f[1], f[0], [3, 4])  # now the page the index finds under 7
    # Same tokens, on a parent with the same hash, but another parent: no dedup.
    assert pool.register_full(g[1], g[0], [3, 4]) == g[1]
    assert pool.ref_count(f[1]) == 1
    assert pool.stats().dedup_hits == 0
    pool.check_invariants([f, g])


# -- registration and dedup ------------------------------------------------------------------


def test_salts_never_share_pages_and_same_salts_do() -> None:
    pool = PagePool(16, 2)
    a = pool.allocate(2)
    assert a is not None
    a[0] = pool.register_full(a[0], None, [1, 2], salt="a")
    a[1] = pool.register_full(a[1], a[0], [3, 4], salt="a")
    assert pool.match_prefix([1, 2, 3, 4, 5], salt="b") == []
    assert pool.match_prefix([1, 2, 3, 4, 5]) == []  # unsalted does not see salted pages either
    hit = pool.match_prefix([1, 2, 3, 4, 5], salt="a")
    assert hit == a
    key = pool.page_key(a[0])
    assert key is not None and key.parent_hash == prefix_hash.salt_root("a") != prefix_hash.salt_root("b")
    # Live dedup only within a salt.
    b = pool.allocate(1)
    assert b is not None
    assert pool.register_full(b[0], None, [1, 2], salt="b") == b[0]
    c = pool.allocate(1)
    assert c is not None
    assert pool.register_full(c[0], None, [1, 2], salt="a") == a[0]
    with pytest.raises(ValueError, match="salt"):
        pool.register_full(a[1], b[0], [3, 4], salt="a")  # a parent of another salt
    pool.check_invariants([a, hit, b, [a[0]]])
    assert pool.stats().prefix_lookups == 3 and pool.stats().prefix_hit_tokens == 4


def test_salts_stay_apart_when_every_hash_collides(monkeypatch: pytest.MonkeyPatch) -> None:
    weak_hashes(monkeypatch, lambda parent, tokens: 7, lambda salt: 7 if salt else None)
    pool = PagePool(8, 2)
    a = pool.allocate(1)
    assert a is not None
    a[0] = pool.register_full(a[0], None, [1, 2], salt="a")
    assert pool.match_prefix([1, 2, 3], salt="b") == []
    b = pool.allocate(1)
    assert b is not None
    assert pool.register_full(b[0], None, [1, 2], salt="b") == b[0]  # no dedup onto a's page
    assert pool.stats().dedup_hits == 0
    pool.check_invariants([a, b])


def test_find_prefix_looks_without_taking_or_counting() -> None:
    pool = PagePool(8, 2)
    table = fill(pool, [1, 2, 3, 4])
    pool.release(table)
    before = states(pool), pool.stats()
    hashes: list[int] = []
    prefix_hash.extend_chain(hashes, [1, 2, 3, 4, 5], 2, "", 2)
    assert hashes == [chain_hash(None, [1, 2]), chain_hash(hashes[0], [3, 4])]
    assert pool.find_prefix([1, 2, 3, 4, 5], 4, hashes=hashes) == table
    assert (states(pool), pool.stats()) == before
    pool.take_prefix(table, 4)
    s = pool.stats()
    assert (s.prefix_lookups, s.prefix_query_tokens, s.prefix_hit_tokens, s.cached) == (1, 4, 4, 0)
    pool.check_invariants([table])


def test_register_records_hash_and_key() -> None:
    pool = PagePool(4, 2)
    t = pool.allocate(2)
    assert t is not None
    assert pool.register_full(t[0], None, [1, 2]) == t[0]
    assert pool.register_full(t[1], t[0], [3, 4]) == t[1]
    h0 = chain_hash(None, [1, 2])
    assert pool.page_hash(t[0]) == h0
    key = pool.page_key(t[1])
    assert key is not None
    assert (key.hash, key.parent_hash, key.tokens) == (chain_hash(h0, [3, 4]), h0, (3, 4))
    assert pool.register_full(t[1], t[0], (3, 4)) == t[1]  # again, same content: a no-op
    pool.check_invariants([t])


def test_register_validates() -> None:
    pool = PagePool(4, 2)
    t = pool.allocate(2)
    assert t is not None
    with pytest.raises(ValueError, match="holds 2 tokens"):
        pool.register_full(t[0], None, [1])
    with pytest.raises(ValueError, match="not held"):
        pool.register_full(PageId(3), None, [1, 2])
    with pytest.raises(ValueError, match="parent page"):
        pool.register_full(t[1], t[0], [3, 4])  # parent not registered yet
    pool.register_full(t[0], None, [1, 2])
    with pytest.raises(ValueError, match="other content"):
        pool.register_full(t[0], None, [1, 3])


def test_dedup_switches_to_a_referenced_page() -> None:
    pool = PagePool(8, 2)
    a = fill(pool, [1, 2, 3, 4])
    b = pool.allocate(2)  # a second job computed the same prompt before a registered it
    assert b is not None
    own = list(b)
    b[0] = pool.register_full(b[0], None, [1, 2])
    b[1] = pool.register_full(b[1], b[0], [3, 4])
    assert b == a
    assert [pool.ref_count(p) for p in a] == [2, 2]
    assert [pool.state(p) for p in own] == [PageState.FREE] * 2
    assert pool.stats().dedup_hits == 2
    pool.check_invariants([a, b])


def test_dedup_revives_a_cached_page() -> None:
    pool = PagePool(8, 2)
    a = fill(pool, [1, 2])
    pool.release(a)
    b = pool.allocate(1)
    assert b is not None
    assert pool.register_full(b[0], None, [1, 2]) == a[0]
    assert pool.state(a[0]) == PageState.REFERENCED
    assert pool.ref_count(a[0]) == 1
    assert pool.state(b[0]) == PageState.FREE
    pool.check_invariants([a])


def test_no_dedup_across_parents() -> None:
    pool = PagePool(8, 2)
    a = fill(pool, [1, 2, 3, 4])
    b = fill(pool, [5, 6, 3, 4])
    assert a[1] != b[1]
    assert pool.page_key(a[1]) != pool.page_key(b[1])
    pool.check_invariants([a, b])


def test_forked_holders_register_once() -> None:
    pool = PagePool(8, 2)
    a = pool.allocate(1)
    assert a is not None
    pool.retain(a)
    b = list(a)
    assert pool.is_shared(a[0])
    assert pool.register_full(a[0], None, [1, 2]) == a[0]
    assert pool.register_full(b[0], None, [1, 2]) == a[0]
    assert pool.ref_count(a[0]) == 2
    pool.check_invariants([a, b])


def test_dedup_of_a_shared_unregistered_page_moves_one_reference() -> None:
    pool = PagePool(8, 2)
    existing = fill(pool, [1, 2])
    a = pool.allocate(1)
    assert a is not None
    pool.retain(a)
    b = list(a)
    a[0] = pool.register_full(a[0], None, [1, 2])
    assert a == existing
    assert pool.ref_count(b[0]) == 1  # b still holds its copy
    pool.check_invariants([existing, a, b])


def test_retain_needs_a_held_page() -> None:
    pool = PagePool(2, 2)
    with pytest.raises(ValueError, match="not held"):
        pool.retain([PageId(0)])


# -- eviction order --------------------------------------------------------------------------


def test_eviction_is_tail_first_and_least_recent_first() -> None:
    pool = PagePool(6, 2)
    old = fill(pool, [1, 2, 3, 4, 5, 6])
    pool.release(old)
    new = fill(pool, [7, 8, 9, 10, 11, 12])
    pool.release(new)
    assert pool.stats().cached == 6
    order = []
    for _ in range(6):
        got = pool.allocate(1)
        assert got is not None
        order.extend(got)
    # The older table goes first, each table from its end to its start.
    assert order == old[::-1] + new[::-1]
    assert pool.stats().evictions == 6


def test_eviction_drops_the_hash_and_keeps_the_prefix_start() -> None:
    pool = PagePool(3, 2)
    table = fill(pool, [1, 2, 3, 4, 5, 6])
    pool.release(table)
    got = pool.allocate(1)
    assert got == [table[2]]
    assert pool.page_hash(table[2]) is None
    assert pool.match_prefix([1, 2, 3, 4, 5, 6]) == table[:2]


def test_a_hit_leaves_the_lru() -> None:
    pool = PagePool(4, 2)
    a = fill(pool, [1, 2])
    pool.release(a)
    b = fill(pool, [3, 4])
    pool.release(b)
    hit = pool.match_prefix([1, 2])  # a is least recently used, but now held
    assert hit == a
    grabbed = pool.allocate(3)
    assert grabbed is not None
    assert a[0] not in grabbed
    assert b[0] in grabbed
    pool.release(hit)
    assert pool.state(a[0]) == PageState.CACHED  # back in the LRU, now the most recent


def test_free_pages_go_before_cached_ones() -> None:
    pool = PagePool(4, 2)
    cached = fill(pool, [1, 2])
    pool.release(cached)
    got = pool.allocate(3)
    assert got is not None
    assert cached[0] not in got
    assert pool.stats().evictions == 0


def test_an_orphan_gives_way_to_a_newcomer() -> None:
    pool = PagePool(8, 2)
    a = fill(pool, [1, 2, 3, 4])
    pool.release(a)
    job = pool.match_prefix([1, 2])
    pool.unregister(job[0])  # rolled back: a[1] now sits on a registration that is gone
    assert pool.match_prefix([1, 2, 3, 4]) == []
    b = fill(pool, [1, 2, 3, 4])
    assert pool.state(a[1]) == PageState.FREE  # displaced from the index; unreachable anyway
    pool.release(b)
    assert pool.match_prefix([1, 2, 3, 4]) == b
    assert pool.stats().dedup_hits == 0


# -- rollback --------------------------------------------------------------------------------


def test_unregister_forgets_a_page_held_alone() -> None:
    pool = PagePool(4, 2)
    table = fill(pool, [1, 2, 3, 4])
    pool.release(table[1:])
    pool.unregister(table[0])  # its last token was rejected
    assert pool.page_hash(table[0]) is None
    assert pool.match_prefix([1, 2, 3, 4]) == []
    pool.release(table[:1])
    assert pool.state(table[0]) == PageState.FREE
    fresh = pool.allocate(1)
    assert fresh is not None
    pool.unregister(fresh[0])  # no hash: a no-op
    pool.check_invariants([fresh])


def test_unregister_refuses_shared_and_unheld_pages() -> None:
    pool = PagePool(4, 2)
    a = fill(pool, [1, 2])
    b = pool.match_prefix([1, 2])
    assert pool.is_shared(a[0])
    with pytest.raises(ValueError, match="ref count 2"):
        pool.unregister(a[0])  # the generator must copy on write
    pool.release(b)
    pool.release(a)
    with pytest.raises(ValueError, match="ref count 0"):
        pool.unregister(a[0])
    assert pool.state(a[0]) == PageState.CACHED


def test_unregister_after_dedup_onto_a_cached_page() -> None:
    pool = PagePool(4, 2)
    a = fill(pool, [1, 2])
    pool.release(a)
    b = pool.allocate(1)
    assert b is not None
    b[0] = pool.register_full(b[0], None, [1, 2])
    assert b == a and not pool.is_shared(b[0])
    pool.unregister(b[0])  # held alone, so it may change in place once out of the index
    assert pool.match_prefix([1, 2]) == []
    pool.check_invariants([b])


# -- invariant checker -----------------------------------------------------------------------


def test_check_invariants_catches_broken_tables() -> None:
    pool = PagePool(4, 2)
    a = fill(pool, [1, 2, 3, 4])
    with pytest.raises(AssertionError, match="ref count 1 but 0 tables"):
        pool.check_invariants([])
    with pytest.raises(AssertionError, match="twice"):
        pool.check_invariants([[a[0], a[0], a[1]]])
    with pytest.raises(AssertionError, match="on top of another page"):
        pool.check_invariants([[a[1], a[0]]])
    b = pool.allocate(1)
    assert b is not None
    with pytest.raises(AssertionError, match="registered after unregistered"):
        pool.check_invariants([[b[0], a[0], a[1]]])


def test_check_invariants_catches_corrupt_state() -> None:
    pool = PagePool(4, 2)
    a = fill(pool, [1, 2])
    pool.release(a)
    pool._free.append(a[0])  # a CACHED page also on the free list
    with pytest.raises(AssertionError, match="2 states"):
        pool.check_invariants([])


# -- state machine ---------------------------------------------------------------------------

MAX_JOBS = 5
TOKENS = st.integers(min_value=0, max_value=2)  # a tiny alphabet, so prefixes collide often
JOB = st.integers(min_value=0, max_value=1_000)  # index into the live jobs, modulo their number
# Prompts often start with one of a few "system prompts", as in serving, so prefixes are shared.
PROMPTS = st.builds(
    lambda head, tail: [*head, *tail],
    st.sampled_from([(), (0, 1, 2, 0, 1), (2, 2, 1, 0, 2, 1, 1)]),
    st.lists(TOKENS, max_size=8),
).filter(bool)


SALTS = st.sampled_from(["", "a", "b"])


@dataclass(eq=False)
class Job:
    tokens: list[int]
    table: list[PageId]
    salt: str = ""


class PoolMachine(RuleBasedStateMachine):
    """Jobs as a generator drives them; `kv` is what each page physically holds (its tokens from 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = PagePool(1, 1)
        self.jobs: list[Job] = []
        self.hogs: list[list[PageId]] = []  # tables of pages held without content: memory pressure
        self.kv: dict[PageId, tuple[int, ...]] = {}
        self.kv_salt: dict[PageId, str] = {}  # the salt of the job whose KV a page holds

    @initialize(num_pages=st.integers(min_value=3, max_value=16), page_size=st.integers(1, 4))
    def setup(self, num_pages: int, page_size: int) -> None:
        self.pool = PagePool(num_pages, page_size)

    # -- helpers --

    @property
    def ps(self) -> int:
        return self.pool.page_size

    def tables(self) -> list[list[PageId]]:
        return [job.table for job in self.jobs] + self.hogs

    def pick(self, which: int) -> Job:
        return self.jobs[which % len(self.jobs)]

    def drop(self, job: Job) -> None:
        self.pool.release(job.table)
        self.jobs.remove(job)

    def replace(self, job: Job, i: int, content: tuple[int, ...]) -> bool:
        """Copy on write: a private copy of the job's page i. False if no page is left."""
        fresh = self.pool.allocate(1)
        if fresh is None:
            return False
        self.pool.release([job.table[i]])
        job.table[i] = fresh[0]
        self.kv[fresh[0]] = content
        self.kv_salt[fresh[0]] = job.salt
        return True

    def write(self, job: Job, token: int) -> bool:
        """Compute one token's KV into the job's pages; register the page it fills. False if out of pages."""
        pos = len(job.tokens)
        i, offset = divmod(pos, self.ps)
        if i == len(job.table):
            fresh = self.pool.allocate(1)
            if fresh is None:
                return False
            job.table.append(fresh[0])
            self.kv[fresh[0]] = ()
            self.kv_salt[fresh[0]] = job.salt
        elif self.pool.is_shared(job.table[i]) and not self.replace(job, i, self.kv[job.table[i]]):
            return False
        page = job.table[i]
        assert self.kv[page] == (tuple(job.tokens) if offset else ()), "writing into a page with other KV"
        job.tokens.append(token)
        self.kv[page] = tuple(job.tokens)
        if offset == self.ps - 1:
            parent = job.table[i - 1] if i else None
            got = self.pool.register_full(page, parent, job.tokens[i * self.ps :], job.salt)
            if got != page:
                assert self.kv[got] == self.kv[page], "dedup handed a job a page computed over another prefix"
                assert self.kv_salt[got] == job.salt, "dedup handed a job another salt's page"
                job.table[i] = got
        return True

    # -- rules --

    @precondition(lambda self: len(self.jobs) < MAX_JOBS)
    @rule(prompt=PROMPTS, whole=st.booleans(), salt=SALTS)
    def start_job(self, prompt: list[int], whole: bool, salt: str) -> None:
        max_tokens = None if whole else len(prompt) - 1
        matched = self.pool.match_prefix(prompt, max_tokens=max_tokens, salt=salt)
        assert len(matched) * self.ps <= (len(prompt) if whole else len(prompt) - 1)
        for i, page in enumerate(matched):
            assert self.kv[page] == tuple(prompt[: (i + 1) * self.ps]), "a prefix hit with other KV"
            assert self.kv_salt[page] == salt, "a prefix hit on another salt's page"
        need = -(-len(prompt) // self.ps) - len(matched)
        fresh = self.pool.allocate(need)
        if fresh is None:  # not admitted: hand the hits back
            assert self.pool.available() < need
            self.pool.release(matched)
            return
        for page in fresh:
            self.kv[page] = ()
            self.kv_salt[page] = salt
        job = Job(list(prompt[: len(matched) * self.ps]), matched + fresh, salt)
        self.jobs.append(job)
        for token in prompt[len(job.tokens) :]:
            assert self.write(job, token), "the prompt's pages were allocated up front"

    @precondition(lambda self: self.jobs)
    @rule(which=JOB, tokens=st.lists(TOKENS, min_size=1, max_size=6))
    def decode(self, which: int, tokens: list[int]) -> None:
        job = self.pick(which)
        for token in tokens:
            if not self.write(job, token):
                self.drop(job)  # preempted: out of pages
                return

    @precondition(lambda self: any(len(job.tokens) > 1 for job in self.jobs))
    @rule(which=JOB, data=st.data())
    def roll_back(self, which: int, data: st.DataObject) -> None:
        """Speculative tokens rejected: keep a shorter prefix of the job."""
        candidates = [job for job in self.jobs if len(job.tokens) > 1]
        job = candidates[which % len(candidates)]
        keep = data.draw(st.integers(min_value=1, max_value=len(job.tokens) - 1), label="keep")
        pages_kept = -(-keep // self.ps)
        self.pool.release(job.table[pages_kept:])
        del job.table[pages_kept:]
        del job.tokens[keep:]
        if keep % self.ps:  # the last page lost its tail: it must leave the index, or be copied
            i = pages_kept - 1
            page = job.table[i]
            if self.pool.is_shared(page):
                if not self.replace(job, i, tuple(job.tokens)):
                    self.drop(job)
            else:
                self.pool.unregister(page)
                self.kv[page] = tuple(job.tokens)

    @precondition(lambda self: self.jobs and len(self.jobs) < MAX_JOBS)
    @rule(which=JOB)
    def fork(self, which: int) -> None:
        job = self.pick(which)
        self.pool.retain(job.table)
        self.jobs.append(Job(list(job.tokens), list(job.table), job.salt))

    @precondition(lambda self: self.jobs)
    @rule(which=JOB)
    def finish_or_cancel(self, which: int) -> None:
        self.drop(self.pick(which))

    @rule()
    def preempt_all(self) -> None:
        for job in list(self.jobs):
            self.drop(job)

    @rule(n=st.integers(min_value=1, max_value=8))
    def hog(self, n: int) -> None:
        before_states, before_stats = states(self.pool), self.pool.stats()
        taken = self.pool.allocate(n)
        if taken is None:
            assert before_stats.free + before_stats.cached < n
            assert states(self.pool) == before_states and self.pool.stats() == before_stats
            return
        for page in taken:
            self.kv[page] = ()
        self.hogs.append(taken)

    @precondition(lambda self: self.hogs)
    @rule()
    def unhog(self) -> None:
        self.pool.release(self.hogs.pop())

    # -- invariants --

    @invariant()
    def pool_is_consistent(self) -> None:
        self.pool.check_invariants(self.tables())
        s = self.pool.stats()
        assert s.free + s.cached + s.referenced == s.num_pages

    @invariant()
    def pages_hold_what_their_tables_say(self) -> None:
        ps = self.ps
        for job in self.jobs:
            assert len(job.table) == -(-len(job.tokens) // ps)
            for i, page in enumerate(job.table):
                assert self.kv[page] == tuple(job.tokens[: (i + 1) * ps])
        for p in range(self.pool.num_pages):
            key = self.pool.page_key(PageId(p))
            if key is None:
                continue
            content = self.kv[PageId(p)]
            assert len(content) % ps == 0 and content[-ps:] == key.tokens
            h = prefix_hash.salt_root(self.kv_salt[PageId(p)])
            for start in range(0, len(content), ps):
                h = pages.chain_hash(h, content[start : start + ps])
            assert h == key.hash, f"page {p}'s hash does not describe its KV"

    def teardown(self) -> None:
        for job in list(self.jobs):
            self.drop(job)
        for hog in self.hogs:
            self.pool.release(hog)
        self.pool.check_invariants([])
        assert all(state is not PageState.REFERENCED for state in states(self.pool))


MACHINE_SETTINGS = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_pool_state_machine() -> None:
    run_state_machine_as_test(PoolMachine, settings=MACHINE_SETTINGS)  # type: ignore[no-untyped-call]


def test_pool_state_machine_with_weak_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three hash values in all: constant collisions and displacements; no job may get foreign KV."""
    weak_hashes(monkeypatch, lambda parent, tokens: (sum(tokens) + (parent or 0)) % 3)
    run_state_machine_as_test(PoolMachine, settings=MACHINE_SETTINGS)  # type: ignore[no-untyped-call]
