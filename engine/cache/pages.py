"""The page pool of the paged KV cache: who holds which page, and what a page holds.

Pure bookkeeping, no tensors. Every page is in exactly one state:

- FREE: holds nothing worth keeping; `allocate` takes these first.
- CACHED: nobody holds it, but it is a full page registered under its prefix hash, so
  `match_prefix` can revive it; `allocate` evicts these least recently used first.
- REFERENCED: held by one or more page tables (ref count = number of tables).

A full page is registered under its prefix hash, and a hit must also match its exact tokens, parent
registration and cache salt (engine/cache/prefix_lookup.py says why); the invariants are checked in
engine/cache/pool_invariants.py.

How a generator drives it, per job:
1. `table = pool.match_prefix(prompt, max_tokens=len(prompt) - 1)`: the first
   `len(table) * page_size` tokens are already in the cache. (Or `find_prefix` to look
   without taking anything, then `take_prefix` once the rest fits: one counted lookup.)
2. `pool.allocate(k)` for the rest (None: queue or preempt).
3. When page i fills: `table[i] = pool.register_full(table[i], table[i - 1] if i else None, its tokens, salt)`.
4. Before writing into a page (or rolling tokens back in it) that `is_shared`: copy on
   write (allocate, copy the KV, release the old one). A rolled-back page that is not
   shared: `unregister` it, then overwrite in place.
5. Finish, cancel, preempt: `pool.release(table)`, in table order.
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.cache.kv_events import AllBlocksCleared, BlocksRemoved, BlockStored, KvEvent, KvEventLog
from engine.cache.pool_invariants import PoolView, check_pool_invariants
from engine.cache.prefix_hash import chain_hash, salt_root
from engine.cache.prefix_lookup import ROOT_SERIAL, PageKey, Registration, find_chain, find_partial
from engine.defaults import KV_EVENT_CAPACITY
from engine.ids import PageId

__all__ = ["PageKey", "PagePool", "PageState", "PoolStats", "chain_hash"]


class PageState(enum.Enum):
    FREE = "free"
    CACHED = "cached"
    REFERENCED = "referenced"


@dataclass(frozen=True)
class PoolStats:
    num_pages: int
    free: int
    cached: int
    referenced: int
    prefix_lookups: int  # match_prefix calls
    prefix_query_tokens: int  # tokens those calls offered (after max_tokens)
    prefix_hit_tokens: int  # tokens they found in the cache
    dedup_hits: int  # register_full calls that switched the caller to an existing page
    evictions: int  # cached pages dropped by allocate

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


class PagePool:
    """Ref counts, prefix index and LRU of the KV cache's pages. Every operation is O(pages touched)."""

    def __init__(self, num_pages: int, page_size: int, event_capacity: int = KV_EVENT_CAPACITY) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"page count and page size must be positive, got {num_pages} and {page_size}")
        self._num_pages = num_pages
        self._page_size = page_size
        self._ref = [0] * num_pages
        # A stack; reversed so that a fresh pool hands out 0, 1, 2, ...
        self._free: list[PageId] = [PageId(p) for p in reversed(range(num_pages))]
        self._lru: OrderedDict[PageId, None] = OrderedDict()  # CACHED pages, least recently used first
        self._reg: dict[PageId, Registration] = {}
        self._index: dict[int, PageId] = {}  # hash -> the one page a lookup finds
        # Parent registration serial -> its registered children, newest last: where `find_partial`
        # looks for a page that starts like the caller's next, not yet matched, tokens.
        self._children: dict[int, OrderedDict[PageId, None]] = {}
        self._next_serial = ROOT_SERIAL + 1
        self._prefix_lookups = 0
        self._prefix_query_tokens = 0
        self._prefix_hit_tokens = 0
        self._dedup_hits = 0
        self._evictions = 0
        # What becomes findable and what stops being so (engine/cache/kv_events.py); a new pool
        # holds nothing, which is the first thing a subscriber hears.
        self._events = KvEventLog(event_capacity)
        self._events.append(AllBlocksCleared())

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def page_size(self) -> int:
        return self._page_size

    # -- queries -------------------------------------------------------------------------

    def kv_events(self, since: int) -> list[tuple[int, KvEvent]] | None:
        """KV events numbered `since` and after; None if the log no longer holds them all."""
        return self._events.since(since)

    def kv_events_next(self) -> int:
        """The number the next KV event will get."""
        return self._events.next_seq

    def available(self) -> int:
        """Pages `allocate` can hand out now: FREE + CACHED."""
        return len(self._free) + len(self._lru)

    def ref_count(self, page: PageId) -> int:
        self._check_page(page)
        return self._ref[page]

    def is_shared(self, page: PageId) -> bool:
        """Held by more than one table: must not be written in place (copy on write)."""
        return self.ref_count(page) > 1

    def state(self, page: PageId) -> PageState:
        self._check_page(page)
        if self._ref[page] > 0:
            return PageState.REFERENCED
        return PageState.CACHED if page in self._lru else PageState.FREE

    def page_key(self, page: PageId) -> PageKey | None:
        """Hash, parent hash and tokens of a registered page; None if it has none."""
        self._check_page(page)
        reg = self._reg.get(page)
        return None if reg is None else reg.key

    def page_hash(self, page: PageId) -> int | None:
        key = self.page_key(page)
        return None if key is None else key.hash

    def stats(self) -> PoolStats:
        free, cached = len(self._free), len(self._lru)
        return PoolStats(
            num_pages=self._num_pages,
            free=free,
            cached=cached,
            referenced=self._num_pages - free - cached,
            prefix_lookups=self._prefix_lookups,
            prefix_query_tokens=self._prefix_query_tokens,
            prefix_hit_tokens=self._prefix_hit_tokens,
            dedup_hits=self._dedup_hits,
            evictions=self._evictions,
        )

    # -- operations ----------------------------------------------------------------------

    def match_prefix(
        self,
        token_ids: Sequence[int],
        max_tokens: int | None = None,
        *,
        salt: str = "",
        hashes: Sequence[int] | None = None,
    ) -> list[PageId]:
        """Reference the longest run of cached leading full pages of `token_ids` (at most `max_tokens` tokens).

        Pages other tables hold are shared (ref + 1); CACHED ones are revived (ref 1).
        The generator passes `max_tokens=len(prompt) - 1`: it must still run at least one
        prompt token to get logits. Counts as one lookup in the stats.
        """
        matched = self.find_prefix(token_ids, max_tokens, salt=salt, hashes=hashes)
        self.take_prefix(matched, self._limit(token_ids, max_tokens))
        return matched

    def find_prefix(
        self,
        token_ids: Sequence[int],
        max_tokens: int | None = None,
        *,
        salt: str = "",
        hashes: Sequence[int] | None = None,
    ) -> list[PageId]:
        """What `match_prefix` would match, taking no reference and counting nothing.

        `hashes`: the sequence's chain hashes of its leading full pages (`extend_chain`), so a
        caller that looks up again and again (a job waiting for room) hashes its pages once.
        """
        limit = self._limit(token_ids, max_tokens)
        return find_chain(self._index, self._reg, token_ids, limit, self._page_size, salt=salt, hashes=hashes)

    def find_partial(
        self, parent: PageId | None, tokens: Sequence[int], *, salt: str = ""
    ) -> tuple[PageId, int] | None:
        """The registered page on top of `parent` (None: a first page) whose leading tokens match
        the most of `tokens`, and how many match (at least 1); None if no page starts with tokens[0].

        A prefix hit covers whole pages only; this finds the part of the next page another
        sequence already computed (a shared system prompt rarely ends on a page boundary), so
        the caller can copy those tokens' K/V instead of computing them. `parent` must be a
        registered page (the caller's last matched one). Looks at the newest `_PARTIAL_SCAN`
        children (prefix_lookup.py): a bound on the work per admission, not on correctness.
        """
        return find_partial(self._children, self._reg, parent, tokens, salt=salt)

    def take_prefix(self, pages: Sequence[PageId], query_tokens: int, partial_tokens: int = 0) -> None:
        """Reference pages `find_prefix` just returned (nothing changed since), counting one lookup
        of `query_tokens` tokens; `partial_tokens` more were found by `find_partial` (and are copied)."""
        for page in pages:
            self._take(page)
        self._prefix_lookups += 1
        self._prefix_query_tokens += query_tokens
        self._prefix_hit_tokens += len(pages) * self._page_size + partial_tokens

    def _limit(self, token_ids: Sequence[int], max_tokens: int | None) -> int:
        if max_tokens is not None and max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        return len(token_ids) if max_tokens is None else min(len(token_ids), max_tokens)

    def allocate(self, n: int) -> list[PageId] | None:
        """`n` pages for new content (ref 1): FREE first, then evicting CACHED ones LRU first.

        None, taking nothing, if fewer than `n` are available.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self.available():
            return None
        pages: list[PageId] = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._lru.popitem(last=False)
                self._drop_registration(page)
                self._evictions += 1
            self._ref[page] = 1
            pages.append(page)
        return pages

    def register_full(
        self, page: PageId, parent: PageId | None, tokens: Sequence[int], salt: str = ""
    ) -> PageId:
        """Record that the caller's `page` is full with `tokens` on top of its `parent` page (None: first page).

        `salt`: the chain's cache salt; a page only ever dedups onto a page of the same salt,
        and a page on a parent must have the parent's salt.

        If an identical page (same tokens on the same parent) exists, the caller switches
        to it: it gains the caller's reference, the caller's page is released, and its id
        is returned. Otherwise `page` becomes findable and is returned. `parent` must be
        the caller's previous page, already registered (register in table order).
        Registering a page again with the same content (forked holders) returns it as is.
        """
        self._check_page(page)
        if len(tokens) != self._page_size:
            raise ValueError(f"a full page holds {self._page_size} tokens, got {len(tokens)}")
        if self._ref[page] == 0:
            raise ValueError(f"page {page} is not held by anyone; only a held page can be registered")
        page_tokens = tuple(tokens)
        parent_hash = salt_root(salt) if parent is None else None
        parent_serial = ROOT_SERIAL
        if parent is not None:
            self._check_page(parent)
            parent_reg = self._reg.get(parent)
            if parent_reg is None or self._ref[parent] == 0:
                raise ValueError(f"parent page {parent} is not a registered page the caller holds")
            if parent_reg.salt != salt:
                raise ValueError(f"parent page {parent} was registered under another cache salt")
            parent_hash, parent_serial = parent_reg.key.hash, parent_reg.serial
        own = self._reg.get(page)
        if own is not None:
            if own.key.tokens == page_tokens and own.parent_serial == parent_serial and own.salt == salt:
                return page
            raise ValueError(f"page {page} is already registered with other content; unregister it first")
        h = chain_hash(parent_hash, page_tokens)
        owner = self._index.get(h)
        if owner is not None:
            owner_reg = self._reg[owner]
            if (
                owner_reg.key.tokens == page_tokens
                and owner_reg.parent_serial == parent_serial
                and owner_reg.salt == salt
            ):
                self._take(owner)
                self.release([page])
                self._dedup_hits += 1
                return owner
            # Same hash, other content: a collision, or an orphan whose parent registration is
            # gone (it can never be matched again). The newcomer is the one worth finding; a
            # displaced page nobody holds is useless, so it is freed now.
            if self._ref[owner] == 0:
                del self._lru[owner]
                self._drop_registration(owner)
                self._free.append(owner)
        self._reg[page] = Registration(
            PageKey(h, parent_hash, page_tokens), self._next_serial, parent_serial, salt
        )
        self._next_serial += 1
        self._index[h] = page
        self._children.setdefault(parent_serial, OrderedDict())[page] = None
        self._events.append(BlockStored(h, parent_hash, page_tokens, bool(salt)))
        return page

    def release(self, pages: Sequence[PageId]) -> None:
        """Drop one reference to each page (pass a page table in table order).

        A page reaching 0 becomes CACHED if it is findable, else FREE. Pages enter the LRU
        tail first, so a table's last page is evicted first and its first pages (the
        prefix most prompts share) last. Raises, changing nothing, if a page is not held.
        """
        self._check_releasable(pages)
        for page in reversed(pages):
            self._ref[page] -= 1
            if self._ref[page] > 0:
                continue
            reg = self._reg.get(page)
            if reg is not None and self._index.get(reg.key.hash) == page:
                self._lru[page] = None
            else:
                # Unfindable (a displaced collision): caching it would only crowd out findable pages.
                self._drop_registration(page)
                self._free.append(page)

    def hold(self, page: PageId) -> None:
        """One more reference to a page that is held or findable (a CACHED one is revived): keeps
        a page alive while its K/V is copied elsewhere. Undo with `release([page])`."""
        self._check_page(page)
        if self._ref[page] == 0 and page not in self._lru:
            raise ValueError(f"page {page} is free; only a held or cached page can be held")
        self._take(page)

    def retain(self, pages: Sequence[PageId]) -> None:
        """One more reference to each held page: another table now holds them too (fork)."""
        for page in pages:
            if self.ref_count(page) == 0:
                raise ValueError(f"page {page} is not held; only held pages can be shared")
        for page in pages:
            self._ref[page] += 1

    def unregister(self, page: PageId) -> None:
        """Forget a page's hash because its content is about to change (rolled-back tokens).

        Only for a page the caller holds alone (ref 1); a shared page's content belongs to
        its other holders too, so the caller must copy it on write instead. No-op for a page
        with no hash.
        """
        ref = self.ref_count(page)
        if ref != 1:
            raise ValueError(
                f"page {page} has ref count {ref}; only a page held by one table can be changed in place"
            )
        self._drop_registration(page)

    def drop_cached(self) -> int:
        """Forget every findable page no table holds (they become FREE); held pages stay findable.
        Returns how many were dropped."""
        dropped = list(self._lru)
        self._lru.clear()
        for page in dropped:
            self._drop_registration(page)
            self._free.append(page)
        return len(dropped)

    def registered_blocks(self) -> list[BlockStored]:
        """Every findable page as the BlockStored that announced it, parents before children (a
        snapshot for a subscriber that can no longer replay the log)."""
        regs = sorted(
            (reg for page, reg in self._reg.items() if self._index.get(reg.key.hash) == page),
            key=lambda reg: reg.serial,
        )
        return [BlockStored(r.key.hash, r.key.parent_hash, r.key.tokens, bool(r.salt)) for r in regs]

    # -- checking ------------------------------------------------------------------------

    def check_invariants(self, tables: Iterable[Sequence[PageId]], holds: Iterable[PageId] = ()) -> None:
        """Raise AssertionError listing every broken invariant, given all live page tables and the
        pages held outside them (`hold`: a partial prefix's source page, until it is copied)."""
        view = PoolView(
            self._num_pages,
            self._page_size,
            self._ref,
            self._free,
            self._lru,
            self._reg,
            self._index,
            self._children,
        )
        check_pool_invariants(view, tables, holds)

    # -- internals -----------------------------------------------------------------------

    def _check_page(self, page: PageId) -> None:
        if not 0 <= page < self._num_pages:
            raise ValueError(f"page {page} is outside the pool (0..{self._num_pages - 1})")

    def _check_releasable(self, pages: Sequence[PageId]) -> None:
        # Validate everything before changing anything, so a bad call leaves the pool intact.
        for page, count in Counter(pages).items():
            self._check_page(page)
            if self._ref[page] < count:
                raise ValueError(
                    f"page {page} is held {self._ref[page]} times, cannot release it {count} times"
                )

    def _take(self, page: PageId) -> None:
        """A new reference to a findable page; a CACHED one leaves the LRU."""
        if self._ref[page] == 0:
            del self._lru[page]
        self._ref[page] += 1

    def _drop_registration(self, page: PageId) -> None:
        reg = self._reg.pop(page, None)
        if reg is None:
            return
        self._events.append(BlocksRemoved((reg.key.hash,)))
        if self._index.get(reg.key.hash) == page:
            del self._index[reg.key.hash]
        siblings = self._children.get(reg.parent_serial)
        if siblings is not None:
            siblings.pop(page, None)
            if not siblings:
                del self._children[reg.parent_serial]
