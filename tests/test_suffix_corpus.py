"""The n-gram drafter's corpus of finished outputs (engine/speculation/suffix_corpus.py): matches
across jobs, isolation by cache salt, a bound that holds however long the server runs."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.ids import PageId
from engine.jobs import JobId
from engine.speculation.speculative import DraftRequest, NgramDrafter
from engine.speculation.suffix_corpus import (
    PROMPT_CONTEXT,
    SuffixCorpus,
    agreement,
    common_prefix,
    match_length,
)


def corpus(capacity: int = 1000) -> SuffixCorpus:
    return SuffixCorpus(max_ngram=4, capacity=capacity, candidates=8, lookback=64)


def test_another_jobs_output_continues_the_sequence() -> None:
    c = corpus()
    c.add("", [1, 2, 3, 4, 5, 6, 7, 8])
    m = c.match("", [40, 41, 3, 4], max_tokens=3)
    assert m is not None and m.tokens == (5, 6, 7) and m.length == 2
    assert c.match("", [40, 41, 42], max_tokens=3) is None


def test_a_match_counts_the_places_that_agree_with_it_at_each_token() -> None:
    c = corpus()
    c.add("", [1, 2, 7])
    c.add("", [1, 2, 3, 4, 5])
    c.add("", [1, 2, 3, 4, 6])
    m = c.match("", [0, 2], max_tokens=3)  # "2" continued three times: "7", "3 4 5", "3 4 6"
    assert m is not None and m.places == 3
    assert m.tokens == (3, 4, 6)  # the latest of the two longest matches ("2"), on a tie
    assert m.agree == (2, 2, 1)


@given(
    st.lists(st.integers(0, 3), max_size=12), st.lists(st.lists(st.integers(0, 3), max_size=12), max_size=6)
)
def test_agreement_counts_continuations_sharing_each_prefix(
    proposal: list[int], others: list[list[int]]
) -> None:
    got = agreement(tuple(proposal), others)
    want = tuple(sum(1 for o in others if o[: i + 1] == proposal[: i + 1]) for i in range(len(proposal)))
    assert got == want
    for o in others:
        n = common_prefix(tuple(proposal), tuple(o))
        assert proposal[:n] == o[:n] and (n == min(len(proposal), len(o)) or proposal[n] != o[n])


@given(
    st.lists(st.integers(0, 2), max_size=40),
    st.lists(st.integers(0, 2), min_size=1, max_size=40),
    st.data(),
)
def test_match_length_counts_the_tokens_before_a_place_that_end_the_sequence(
    source: list[int], tokens: list[int], data: st.DataObject
) -> None:
    at = data.draw(st.integers(0, len(source)))
    lookback = data.draw(st.integers(0, 50))
    # The longest n with source[at - n : at] == tokens[-n:], by definition, up to the lookback.
    most = max(n for n in range(min(at, len(tokens)) + 1) if n == 0 or source[at - n : at] == tokens[-n:])
    known = data.draw(st.integers(0, most))
    want = max(known, min(most, lookback))
    # A tuple source (the corpus's outputs) against a list sequence (a job's tokens) as well.
    assert match_length(source, at, tokens, known, lookback) == want
    assert match_length(tuple(source), at, tokens, known, lookback) == want


def test_the_place_matching_furthest_back_wins() -> None:
    c = corpus()
    c.add("", [9, 9, 1, 2, 3, 100])
    c.add("", [7, 1, 2, 3, 200])  # later, but matches only "1 2 3"
    m = c.match("", [5, 9, 1, 2, 3], max_tokens=1)
    assert m is not None and m.tokens == (100,) and m.length == 4
    m = c.match("", [5, 8, 1, 2, 3], max_tokens=1)  # a tie: the latest
    assert m is not None and m.tokens == (200,)


def test_outputs_are_seen_only_by_jobs_of_their_salt() -> None:
    c = corpus()
    c.add("tenant-a", [1, 2, 3, 4])
    assert c.match("tenant-b", [1, 2], max_tokens=2) is None
    assert c.match("", [1, 2], max_tokens=2) is None
    m = c.match("tenant-a", [1, 2], max_tokens=2)
    assert m is not None and m.tokens == (3, 4)


def test_an_output_is_kept_with_a_little_of_its_prompt() -> None:
    c = corpus()
    prompt = list(range(100, 120))
    c.add_output("", [*prompt, 1, 2, 3], prompt_len=len(prompt))
    c.absorb()
    assert c.tokens == PROMPT_CONTEXT + 3
    m = c.match("", [55, *prompt[-2:]], max_tokens=2)  # the output's start, from the prompt's end
    assert m is not None and m.tokens == (1, 2)
    c.add_output("", prompt, prompt_len=len(prompt))  # no output: nothing to keep
    assert c.queued_tokens == 0


def test_finished_outputs_are_indexed_a_few_at_a_time_when_drafts_ask() -> None:
    c = corpus()
    for i in range(10):
        c.add("", list(range(i * 1000, i * 1000 + 100)))
    assert c.tokens == 0 and c.queued_tokens == 1000  # finishing costs the step no indexing
    c.match("", [5], max_tokens=1)
    assert 0 < c.tokens < 1000 and c.tokens + c.queued_tokens == 1000


def test_old_outputs_leave_with_their_places() -> None:
    c = corpus(capacity=100)
    for i in range(50):
        c.add("", [1000 + i, *range(i * 10, i * 10 + 39)])
        if i % 7 == 0:
            c.absorb()
    assert c.queued_tokens <= 100
    c.absorb()
    assert c.tokens <= 100
    assert c.places() <= 100 * 4
    assert c.match("", [1000, 0], max_tokens=1) is None  # the first output is gone
    m = c.match("", [1049, 490], max_tokens=2)
    assert m is not None and m.tokens == (491, 492)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=30), max_size=12), st.integers(10, 80))
def test_the_index_holds_exactly_the_live_outputs(docs: list[list[int]], capacity: int) -> None:
    c = corpus(capacity)
    for d in docs:
        c.add("", d)
        c.absorb(budget=capacity // 3)
    c.absorb()
    assert c.tokens <= capacity and c.queued_tokens == 0
    # Every place names a live output, at a continuation of its n-gram.
    for (_, gram), places in c._index.items():
        assert places
        for serial, at in places:
            _, doc = c._docs[serial]
            assert 0 < at < len(doc) and doc[at - len(gram) : at] == gram


def _request(job: str, tokens: list[int], salt: str = "") -> DraftRequest:
    return DraftRequest(JobId(job), tokens, [PageId(0)], 4, salt)


def test_the_drafter_copies_another_jobs_output_where_its_own_tokens_do_not_continue() -> None:
    drafter = NgramDrafter(4, corpus())
    drafter.finished("", [50, 51, 1, 2, 3, 4, 5, 6, 7], prompt_len=2)
    (draft,) = drafter.propose([_request("j", [60, 61, 2, 3])])
    assert draft.tokens == (4, 5, 6, 7)
    # The job's own earlier text matching as far back wins a tie.
    (draft,) = drafter.propose([_request("k", [2, 3, 9, 9, 9, 2, 3])])
    assert draft.tokens == (9, 9, 9, 2)
    # Without a corpus, only the job's own tokens.
    (draft,) = NgramDrafter(4).propose([_request("j", [60, 61, 2, 3])])
    assert draft.tokens == ()
