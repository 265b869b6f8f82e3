"""Recent outputs of finished jobs, indexed by n-gram, for the n-gram drafter's drafts of other jobs.

A model's outputs repeat across requests as well as within one: the same preamble, the same JSON
keys, the same closing text, the same answer to a question asked twice. The corpus keeps the most
recent `capacity` tokens of finished outputs (each with a few prompt tokens before it, so that its
first tokens can be matched too) and maps every n-gram (n <= max_ngram) to the latest
`candidates` places it continued. Jobs see only outputs of their own cache salt: the prefix cache's
isolation (one salt per tenant, say) holds for drafts too, so no tenant's speed tells it what
another tenant's jobs wrote.

Eviction is first in, first out by output; an evicted output's places leave the index with it, so
memory stays bounded by capacity * max_ngram places however long the server runs. A finished
output waits in a queue (bounded the same) and is indexed when a draft next asks, ABSORB_TOKENS at a
time: 64 jobs finishing in one step would otherwise stall that step for their whole indexing, and
a server too busy to draft never pays for it at all.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

Key = tuple[str, tuple[int, ...]]  # (cache salt, n-gram)
PROMPT_CONTEXT = 8  # prompt tokens kept before an output, so that its first tokens can be matched
ABSORB_TOKENS = 256  # queued output tokens indexed per match asked (at least one output)


def ngram_places(tokens: Sequence[int], start: int, max_ngram: int) -> list[tuple[tuple[int, ...], int]]:
    """Every n-gram (n <= max_ngram) ending at a position i >= start that has a continuation, with
    the continuation's position i + 1 (the n-gram drafter's index and the corpus's alike). By n,
    then i: each n-gram's places come in order. Slices of one tuple of the tokens it reads, with
    no per-position bound: a job's index update is on every decode step's path."""
    lo = max(start - max_ngram + 1, 0)
    t = tuple(tokens[lo:])
    out: list[tuple[tuple[int, ...], int]] = []
    for n in range(1, max_ngram + 1):
        first = max(start, n - 1) - lo
        out.extend((t[i - n + 1 : i + 1], lo + i + 1) for i in range(first, len(t) - 1))
    return out


def match_length(source: Sequence[int], at: int, tokens: Sequence[int], known: int, lookback: int) -> int:
    """How many tokens of `source` before position `at` equal the last ones of `tokens` (the first
    `known` are known to), up to `lookback`: a binary search of slice comparisons, each a C loop
    (a copied span matches the whole lookback, which a token-by-token walk took 64 steps of
    Python for, per candidate place and draft)."""
    end = len(tokens)
    lo, hi = known, max(min(lookback, at, end), known)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tuple(source[at - mid : at - lo]) == tuple(tokens[end - mid : end - lo]):  # a list or a tuple
            lo = mid
        else:
            hi = mid - 1
    return lo


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share (a binary search of slice comparisons, each a C
    loop: drafts agree with their candidates for most of their length)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def agreement(proposal: Sequence[int], continuations: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """For each position i of `proposal`, how many `continuations` (the proposal's own among them)
    begin with its first i + 1 tokens: where places that continued the same n-gram part ways, the
    text branches, and a draft past that point is a guess between them."""
    n = len(proposal)
    ends = [0] * (n + 1)  # ends[l]: continuations sharing exactly l leading tokens with the proposal
    for c in continuations:
        ends[common_prefix(proposal, tuple(c[:n]))] += 1
    out, alive = [0] * n, 0
    for i in range(n - 1, -1, -1):
        alive += ends[i + 1]
        out[i] = alive
    return tuple(out)


@dataclass(frozen=True)
class CorpusMatch:
    """An earlier output continuing the sequence's end: how many tokens before the continuation
    match the sequence's last ones (up to the lookback), the continuation, how many places continued
    the matched n-gram, and how many of them agree with the continuation at each of its tokens."""

    length: int
    tokens: tuple[int, ...]
    places: int = 1
    agree: tuple[int, ...] = ()


class SuffixCorpus:
    def __init__(self, max_ngram: int, capacity: int, candidates: int, lookback: int) -> None:
        self.max_ngram = max_ngram
        self.capacity = capacity
        self.candidates = candidates
        self.lookback = lookback
        self._docs: dict[int, tuple[str, tuple[int, ...]]] = {}  # serial -> (salt, tokens), oldest first
        self._next = 0
        self._size = 0
        self._index: dict[Key, list[tuple[int, int]]] = {}  # -> [(serial, continuation's position)]
        self._queue: deque[tuple[str, tuple[int, ...]]] = deque()  # outputs not indexed yet
        self._queued = 0

    @property
    def tokens(self) -> int:
        """Tokens indexed (queued ones not counted)."""
        return self._size

    @property
    def queued_tokens(self) -> int:
        return self._queued

    def places(self) -> int:
        return sum(len(p) for p in self._index.values())

    def add_output(self, salt: str, tokens: Sequence[int], prompt_len: int) -> None:
        """A finished job's tokens (prompt, then output): its output, with the last PROMPT_CONTEXT
        prompt tokens before it, for other jobs of `salt` to copy."""
        if len(tokens) > prompt_len:
            self.add(salt, tokens[max(prompt_len - PROMPT_CONTEXT, 0) :])

    def add(self, salt: str, tokens: Sequence[int]) -> None:
        """Tokens that other jobs of `salt` may copy (queued; indexed by `absorb`)."""
        doc = tuple(tokens[-self.capacity :])
        if len(doc) < 2:
            return
        self._queue.append((salt, doc))
        self._queued += len(doc)
        while self._queued > self.capacity:  # older than anything the index would keep
            self._queued -= len(self._queue.popleft()[1])

    def absorb(self, budget: int | None = None) -> None:
        """Index queued outputs, oldest first: all of them, or at least one and about `budget` tokens."""
        while self._queue and (budget is None or budget > 0):
            salt, doc = self._queue.popleft()
            self._queued -= len(doc)
            self._index_doc(salt, doc)
            if budget is not None:
                budget -= len(doc)

    def _index_doc(self, salt: str, doc: tuple[int, ...]) -> None:
        serial, self._next = self._next, self._next + 1
        self._docs[serial] = (salt, doc)
        self._size += len(doc)
        for gram, at in ngram_places(doc, 0, self.max_ngram):
            places = self._index.setdefault((salt, gram), [])
            places.append((serial, at))
            if len(places) > self.candidates:
                del places[0]
        while self._size > self.capacity:
            self._evict(next(iter(self._docs)))

    def _evict(self, serial: int) -> None:
        salt, doc = self._docs.pop(serial)
        self._size -= len(doc)
        for gram, _ in ngram_places(doc, 0, self.max_ngram):
            key = (salt, gram)
            places = self._index.get(key)
            if places is None:
                continue
            kept = [p for p in places if p[0] != serial]
            if kept:
                self._index[key] = kept
            else:
                del self._index[key]

    def match(self, salt: str, tokens: Sequence[int], max_tokens: int) -> CorpusMatch | None:
        """The continuation of the longest n-gram ending `tokens` that an output of `salt` has;
        of its places, the one whose match reaches furthest back (the latest on a tie)."""
        self.absorb(ABSORB_TOKENS)
        for n in range(min(self.max_ngram, len(tokens)), 0, -1):
            places = self._index.get((salt, tuple(tokens[-n:])))
            if not places:
                continue
            best: tuple[int, int, int] | None = None  # (match length, serial, position)
            for serial, at in places:
                length = match_length(self._docs[serial][1], at, tokens, n, self.lookback)
                if best is None or (length, serial) >= best[:2]:
                    best = (length, serial, at)
            assert best is not None
            length, serial, at = best
            tokens = self._docs[serial][1][at : at + max_tokens]
            others = [self._docs[s][1][a : a + max_tokens] for s, a in places]
            return CorpusMatch(length, tokens, len(places), agreement(tokens, others))
        return None
