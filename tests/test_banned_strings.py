"""Banned strings: text that may become one is held back, a completed one rewinds generation.

The text stream on its own (a property over random texts and bans, checked against a plain
decode of the tokens kept), then the generator on the shipped model: greedy outputs that
would contain a banned string never stream any part of it, the rest goes on, pages shared
with another job are copied rather than written, and jobs beside a banned one are untouched.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import InvalidRequestError
from engine.generator import DynamicGenerator, GeneratorConfig
from engine.grammar.constraints import GrammarKind, ResponseFormat
from engine.job_state import JobState
from engine.jobs import JobFinished, JobId, JobSpec, SamplingSettings, StopReason, TokensGenerated
from engine.model.loader import LoadedModel
from engine.model.tokenizer import ChatMessage, Tokenizer
from engine.output.text_stream import TextStream
from engine.scheduler import SchedulerConfig
from tests.job_events import JobRun, run_jobs

pytestmark = pytest.mark.slow

_ALPHABET = "ab c.\né"


@pytest.fixture(scope="module")
def real(smollm: LoadedModel) -> Tokenizer:
    return smollm.tokenizer


def _simulate(tok: Tokenizer, candidates: list[int], bans: list[str], stops: list[str]) -> None:
    """Feed `candidates` as a model would, rewinding at each banned match (the candidate that
    started it is dropped, as a ban would) and check what was streamed against the kept tokens."""
    stream = TextStream(tok, stops, True, bans)
    kept: list[int] = []
    streamed: list[str] = []
    released = 0
    stopped = None
    for token in candidates:
        delta = stream.push([token])
        kept.append(token)
        streamed.append(delta.text)
        released += delta.released
        if delta.banned is not None:
            assert delta.released == 0 or delta.text
            first_held = len(kept) - stream.held
            assert first_held <= delta.banned.token < len(kept)
            stream.rewind(delta.banned.token)
            del kept[delta.banned.token :]
            assert stream.held == len(kept) - released
            continue
        assert stream.held == len(kept) - released
        if delta.stop_string is not None:
            stopped = delta.stop_string
            kept = kept[:released]
            break
    if stopped is None:
        streamed.append(stream.finish())
        released += stream.held  # finish releases every held token
        # Text held for a possible banned string meets the stop strings only at finish.
        stopped = stream.finish_stop
    text = "".join(streamed)
    for ban in bans:
        assert ban not in text
    if stopped is None:
        full = tok.decode(kept, skip_special_tokens=True)
        # Only at finish can a ban be met without a rewind: in a trailing U+FFFD that no later
        # token can complete (the stream cuts it there).
        at = min((full.find(b) for b in bans if b in full), default=len(full))
        assert at == len(full) or "\ufffd" in full[at:]
        assert text == full[:at]
    else:
        full = tok.decode(kept, skip_special_tokens=True)
        assert full.startswith(text) and stopped in full


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet=_ALPHABET, min_size=1, max_size=60),
    bans=st.lists(st.text(alphabet=_ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
    stop=st.booleans(),
)
def test_streamed_text_never_holds_a_banned_string(
    real: Tokenizer, text: str, bans: list[str], stop: bool
) -> None:
    candidates = real.encode(text, add_special_tokens=False)
    _simulate(real, candidates, bans, ["c."] if stop else [])


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 49151), min_size=1, max_size=30), ban_len=st.integers(1, 3))
def test_random_tokens_and_bans_cut_from_them(real: Tokenizer, ids: list[int], ban_len: int) -> None:
    text = real.decode(ids, skip_special_tokens=True)
    bans = [text[i : i + ban_len] for i in range(0, len(text), 7) if text[i : i + ban_len].strip()][:3]
    if bans:
        _simulate(real, ids, bans, [])


def test_held_tokens_are_released_when_the_candidate_fails(real: Tokenizer) -> None:
    stream = TextStream(real, (), True, ["Paris."])
    head = real.encode("Go to", add_special_tokens=False)
    assert stream.push(head).released == len(head)
    par = real.encode(" Paris", add_special_tokens=False)
    d = stream.push(par)
    assert (d.text, d.released, stream.held) == ("", 0, len(par))
    d = stream.push(real.encode(" now", add_special_tokens=False))
    assert d.text == " Paris now" and stream.held == 0 and d.released == len(par) + 1


def test_rewind_restores_the_stream(real: Tokenizer) -> None:
    stream = TextStream(real, (), True, ["ab"])
    a = real.encode("a", add_special_tokens=False)
    b = real.encode("b", add_special_tokens=False)
    assert stream.push(a).released == 0
    d = stream.push(b)
    assert d.banned is not None and d.banned.token == 0 and d.banned.string == "ab"
    with pytest.raises(RuntimeError):
        stream.push(b)
    stream.rewind(0)
    assert stream.push(b).text == "b"
    with pytest.raises(ValueError):
        stream.rewind(0)  # released: it can no longer be taken back
    assert stream.finish() == ""


# -- the generator, on the shipped model ----------------------------------------------------------


def _prompt(model: LoadedModel, question: str) -> tuple[int, ...]:
    return tuple(model.tokenizer.encode_chat([ChatMessage("user", question)]))


def _run(gen: DynamicGenerator, specs: list[JobSpec]) -> list[JobRun]:
    """Run jobs together and keep each one's events."""
    return run_jobs(gen, specs, check_pool=True)


def _text(deltas: list[TokensGenerated], fin: JobFinished) -> str:
    return "".join(d.text for d in deltas) + fin.text


@pytest.fixture(scope="module")
def gen(smollm: LoadedModel) -> DynamicGenerator:
    return DynamicGenerator(smollm.model, smollm.tokenizer, GeneratorConfig(64, 64))


def test_greedy_output_never_streams_the_banned_string(smollm: LoadedModel, gen: DynamicGenerator) -> None:
    prompt = _prompt(smollm, "What is the capital of France?")
    (base,) = gen.generate([JobSpec(prompt, max_new_tokens=40)])
    assert "Paris" in base.text  # greedy would write it
    for bans in (("Paris",), ("capital of France is Paris",), ("Par", "Lon")):
        ((deltas, fin),) = _run(
            gen, [JobSpec(prompt, max_new_tokens=40, banned_strings=bans, return_logprobs=True)]
        )
        streamed = [d.text for d in deltas]
        text = "".join(streamed) + fin.text
        for ban in bans:
            assert all(ban not in s for s in streamed) and ban not in text
        assert fin.stop_reason in (StopReason.EOS, StopReason.MAX_NEW_TOKENS)
        tokens = [t for d in deltas for t in d.token_ids]
        assert len(tokens) == fin.new_tokens > 3  # it went on past the ban
        assert smollm.tokenizer.decode(tokens, skip_special_tokens=True) == text
        logprobs = [lp for d in deltas for lp in d.logprobs]
        assert [lp.token_id for lp in logprobs] == tokens


def test_jobs_beside_a_banned_one_are_untouched(smollm: LoadedModel, gen: DynamicGenerator) -> None:
    free = JobSpec(_prompt(smollm, "Name three colours."), max_new_tokens=24)
    (alone,) = gen.generate([free])
    banned = JobSpec(
        _prompt(smollm, "What is the capital of France?"), max_new_tokens=24, banned_strings=("Paris",)
    )
    runs = _run(gen, [banned, free, banned])
    assert _text(*runs[1]) == alone.text
    assert _text(*runs[0]) == _text(*runs[2]) and "Paris" not in _text(*runs[0])


def test_rewind_over_shared_and_registered_pages(smollm: LoadedModel) -> None:
    """Pages of 2 tokens fill and register (and are shared with a twin job) while a long banned
    string is held; its rewind copies or unregisters them instead of writing into the cache."""
    gen = DynamicGenerator(
        smollm.model, smollm.tokenizer, GeneratorConfig(2, 256, scheduler=SchedulerConfig(max_chunk_size=256))
    )
    prompt = _prompt(smollm, "What is the capital of France?")
    ban = ("capital of France is Paris",)
    (base,) = gen.generate([JobSpec(prompt, max_new_tokens=30)])
    assert ban[0] in base.text
    (alone,) = _run(gen, [JobSpec(prompt, max_new_tokens=30, banned_strings=ban)])
    twins = _run(
        gen, [JobSpec(prompt, max_new_tokens=30), JobSpec(prompt, max_new_tokens=30, banned_strings=ban)]
    )
    assert _text(*twins[0]) == base.text
    assert _text(*twins[1]) == _text(*alone)
    assert ban[0] not in _text(*alone)
    # The cache still serves the twin's pages: the free job run again gives the same text.
    (again,) = gen.generate([JobSpec(prompt, max_new_tokens=30)])
    assert again.text == base.text


def test_a_ban_the_grammar_cannot_avoid_fails_the_job_alone(
    smollm: LoadedModel, gen: DynamicGenerator
) -> None:
    prompt = _prompt(smollm, "Say yes.")
    stuck = JobSpec(
        prompt,
        max_new_tokens=8,
        banned_strings=("yes",),
        response_format=ResponseFormat(GrammarKind.REGEX, "yes"),
    )
    ok = JobSpec(
        prompt,
        max_new_tokens=8,
        banned_strings=("yes",),
        response_format=ResponseFormat(GrammarKind.REGEX, "(yes|no)"),
    )
    (d1, f1), (d2, f2) = _run(gen, [stuck, ok])
    assert f1.stop_reason is StopReason.ERROR and f1.error is not None and "banned" in f1.error.message
    assert "yes" not in _text(d1, f1)
    assert f2.stop_reason is StopReason.GRAMMAR and _text(d2, f2) == "no"


def test_banned_strings_with_stop_strings_and_sampling(smollm: LoadedModel, gen: DynamicGenerator) -> None:
    prompt = _prompt(smollm, "Write a short story about a cat named Tom.")
    specs = [
        JobSpec(
            prompt,
            max_new_tokens=60,
            banned_strings=("Tom", " the "),
            stop_strings=("\n\n",),
            sampling=SamplingSettings(temperature=0.9, seed=seed, repetition_penalty=1.1),
        )
        for seed in range(4)
    ]
    for deltas, fin in _run(gen, specs):
        text = _text(deltas, fin)
        assert "Tom" not in text and " the " not in text
        assert fin.stop_reason is not StopReason.ERROR
        if fin.stop_reason is StopReason.STOP_STRING:
            assert "\n\n" not in text


def test_validation(smollm: LoadedModel, gen: DynamicGenerator) -> None:
    with pytest.raises(InvalidRequestError, match=r"banned_strings\[0\] must not be empty"):
        gen.enqueue(JobSpec((1, 2), banned_strings=("",)))


def test_banned_jobs_under_preemption_match_an_unpressed_run(smollm: LoadedModel) -> None:
    """A pool too small for all jobs preempts some mid-hold and mid-rewind; their texts are the
    same as with room to spare, and no page leaks."""
    questions = [
        "What is the capital of France?",
        "Name three colours.",
        "Who wrote Hamlet?",
        "Count to ten.",
    ]
    bans = ("Paris", "red", "Shakespeare", "five", " the ")
    specs = [JobSpec(_prompt(smollm, q), max_new_tokens=40, banned_strings=bans) for q in questions]
    roomy = DynamicGenerator(smollm.model, smollm.tokenizer, GeneratorConfig(4, 512))
    want = [_text(*r) for r in _run(roomy, specs)]
    tight = DynamicGenerator(smollm.model, smollm.tokenizer, GeneratorConfig(4, 30))
    preempted: list[JobId] = []
    preempt = tight.scheduler._preempt

    def counting(job: JobState) -> None:
        preempted.append(job.job_id)
        preempt(job)

    setattr(tight.scheduler, "_preempt", counting)  # noqa: B010 (a method assignment mypy refuses)
    got = [_text(*r) for r in _run(tight, specs)]
    assert preempted, "the pool was meant to be too small"
    assert got == want
    assert all(b not in t for t in got for b in bans)
    stats = tight.stats()
    assert stats.pages_used == 0 and stats.running == 0


def test_a_stop_string_completed_in_text_held_for_a_ban_ends_the_stream_at_finish(real: Tokenizer) -> None:
    """'.' may start the banned '.a', so it is held; at finish it completes the stop string 'c.'."""
    stream = TextStream(real, ["c."], True, [".a"])
    ids = real.encode("c.", add_special_tokens=False)
    assert "".join(stream.push([t]).text for t in ids) == ""
    assert stream.finish() == "" and stream.finish_stop == "c."
