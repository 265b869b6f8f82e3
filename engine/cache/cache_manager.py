"""CacheManager: where each sequence's K/V lives. The one writer of a sequence's page table and
its prefix-cache state (`pages`, `registered`, `page_hashes`, `inflight`, `prefix_copy`), and
the only caller of the page pool's writes; the scheduler decides who runs and asks it for room.

Pages are taken on demand: a sequence gets pages for its prompt when admitted (`admit`) and more
as its output grows (`grow`), never its whole max_new_tokens budget up front. Freed pages go back
to the pool (`free`), full ones still findable, so a preempted sequence's recompute is mostly a
prefix hit.

Prefix hits: at admission, the sequence's leading full pages found in the pool are shared
(everything but the last token may come from the cache: its logits are needed). Past its
whole-page hits, a sequence copies the K/V of as many leading tokens of its next page as some
other page on the same prefix already holds (a registered page, or the page a running sequence is
filling) instead of computing them: 32 prompts that share 1019 tokens on pages of 64 then each
compute 12 tokens, not 71. A filled page is registered (`commit`), or swapped for an identical
registered one.

Shared prefixes arriving together: a waiting sequence whose next prompt page is being computed
right now by an admitted one waits (`awaits_inflight`) until that page is registered, then takes
it as a hit. So 32 jobs with one long system prompt compute it once, not 32 times. (Only
sequences of the same salt share: the salt is part of every hash.)

A waiting sequence's page hashes are computed once and kept on it, and a try that does not fit
takes nothing and counts no prefix lookup: a job waiting for room costs dict lookups per step,
and the hit-rate stats count one lookup per admission.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from engine.cache.kv_events import BlockStored, KvEvent
from engine.cache.pages import PagePool
from engine.cache.prefix_hash import common_prefix_len, extend_chain
from engine.ids import PageId
from engine.sequence import PrefixCopy, SequenceState

CopyPrefix = Callable[[PageId, PageId, int], None]  # (source, target, tokens): the cache's K/V copy


KEEP_COMPUTED = 2  # a sequence's last tokens computed at admission whatever the prefix cache holds


class CacheManager:
    def __init__(self, pool: PagePool, prefix_cache: bool = True) -> None:
        self.pool = pool
        self.prefix_cache = prefix_cache  # off: every sequence computes its whole prompt
        # Sequences holding pages, in admission order (a partial prefix may come from their pages).
        self._holders: dict[SequenceState, None] = {}
        # Chain hash of a full prompt page -> the admitted sequence computing it. An entry leaves when
        # its page is registered or its sequence lets its pages go, so this holds at most the
        # admitted sequences' uncomputed prompt pages.
        self._inflight: dict[int, SequenceState] = {}

    # -- reads -----------------------------------------------------------------------------------

    def inflight_pages(self) -> int:
        """Prompt pages admitted sequences are computing that waiting ones may wait for."""
        return len(self._inflight)

    def events(self, since: int) -> list[tuple[int, KvEvent]] | None:
        """The prefix cache's KV events numbered `since` and after (engine/cache/kv_events.py): pages
        that became findable or stopped being so; None if the log no longer holds them all."""
        return self.pool.kv_events(since)

    def events_next(self) -> int:
        """The number the next KV event will get."""
        return self.pool.kv_events_next()

    def snapshot(self) -> list[BlockStored]:
        """Every findable page as its BlockStored, parents first: the state `events` builds up, for a
        reader that fell too far behind to replay it."""
        return self.pool.registered_blocks()

    def holders(self) -> Iterator[SequenceState]:
        return iter(self._holders)

    def holds(self) -> list[PageId]:
        """Pages held for a prefix copy not yet made (the pool's invariants count them)."""
        return [s.prefix_copy.source for s in self._holders if s.prefix_copy is not None]

    def spare(self) -> int:
        """Pages an admission may take: the pool's available ones less one per holder, so the
        sequences already running can grow without a preemption at once."""
        return self.pool.available() - len(self._holders)

    def awaits_inflight(self, seq: SequenceState) -> bool:
        """Whether an admitted sequence is computing a page this one could otherwise take from the cache."""
        if not self.prefix_cache:
            return False
        ps = self.pool.page_size
        for i, h in enumerate(self._full_page_hashes(seq)):
            owner = self._inflight.get(h)
            if owner is None:
                continue
            if owner in self._holders and owner.registered <= i and owner.computed < (i + 1) * ps:
                return True
        return False

    def hits(self, seq: SequenceState) -> int:
        """Leading tokens of a waiting sequence its admission would now find cached (whole pages; it
        may copy part of one more), taking nothing and counting no lookup."""
        if not self.prefix_cache:
            return 0
        query = max(len(seq.tokens) - KEEP_COMPUTED, 0)
        found = self.pool.find_prefix(
            seq.tokens, query, salt=seq.prefix_salt, hashes=self._full_page_hashes(seq)
        )
        return len(found) * self.pool.page_size

    # -- writes ----------------------------------------------------------------------------------

    def admit(self, seq: SequenceState) -> int | None:
        """Give `seq` pages for all its tokens, prefix hits first, if they fit the spare pages; the
        number of leading tokens its pages already hold (whole-page hits plus a partial copy), or
        None, taking nothing and counting no lookup, if they do not fit."""
        ps = self.pool.page_size
        # Everything but the last two tokens may come from the prefix cache: the last one's logits are
        # needed, and a lone token runs as a decode step. The native attention gives a token the same
        # numbers either way; torch's (bfloat16 models, builds without the native kernels) does not, and
        # two tokens keep a prompt's end in the chunk path a cold start ran it through (a hit must not
        # change the tokens). A preempted sequence recomputes prompt + output; its old full pages are
        # likely cached.
        query = max(len(seq.tokens) - KEEP_COMPUTED, 0)
        hashes = self._full_page_hashes(seq) if self.prefix_cache else []
        total = seq.pages_for(len(seq.tokens), ps)
        room = self.spare()
        if total - len(hashes) > room:
            return None  # even a hit on every full page would leave too many to allocate
        matched = (
            self.pool.find_prefix(seq.tokens, query, salt=seq.prefix_salt, hashes=hashes)
            if self.prefix_cache
            else []
        )
        need = total - len(matched)
        donor = self._partial_donor(seq, matched) if self.prefix_cache else None
        revived = sum(1 for p in matched if self.pool.ref_count(p) == 0)  # CACHED pages leave the LRU
        if donor is not None and self.pool.ref_count(donor[0]) == 0:
            revived += 1
        if need > room - revived:
            return None
        if self.prefix_cache:
            self.pool.take_prefix(matched, query, donor[1] if donor else 0)
        if donor is not None:
            self.pool.hold(donor[0])  # before allocating: it must not be evicted for our own pages
        fresh = self.pool.allocate(need)
        assert fresh is not None, "the pages were counted as available"
        seq.pages = matched + fresh
        seq.registered = len(matched)
        held = len(matched) * ps
        if donor is not None:
            seq.prefix_copy = PrefixCopy(donor[0], fresh[0], donor[1])
            held += donor[1]
        if self.prefix_cache:
            for i, h in enumerate(self._full_page_hashes(seq)[len(matched) :], start=len(matched)):
                if self._inflight.setdefault(h, seq) is seq:
                    seq.inflight.append((i, h))
        self._holders[seq] = None
        return held

    def grow(self, seq: SequenceState, total_tokens: int) -> bool:
        """Make `seq` hold pages for `total_tokens`; False, taking nothing, if the pool is dry."""
        need = seq.pages_for(total_tokens, self.pool.page_size) - len(seq.pages)
        if need <= 0:
            return True
        got = self.pool.allocate(need)
        if got is None:
            return False
        seq.pages.extend(got)
        return True

    def begin(self, seq: SequenceState, copy_prefix: CopyPrefix) -> None:
        """Before `seq`'s first scheduled chunk runs: the partial prefix hit found at admission is
        copied and its source page let go; in-flight entries of pages registered since are dropped."""
        if seq.prefix_copy is not None:
            copy, seq.prefix_copy = seq.prefix_copy, None
            try:
                copy_prefix(copy.source, copy.target, copy.tokens)
            finally:
                self.pool.release([copy.source])

    def settle(self, seq: SequenceState) -> None:
        """Drop `seq`'s in-flight entries for pages it has registered (waiting sequences take them
        from the pool now)."""
        if seq.inflight and seq.inflight[0][0] < seq.registered:
            self._forget_inflight(seq, seq.registered)

    def commit(self, seq: SequenceState) -> list[int]:
        """`seq`'s K/V now hold its first `seq.computed` tokens: every newly filled page becomes
        findable, or is swapped for an identical registered page. Returns the token positions where
        a page was swapped (a drafter keyed by pages rewinds there)."""
        ps = self.pool.page_size
        swapped: list[int] = []
        if not self.prefix_cache:
            return swapped
        while (seq.registered + 1) * ps <= seq.computed:
            i = seq.registered
            parent = seq.pages[i - 1] if i > 0 else None
            page = self.pool.register_full(
                seq.pages[i], parent, seq.tokens[i * ps : (i + 1) * ps], seq.prefix_salt
            )
            if page != seq.pages[i]:
                swapped.append(i * ps)
            seq.pages[i] = page
            seq.registered += 1
        return swapped

    def truncate(self, seq: SequenceState, keep: int, copy_prefix: CopyPrefix) -> bool:
        """Make `seq`'s pages writable past its first `keep` tokens. Pages registered in the pool are
        read-only: one the sequence holds alone is unregistered, a shared one is copied (the kept
        slots) into a fresh page. False if there is no page to copy into: the caller preempts it."""
        ps = self.pool.page_size
        first = keep // ps
        kept = True
        for i in range(first, seq.registered):
            page = seq.pages[i]
            if self.pool.ref_count(page) == 1:
                self.pool.unregister(page)
                continue
            fresh = self.pool.allocate(1)
            if fresh is None:
                kept = False
                break
            if i == first and keep % ps:
                copy_prefix(page, fresh[0], keep % ps)
            self.pool.release([page])
            seq.pages[i] = fresh[0]
        seq.registered = min(seq.registered, first)
        del seq.page_hashes[first:]
        return kept

    def free(self, seq: SequenceState) -> None:
        """Give back every page `seq` holds (full ones stay findable) and its prefix-copy hold."""
        if seq.prefix_copy is not None:  # admitted but never staged: drop the hold on the source
            self.pool.release([seq.prefix_copy.source])
            seq.prefix_copy = None
        if seq.inflight:
            self._forget_inflight(seq)
        self._holders.pop(seq, None)
        pages, seq.pages = seq.pages, []
        seq.registered = 0
        if pages:
            self.pool.release(pages)

    def flush(self) -> int:
        """Drop every findable page no sequence holds (FlushCache); held pages stay, so nothing
        running loses its K/V. Returns how many were dropped (each leaves as a BlocksRemoved)."""
        return self.pool.drop_cached()

    # -- helpers ---------------------------------------------------------------------------------

    def _full_page_hashes(self, seq: SequenceState) -> list[int]:
        """Chain hashes of the sequence's full pages that a prefix match may cover (all but the last
        token). Kept on the sequence and only extended: one waiting for room is not re-hashed each step."""
        ps = self.pool.page_size
        extend_chain(seq.page_hashes, seq.tokens, ps, seq.prefix_salt, (len(seq.tokens) - 1) // ps)
        return seq.page_hashes

    def _forget_inflight(self, seq: SequenceState, below: int | None = None) -> None:
        """Drop the sequence's in-flight entries for pages before `below` (None: all of them)."""
        keep = []
        for i, h in seq.inflight:
            if below is not None and i >= below:
                keep.append((i, h))
            elif self._inflight.get(h) is seq:
                del self._inflight[h]
        seq.inflight = keep

    def _partial_donor(self, seq: SequenceState, matched: list[PageId]) -> tuple[PageId, int] | None:
        """The page holding the most of `seq`'s tokens after its whole-page hits `matched`, computed
        on the very same pages before them, and how many; None if none holds even one."""
        ps = self.pool.page_size
        k = len(matched)
        start = k * ps
        # The last tokens always run (see admit).
        want = seq.tokens[start : min(start + ps, len(seq.tokens) - KEEP_COMPUTED)]
        if not want:
            return None
        salt = seq.prefix_salt
        best = self.pool.find_partial(matched[-1] if matched else None, want, salt=salt)
        # An admitted sequence's page k is not registered until full, but its computed tokens are usable.
        for other in self._holders:
            if (
                other.registered != k
                or len(other.pages) <= k
                or other.prefix_salt != salt
                or other.pages[:k] != matched
            ):
                continue
            have = min(other.computed - start, ps)
            if have <= 0:
                continue
            n = common_prefix_len(other.tokens[start : start + have], want)
            if n and (best is None or n > best[1]):
                best = (other.pages[k], n)
        return best
