"""One bad job fails alone: faults injected into one job's forward, sampling, text or drafts leave
every other job's greedy tokens as in the fault-free run, the pages consistent, the generator serving."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from engine.cache.kv_cache import PagedKVCache
from engine.errors import ErrorKind
from engine.forward_batch import ForwardBatch
from engine.generator import DynamicGenerator, GeneratorConfig
from engine.jobs import JobFinished, JobId, JobSpec, SamplingSettings, StopReason, TokensGenerated
from engine.model.loader import LoadedModel, load_model
from engine.output.text_stream import TextDelta
from engine.sampling.sampler import SampleRequest, SampleResult
from engine.scheduler import SchedulerConfig
from engine.speculation.speculative import Draft, DrafterKind, DraftRequest, SpeculationConfig
from tests.tiny_llama import save_tiny_llama

POISON = 299  # a token id whose presence in a forward makes the injected fault fire


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    folder: Path = tmp_path_factory.mktemp("tiny_faults")
    save_tiny_llama(folder, with_tokenizer=True, max_position_embeddings=1024)
    return load_model(folder, progress=False)


def make(tiny: LoadedModel, kind: DrafterKind = DrafterKind.NONE, num_pages: int = 64) -> DynamicGenerator:
    config = GeneratorConfig(
        page_size=8,
        num_pages=num_pages,
        scheduler=SchedulerConfig(max_batch_size=8, max_chunk_size=48),
        speculation=SpeculationConfig(kind, num_draft_tokens=3, max_batch_size=8),
    )
    return DynamicGenerator(tiny.model, tiny.tokenizer, config)


# Prompts of several lengths (prefill chunks and decode steps mix), repetitive enough to draft.
PROMPTS = [tuple([10 + i, 11, 12, 13] * (2 + i) + [20 + i]) for i in range(5)]


def specs(poisoned: int | None = None) -> list[JobSpec]:
    out = [JobSpec(p, max_new_tokens=16, ignore_eos=True) for p in PROMPTS]
    if poisoned is not None:
        p = out[poisoned].prompt_ids
        out[poisoned] = JobSpec((*p[:-1], POISON), max_new_tokens=16, ignore_eos=True)
    return out


def run(
    gen: DynamicGenerator, todo: Sequence[JobSpec], on_enqueue: Callable[[list[JobId]], None] | None = None
) -> tuple[list[list[int]], list[JobFinished]]:
    ids = [gen.enqueue(s) for s in todo]
    if on_enqueue is not None:
        on_enqueue(ids)
    tokens: dict[JobId, list[int]] = {i: [] for i in ids}
    finished: dict[JobId, JobFinished] = {}
    for _ in range(2000):
        if not gen.has_work():
            break
        for e in gen.iterate():
            if isinstance(e, TokensGenerated):
                assert e.job_id not in finished
                tokens[e.job_id].extend(e.token_ids)
            elif isinstance(e, JobFinished):
                assert e.job_id not in finished, "two finish events for one job"
                finished[e.job_id] = e
        gen.check_invariants()
    assert not gen.has_work(), "the generator never finished its jobs"
    return [tokens[i] for i in ids], [finished[i] for i in ids]


def assert_failed_alone(
    gen: DynamicGenerator,
    tokens: list[list[int]],
    finished: list[JobFinished],
    bad: set[int],
    reference: list[list[int]],
) -> None:
    for i, f in enumerate(finished):
        if i in bad:
            assert f.stop_reason is StopReason.ERROR
            assert f.error is not None and f.error.kind is ErrorKind.INTERNAL
            assert "Traceback" not in f.error.message and len(f.error.message) < 200
        else:
            assert f.stop_reason is StopReason.MAX_NEW_TOKENS and f.error is None
            assert tokens[i] == reference[i], i
    s = gen.stats()
    assert s.failed_jobs == len(bad)
    assert (s.running, s.queued, s.pages_used) == (0, 0, 0)
    # Still serving: a new job runs to the end.
    again = gen.generate([JobSpec(PROMPTS[0], max_new_tokens=16, ignore_eos=True)])[0]
    assert list(again.token_ids) == reference[0]
    gen.check_invariants()


@pytest.fixture(scope="module")
def reference(tiny: LoadedModel) -> list[list[int]]:
    tokens, _ = run(make(tiny), specs())
    return tokens


def poisoned_forward(monkeypatch: pytest.MonkeyPatch, tiny: LoadedModel, always: bool = False) -> list[int]:
    """Make the model's forward raise whenever POISON is in the batch (or always); returns the call log."""
    real = tiny.model.forward
    calls: list[int] = []

    def forward(batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        calls.append(batch.num_seqs)
        if always or bool((batch.input_ids == POISON).any()):
            raise RuntimeError("injected forward fault")
        return real(batch, cache)

    monkeypatch.setattr(tiny.model, "forward", forward)
    return calls


def test_a_forward_that_fails_for_one_job_fails_only_that_job(
    tiny: LoadedModel,
    reference: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls = poisoned_forward(monkeypatch, tiny)
    gen = make(tiny)
    seen: list[JobId] = []
    with caplog.at_level(logging.ERROR, logger="engine.generator"):
        tokens, finished = run(gen, specs(poisoned=2), seen.extend)
    assert max(calls) > 1  # the fault hit a batched forward, which was then split
    assert_failed_alone(gen, tokens, finished, {2}, reference)
    assert tokens[2] == []
    failures = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(failures) == 1 and failures[0].exc_info is not None
    assert seen[2][:8] in failures[0].getMessage() and seen[2] not in failures[0].getMessage()


def test_a_forward_fault_mid_decode_keeps_what_the_job_streamed(
    tiny: LoadedModel, reference: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = tiny.model.forward

    def forward(batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        # Only the longest job (25 prompt tokens + 16) ever reaches position 38.
        if bool((batch.positions == 38).any()):
            raise RuntimeError("injected forward fault")
        return real(batch, cache)

    monkeypatch.setattr(tiny.model, "forward", forward)
    gen = make(tiny)
    tokens, finished = run(gen, specs())
    assert tokens[4] == reference[4][: 38 - 25 + 1]  # up to the token whose step failed
    assert_failed_alone(gen, tokens, finished, {4}, reference)


def test_a_broken_model_fails_every_job_instead_of_looping(
    tiny: LoadedModel, reference: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = make(tiny)
    with monkeypatch.context() as m:
        poisoned_forward(m, tiny, always=True)
        tokens, finished = run(gen, specs())
    assert all(f.stop_reason is StopReason.ERROR for f in finished)
    assert all(t == [] for t in tokens)
    assert_failed_alone(gen, tokens, finished, set(range(len(PROMPTS))), reference)


def test_a_sampler_fault_for_one_job_fails_only_that_job(
    tiny: LoadedModel, reference: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = make(tiny)
    real = gen.sampler.sample
    bad: list[object] = []

    def sample(
        logits: torch.Tensor, requests: Sequence[SampleRequest], overwrite: bool = False
    ) -> list[SampleResult]:
        if any(r.state in bad for r in requests):
            raise RuntimeError("injected sampler fault")
        return real(logits, requests, overwrite)

    monkeypatch.setattr(gen.sampler, "sample", sample)

    def arm(ids: list[JobId]) -> None:
        bad.append(gen.jobs[ids[3]].sampler)

    tokens, finished = run(gen, specs(), arm)
    assert tokens[3] == []
    assert_failed_alone(gen, tokens, finished, {3}, reference)


def test_a_text_stream_fault_mid_output_fails_only_that_job(
    tiny: LoadedModel, reference: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = make(tiny)

    def arm(ids: list[JobId]) -> None:
        stream = gen.jobs[ids[1]].text
        real = stream.push
        pushed = [0]

        def push(token_ids: Sequence[int]) -> TextDelta:
            pushed[0] += 1
            if pushed[0] == 5:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected text fault")
            return real(token_ids)

        monkeypatch.setattr(stream, "push", push)

    tokens, finished = run(gen, specs(), arm)
    assert tokens[1] == reference[1][:4]  # what was streamed before the fault stands
    assert finished[1].new_tokens == 5
    assert_failed_alone(gen, tokens, finished, {1}, reference)


@pytest.mark.parametrize("where", ["propose", "verify"])
def test_a_speculation_fault_for_one_job_fails_only_that_job(
    tiny: LoadedModel, reference: list[list[int]], monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    gen = make(tiny, DrafterKind.NGRAM)
    assert gen.drafter is not None
    bad: list[JobId] = []
    bad_state: list[object] = []

    def arm(ids: list[JobId]) -> None:
        bad.append(ids[0])
        bad_state.append(gen.jobs[ids[0]].sampler)

    if where == "propose":
        real_propose = gen.drafter.propose

        def propose(requests: Sequence[DraftRequest]) -> list[Draft]:
            if any(r.job_id in bad for r in requests):
                raise KeyError("injected drafter fault")
            return real_propose(requests)

        monkeypatch.setattr(gen.drafter, "propose", propose)
    else:
        real_sample = gen.sampler.sample

        def sample(
            logits: torch.Tensor, requests: Sequence[SampleRequest], overwrite: bool = False
        ) -> list[SampleResult]:
            # A verification samples one job's rows only, a row per draft position and one more.
            if len(requests) > 1 and all(r.state in bad_state for r in requests):
                raise IndexError("injected verification fault")
            return real_sample(logits, requests, overwrite)

        monkeypatch.setattr(gen.sampler, "sample", sample)
    tokens, finished = run(gen, specs(), arm)
    assert finished[0].new_tokens > 0  # it failed while speculating, not before
    assert gen.stats().accepted_draft_tokens + gen.stats().rejected_draft_tokens > 0
    assert_failed_alone(gen, tokens, finished, {0}, reference)


def test_a_sampled_neighbour_keeps_its_seeded_tokens_when_another_job_fails(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    seeded = JobSpec(PROMPTS[4], max_new_tokens=12, sampling=SamplingSettings(temperature=0.9, seed=3))
    alone = make(tiny).generate([seeded])[0]
    poisoned_forward(monkeypatch, tiny)
    tokens, finished = run(make(tiny), [specs(poisoned=0)[0], seeded])
    assert finished[0].stop_reason is StopReason.ERROR
    assert tuple(tokens[1]) == alone.token_ids
