"""The dynamic generator on the real model: batch invariance, prefix reuse, seeds, stops, preemption."""

from __future__ import annotations

import random

import pytest

from engine.errors import PromptTooLongError
from engine.generator import DynamicGenerator, GeneratorConfig
from engine.jobs import JobFinished, JobId, JobSpec, SamplingSettings, StopReason, TokensGenerated
from engine.model.loader import LoadedModel
from engine.model.tokenizer import ChatMessage
from engine.scheduler import SchedulerConfig
from tests.conftest import PARITY_PROMPTS

pytestmark = pytest.mark.slow


def chat(smollm: LoadedModel, text: str) -> tuple[int, ...]:
    return tuple(smollm.tokenizer.encode_chat([ChatMessage("user", text)]))


def make(
    smollm: LoadedModel,
    page_size: int = 256,
    num_pages: int = 16,
    max_chunk_size: int = 2048,
    max_seq_len: int | None = None,
) -> DynamicGenerator:
    config = GeneratorConfig(
        page_size=page_size,
        num_pages=num_pages,
        max_seq_len=max_seq_len,
        scheduler=SchedulerConfig(max_chunk_size=max_chunk_size),
    )
    return DynamicGenerator(smollm.model, smollm.tokenizer, config)


def run_until_done(gen: DynamicGenerator, target: JobId) -> tuple[list[int], JobFinished]:
    tokens: list[int] = []
    while True:
        for e in gen.iterate():
            if e.job_id != target:
                continue
            if isinstance(e, TokensGenerated):
                tokens.extend(e.token_ids)
            elif isinstance(e, JobFinished):
                return tokens, e
        gen.check_invariants()


def test_greedy_job_is_the_same_alone_and_amid_joining_and_leaving_jobs(smollm: LoadedModel) -> None:
    target = JobSpec(chat(smollm, PARITY_PROMPTS[2]), max_new_tokens=40, ignore_eos=True)
    alone = make(smollm, page_size=16, num_pages=64).generate([target])[0]

    gen = make(smollm, page_size=16, num_pages=256, max_chunk_size=64)
    rng = random.Random(5)
    others = [chat(smollm, p) for p in PARITY_PROMPTS] + [
        chat(smollm, f"Tell me about number {i}.") for i in range(10)
    ]
    target_id = gen.enqueue(target)
    tokens: list[int] = []
    finished: JobFinished | None = None
    live: list[JobId] = []
    added = 0
    while finished is None:
        # Others join at random iterations, and some are cancelled at random iterations.
        if added < 16 and rng.random() < 0.5:
            spec = JobSpec(others[added % len(others)], max_new_tokens=rng.randint(3, 30), ignore_eos=True)
            live.append(gen.enqueue(spec))
            added += 1
        if live and rng.random() < 0.1:
            victim = live.pop(rng.randrange(len(live)))
            if victim in gen.jobs:
                gen.cancel(victim)
        for e in gen.iterate():
            if e.job_id == target_id and isinstance(e, TokensGenerated):
                tokens.extend(e.token_ids)
            elif e.job_id == target_id and isinstance(e, JobFinished):
                finished = e
        gen.check_invariants()
    assert added == 16
    assert tuple(tokens) == alone.token_ids
    assert finished.stop_reason is StopReason.MAX_NEW_TOKENS


def test_second_job_with_the_same_long_prompt_reuses_the_prefix(smollm: LoadedModel) -> None:
    words = " ".join(f"item{i}" for i in range(400))
    prompt = tuple(smollm.tokenizer.encode(words))[:600]
    assert len(prompt) == 600
    gen = make(smollm, page_size=256, num_pages=16)
    first = gen.generate([JobSpec(prompt, max_new_tokens=8, ignore_eos=True)])[0]
    before = gen.stats().forwarded_tokens
    second = gen.generate([JobSpec(prompt, max_new_tokens=8, ignore_eos=True)])[0]
    forwarded = gen.stats().forwarded_tokens - before
    assert first.finished.cached_tokens == 0
    assert second.finished.cached_tokens >= 512
    # Only the uncached rest of the prompt, then one token per decode step (the first comes from prefill).
    assert forwarded == (600 - second.finished.cached_tokens) + 7
    assert second.token_ids == first.token_ids


def test_shared_prefix_is_computed_once_for_jobs_arriving_together(smollm: LoadedModel) -> None:
    system = " ".join(f"fact{i}" for i in range(300))
    questions = ["What is fact1?", "What is fact2?", "What is fact3?", "What is fact4?"]
    specs = [
        JobSpec(
            tuple(smollm.tokenizer.encode_chat([ChatMessage("system", system), ChatMessage("user", q)])),
            max_new_tokens=4,
        )
        for q in questions
    ]
    gen = make(smollm, page_size=64, num_pages=64)
    results = gen.generate(specs)
    # The first job computes the shared pages; the others find them (live dedup or prefix hits).
    assert sum(r.finished.cached_tokens for r in results[1:]) > 0 or gen.stats().prefix_hit_tokens > 0


def test_seeded_sampling_is_reproducible_with_and_without_neighbours(smollm: LoadedModel) -> None:
    sampling = SamplingSettings(temperature=0.9, top_p=0.95, seed=1234)
    target = JobSpec(chat(smollm, PARITY_PROMPTS[1]), max_new_tokens=24, ignore_eos=True, sampling=sampling)
    alone = make(smollm, num_pages=8).generate([target])[0]
    neighbours = [
        JobSpec(chat(smollm, p), max_new_tokens=20, sampling=SamplingSettings(temperature=1.0, seed=i))
        for i, p in enumerate(PARITY_PROMPTS[2:])
    ]
    together = make(smollm, num_pages=16).generate([*neighbours, target])[-1]
    assert together.token_ids == alone.token_ids
    other_seed = JobSpec(
        target.prompt_ids, 24, ignore_eos=True, sampling=SamplingSettings(0.9, top_p=0.95, seed=99)
    )
    assert make(smollm, num_pages=8).generate([other_seed])[0].token_ids != alone.token_ids


def test_stop_string_across_tokens(smollm: LoadedModel) -> None:
    gen = make(smollm, num_pages=8)
    spec = JobSpec(chat(smollm, PARITY_PROMPTS[0]), max_new_tokens=30, stop_strings=("of France",))
    result = gen.generate([spec])[0]
    assert result.text == "The capital "
    assert result.finished.stop_reason is StopReason.STOP_STRING
    assert result.finished.stop_string == "of France"


def test_eos_stops_and_is_not_in_the_output(smollm: LoadedModel) -> None:
    result = make(smollm, num_pages=8).generate(
        [JobSpec(chat(smollm, PARITY_PROMPTS[0]), max_new_tokens=30)]
    )[0]
    assert result.text == "The capital of France is Paris."
    assert result.finished.stop_reason is StopReason.EOS and result.finished.stop_token == 2
    assert 2 not in result.token_ids


def test_preemption_keeps_output_and_matches_unconstrained_run(smollm: LoadedModel) -> None:
    specs = [JobSpec(chat(smollm, p), max_new_tokens=40, ignore_eos=True) for p in PARITY_PROMPTS]
    roomy = make(smollm, page_size=16, num_pages=128).generate(specs)
    # 6 jobs of ~40 + 40 tokens need ~30 pages of 16; 14 pages force preemption and recompute.
    tight = make(smollm, page_size=16, num_pages=14)
    results = tight.generate(specs)
    for a, b in zip(roomy, results, strict=True):
        assert a.token_ids == b.token_ids
    stats = tight.stats()
    assert stats.pages_used == 0 and stats.running == 0


def test_requests_that_can_never_run_are_rejected_with_numbers(smollm: LoadedModel) -> None:
    gen = make(smollm, page_size=16, num_pages=4)
    with pytest.raises(PromptTooLongError, match=r"= 74 tokens exceeds the whole KV cache of 64 tokens"):
        gen.enqueue(JobSpec(tuple(range(10, 74)), max_new_tokens=10))
    gen2 = make(smollm, page_size=256, num_pages=64, max_seq_len=100)
    with pytest.raises(PromptTooLongError, match="exceeds max_seq_len 100"):
        gen2.enqueue(JobSpec(tuple(range(10, 90)), max_new_tokens=30))
