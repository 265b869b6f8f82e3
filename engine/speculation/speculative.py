"""Speculative decoding: drafters propose tokens, the target verifies them in one forward.

The generator asks a `Drafter` for up to k tokens per decoding job, runs each job's
last token plus its drafts through the target in the same batched forward as every
other job, and keeps the longest acceptable prefix plus one token of the target's own:

- greedy jobs accept draft i while it equals the target's choice at that position
  (so the output is token-identical to decoding without speculation);
- sampled jobs accept draft i while it equals the token the job samples at that position
  with that position's own uniform (the draw decoding one token at a time makes). Drafts
  are deterministic (q is one-hot), so x is kept with probability p(x), as rejection
  sampling would keep it, and the output is token-identical to decoding without
  speculation for a given seed, not only equal in distribution.

Rejected tokens need no undo in the pages: the generator only advances a job's
`computed` past accepted tokens and registers a page in the prefix index only once
it is full of accepted tokens, so a rejected tail is simply overwritten later.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.cache.kv_cache import PagedKVCache
from engine.errors import InvalidRequestError
from engine.forward_batch import SequenceInput
from engine.ids import PageId
from engine.jobs import JobId
from engine.model.llama import LlamaModel
from engine.runner import ModelRunner
from engine.speculation.speculation_config import DrafterKind, SpeculationConfig
from engine.speculation.suffix_corpus import SuffixCorpus, agreement, match_length, ngram_places

# DrafterKind and SpeculationConfig live in engine/speculation/speculation_config.py (no torch); they are
# exported from here too, beside the drafters they configure.
__all__ = [
    "Draft",
    "DraftModelDrafter",
    "DraftRequest",
    "Drafter",
    "DrafterKind",
    "NgramDrafter",
    "SpeculationConfig",
    "accept_matching",
]


@dataclass(frozen=True)
class DraftRequest:
    """One decoding job asking for drafts: its accepted tokens and its page table."""

    job_id: JobId
    tokens: Sequence[int]
    pages: Sequence[PageId]
    max_tokens: int
    salt: str = ""  # the job's cache salt: drafts from other jobs' outputs come from this salt's only


@dataclass(frozen=True)
class Draft:
    tokens: tuple[int, ...]
    # Per token, a class of the drafter's evidence for it (evidence_class): the draft policy learns
    # how often each class's tokens are kept and verifies a draft only as far as its tokens pay.
    # Empty: no such evidence (the draft model's), the draft is verified as the budget allows.
    evidence: tuple[int, ...] = ()


# Evidence classes of n-gram draft tokens. Measured over the editing trace's proposals (three
# seeds, shipped model), a draft token whose earlier tokens were kept was itself kept 98-100% of
# the time where 4+ places continued its n-gram and all agreed with it, 45% where one of 4+ did
# (the text branches there: a JSON value after its key), 65% with a single place: how many places
# continued the n-gram, how many agree up to the token, and how far back the match reaches tell
# the likely tokens from the guesses.
EVIDENCE_CAP = 4  # places and agreeing places counted up to this
LONG_MATCH = 8  # a match reaching this many tokens back is a long one


def evidence_class(places: int, agree: int, match: int) -> int:
    """The class of a draft token that `agree` of `places` places (>= 1 each) continue as the
    draft does, from a match of `match` tokens."""
    p, a = min(places, EVIDENCE_CAP), min(agree, EVIDENCE_CAP)
    return ((p - 1) * EVIDENCE_CAP + (a - 1)) * 2 + (match >= LONG_MATCH)


class Drafter(Protocol):
    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """Up to each request's max_tokens draft tokens (none when there is no good guess)."""
        ...

    def forget(self, job_id: JobId) -> None:
        """Drop per-job state (finished, cancelled or preempted)."""
        ...

    def rewind(self, job_id: JobId, position: int) -> None:
        """The job's page holding `position` was swapped for an identical one (live dedup): state
        built from the job's cache from that page on must be rebuilt. Its tokens did not change."""
        ...

    def finished(self, salt: str, tokens: Sequence[int], prompt_len: int) -> None:
        """A job of cache salt `salt` finished with `tokens` (prompt, then output): drafts for
        other jobs may copy its output."""
        ...


# Earlier places an n-gram continued that the n-gram drafter keeps (the latest ones), and how far
# back it compares each with the sequence's end to pick the one that matches longest.
NGRAM_CANDIDATES = 8
MATCH_LOOKBACK = 64


class NgramDrafter:
    """Proposes the continuation of the longest earlier match of the sequence's suffix.

    Per job, an index maps every n-gram (n <= max_ngram) of prompt + output to the latest
    NGRAM_CANDIDATES places it continued. The longest n-gram ending the sequence that has any
    picks its candidates; of those, the one whose match extends furthest back (up to
    MATCH_LOOKBACK tokens, the latest on a tie) proposes its continuation. In structured text a
    short n-gram (`",\n    "` in JSON) continues many ways, and the longer match is the one the
    text is copying. A continuation that reaches the sequence's end goes on as the copy would:
    text looping with period d is proposed d tokens, then the same d again. The index grows
    incrementally with each accepted token and is freed with the job; it holds at most
    max_ngram * NGRAM_CANDIDATES positions per token of the job.

    With a corpus (suffix_corpus.py), finished jobs' outputs are matched the same way, and the
    corpus's continuation is proposed where its match reaches further back than the job's own
    (the job's own on a tie): outputs repeat across requests (the same preamble, keys, closing).
    """

    def __init__(self, max_ngram: int, corpus: SuffixCorpus | None = None) -> None:
        self.max_ngram = max_ngram
        self.corpus = corpus
        self._index: dict[JobId, dict[tuple[int, ...], list[int]]] = {}
        self._indexed: dict[JobId, int] = {}  # tokens whose continuation is in the index

    def _update(self, job_id: JobId, tokens: Sequence[int]) -> dict[tuple[int, ...], list[int]]:
        index = self._index.setdefault(job_id, {})
        start = self._indexed.get(job_id, 0)
        if start > len(tokens):  # the job's tokens shrank (cannot happen today): rebuild
            index.clear()
            start = 0
        # An n-gram ending at i is indexed once token i + 1 (its continuation) exists, so the
        # current suffix never matches itself.
        for gram, at in ngram_places(tokens, start, self.max_ngram):
            places = index.setdefault(gram, [])
            places.append(at)
            if len(places) > NGRAM_CANDIDATES:
                del places[0]
        self._indexed[job_id] = max(start, len(tokens) - 1)
        return index

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        drafts = []
        for r in requests:
            index = self._update(r.job_id, r.tokens)
            own: list[int] = []  # the places that continued the longest matching n-gram
            length, at = 0, 0
            for n in range(min(self.max_ngram, len(r.tokens)), 0, -1):
                own = index.get(tuple(r.tokens[-n:]), [])
                if own:
                    length, at = max((match_length(r.tokens, p, r.tokens, n, MATCH_LOOKBACK), p) for p in own)
                    break
            shared = None
            if self.corpus is not None and length < MATCH_LOOKBACK:
                shared = self.corpus.match(r.salt, r.tokens, r.max_tokens)
            if shared is not None and shared.length > length:
                proposal, length, places, agree = shared.tokens, shared.length, shared.places, shared.agree
            elif own:
                proposal, places = _copy(r.tokens, at, r.max_tokens), len(own)
                agree = agreement(proposal, [_copy(r.tokens, p, r.max_tokens) for p in own])
            else:
                proposal, places, agree = (), 1, ()
            drafts.append(Draft(proposal, tuple(evidence_class(places, a, length) for a in agree)))
        return drafts

    def finished(self, salt: str, tokens: Sequence[int], prompt_len: int) -> None:
        if self.corpus is not None:
            self.corpus.add_output(salt, tokens, prompt_len)

    def forget(self, job_id: JobId) -> None:
        self._index.pop(job_id, None)
        self._indexed.pop(job_id, None)

    def rewind(self, job_id: JobId, position: int) -> None:
        pass  # the index is built from tokens alone

    def tracked_jobs(self) -> int:
        return len(self._index)


def _copy(tokens: Sequence[int], at: int, count: int) -> tuple[int, ...]:
    """`count` tokens copied from `at` on: past the sequence's end the copy reads its own proposal,
    so a text repeating itself is proposed for its whole period cycle after cycle, not cut at the
    sequence's end."""
    head = tuple(tokens[at : at + count])  # one period, if shorter
    return (head * -(-count // len(head)))[:count]


class DraftModelDrafter:
    """A cheaper model of the same vocabulary proposes tokens greedily.

    Greedy proposals are deterministic, like n-gram drafts: a sampled job keeps one while it
    matches its own draw at that position, so its tokens stay exactly its own.

    Its KV cache has the target's page geometry and is addressed through the target's
    page tables, so prefix sharing, cancel and preemption need nothing extra: a page a
    job holds is the same page id in both caches. Per job it tracks how many tokens its
    own cache holds and catches up (a batched prefill) before proposing; a new or
    re-admitted job starts from 0 (its prefix hits' draft K/V are recomputed), and a page
    swapped by live dedup rewinds it to that page.
    """

    def __init__(self, model: LlamaModel, target_vocab: int, num_pages: int, page_size: int) -> None:
        if model.config.vocab_size != target_vocab:
            raise InvalidRequestError(
                f"the draft model's vocabulary ({model.config.vocab_size}) differs from the target's ({target_vocab})"
            )
        self.model = model
        self.cache: PagedKVCache = model.new_cache(num_pages, page_size)
        self.runner = ModelRunner(model, self.cache)
        self._computed: dict[JobId, int] = {}

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        if not requests:
            return []
        # Catch up on every accepted token but the last; the last one starts the proposal steps.
        inputs = []
        for r in requests:
            done = min(self._computed.get(r.job_id, 0), len(r.tokens) - 1)
            inputs.append(SequenceInput(r.tokens[done:], done, r.pages))
        logits = self.runner.run(inputs).logits
        proposals: list[list[int]] = [[int(t)] for t in logits.argmax(dim=-1).tolist()]
        positions = [len(r.tokens) for r in requests]
        for step in range(1, max(r.max_tokens for r in requests)):
            live = [i for i, r in enumerate(requests) if step < r.max_tokens]
            if not live:
                break
            step_logits = self.runner.run(
                [SequenceInput([proposals[i][-1]], positions[i] + step - 1, requests[i].pages) for i in live]
            ).logits
            for row, i in enumerate(live):
                proposals[i].append(int(step_logits[row].argmax()))
        for r in requests:
            # Its cache now holds every accepted token; K/V of the proposals past them may be
            # rejected, so the next call recomputes from here (accepted ones included).
            self._computed[r.job_id] = len(r.tokens)
        return [Draft(tuple(p[: r.max_tokens])) for p, r in zip(proposals, requests, strict=True)]

    def forget(self, job_id: JobId) -> None:
        self._computed.pop(job_id, None)

    def finished(self, salt: str, tokens: Sequence[int], prompt_len: int) -> None:
        pass  # a draft model drafts from its own weights

    def rewind(self, job_id: JobId, position: int) -> None:
        # The swapped-in page's draft K/V was written by whichever job's drafter ran over it, if any
        # did (its owner may not speculate), so recompute it.
        done = self._computed.get(job_id)
        if done is not None and done > position:
            self._computed[job_id] = position


def accept_matching(target_choice: Sequence[int], draft: Sequence[int]) -> int:
    """How many draft tokens match the target's own choices (its argmax, or its draw with each
    position's uniform), in order."""
    n = 0
    while n < len(draft) and draft[n] == target_choice[n]:
        n += 1
    return n
