"""The generator's bookkeeping on a tiny random model: cancel, queue bounds, random job lifecycles."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.errors import JobNotFoundError, PromptTooLongError, QueueFullError
from engine.generator import DynamicGenerator, GeneratorConfig
from engine.jobs import JobFinished, JobId, JobSpec, PrefillProgress, SamplingSettings, StopReason
from engine.model.loader import LoadedModel
from engine.prompt.guidance import Guidance
from engine.scheduler import SchedulerConfig
from engine.speculation.speculative import DrafterKind, SpeculationConfig
from tests.tiny_generator import all_pages_idle, loaded_tiny_model


def generator(
    tiny: LoadedModel,
    num_pages: int = 32,
    page_size: int = 8,
    chunk: int = 64,
    max_q: int = 64,
    batch: int = 16,
    speculation: DrafterKind = DrafterKind.NONE,
) -> DynamicGenerator:
    sched = SchedulerConfig(max_batch_size=batch, max_chunk_size=chunk, max_q_size=max_q)
    config = GeneratorConfig(
        page_size, num_pages, scheduler=sched, speculation=SpeculationConfig(speculation, num_draft_tokens=3)
    )
    return DynamicGenerator(tiny.model, tiny.tokenizer, config)


def test_cancel_mid_prefill_frees_every_page(tiny: LoadedModel) -> None:
    gen = generator(tiny, num_pages=32, page_size=8, chunk=16)
    job = gen.enqueue(JobSpec(tuple(range(3, 103)), max_new_tokens=20))
    events = gen.iterate()
    assert any(isinstance(e, PrefillProgress) for e in events)
    assert gen.stats().pages_used > 0
    gen.cancel(job)
    finished = [e for e in gen.iterate() if isinstance(e, JobFinished)]
    assert finished and finished[0].stop_reason is StopReason.CANCELLED
    gen.check_invariants()
    assert all_pages_idle(gen)
    with pytest.raises(JobNotFoundError):
        gen.cancel(job)


def test_cancel_mid_decode_frees_every_page_and_others_continue(tiny: LoadedModel) -> None:
    gen = generator(tiny)
    a = gen.enqueue(JobSpec(tuple(range(3, 40)), max_new_tokens=50, ignore_eos=True))
    b = gen.enqueue(JobSpec(tuple(range(5, 30)), max_new_tokens=10, ignore_eos=True))
    for _ in range(4):
        gen.iterate()
    gen.cancel(a)
    done: dict[JobId, JobFinished] = {}
    while gen.has_work():
        done.update({e.job_id: e for e in gen.iterate() if isinstance(e, JobFinished)})
        gen.check_invariants()
    assert done[a].stop_reason is StopReason.CANCELLED
    assert done[b].stop_reason is StopReason.MAX_NEW_TOKENS and done[b].new_tokens == 10
    assert all_pages_idle(gen)


def test_queue_overflow_is_queue_full(tiny: LoadedModel) -> None:
    gen = generator(tiny, max_q=3)
    for _ in range(3):
        gen.enqueue(JobSpec((5, 6, 7), max_new_tokens=2))
    with pytest.raises(QueueFullError, match="queue is full"):
        gen.enqueue(JobSpec((5, 6, 7), max_new_tokens=2))


def test_min_new_tokens_suppresses_stop_tokens(tiny: LoadedModel) -> None:
    gen = generator(tiny)
    # A large bias makes the stop token 9 win at once unless min_new_tokens holds it back.
    bias = tuple((t, 50.0) for t in (9,))
    spec = JobSpec(
        (3, 4, 5),
        max_new_tokens=12,
        min_new_tokens=5,
        stop_token_ids=frozenset({9}),
        sampling=SamplingSettings(logit_bias=bias),
    )
    result = gen.generate([spec])[0]
    assert result.finished.stop_reason is StopReason.STOP_TOKEN
    assert result.finished.new_tokens == 5 and 9 not in result.token_ids


class GeneratorLifecycle(RuleBasedStateMachine):
    """Random enqueue / step / cancel sequences; a small pool forces preemption, with and without
    n-gram speculation, and jobs of two cache salts share prompts; jobs of three priorities, some
    guided (a negative sequence of their own, on shared prompts too)."""

    def __init__(self) -> None:
        super().__init__()
        self.gen: DynamicGenerator | None = None
        self.live: list[JobId] = []

    @initialize(
        pages=st.integers(6, 24),
        page_size=st.sampled_from([4, 8, 16]),
        chunk=st.sampled_from([8, 32]),
        speculate=st.booleans(),
    )
    def setup(self, pages: int, page_size: int, chunk: int, speculate: bool) -> None:
        kind = DrafterKind.NGRAM if speculate else DrafterKind.NONE
        self.gen = generator(
            loaded_tiny_model(), num_pages=pages, page_size=page_size, chunk=chunk, batch=6, speculation=kind
        )

    @rule(
        prefix=st.integers(0, 2),
        tail=st.lists(st.integers(3, 40), min_size=1, max_size=12),
        new=st.integers(1, 12),
        salt=st.sampled_from(["", "t"]),
        priority=st.integers(0, 2),
        negative=st.none() | st.lists(st.integers(3, 40), min_size=1, max_size=10),
    )
    def enqueue(
        self, prefix: int, tail: list[int], new: int, salt: str, priority: int, negative: list[int] | None
    ) -> None:
        assert self.gen is not None
        # Shared leading tokens so prefix pages collide often.
        prompt = tuple([11, 12, 13, 14, 15, 16, 17, 18] * prefix + tail)
        guidance = None if negative is None else Guidance(2.0, (11, 12, 13, 14, *negative))
        spec = JobSpec(
            prompt, max_new_tokens=new, ignore_eos=True, cache_salt=salt, priority=priority, guidance=guidance
        )
        with contextlib.suppress(PromptTooLongError):  # more than the whole (small) cache
            self.live.append(self.gen.enqueue(spec))

    @rule(steps=st.integers(1, 4))
    def step(self, steps: int) -> None:
        assert self.gen is not None
        for _ in range(steps):
            for e in self.gen.iterate():
                if isinstance(e, JobFinished):
                    assert e.error is None, e.error
                    if e.job_id in self.live:
                        self.live.remove(e.job_id)

    @precondition(lambda self: bool(self.live))
    @rule(which=st.integers(0, 100))
    def cancel(self, which: int) -> None:
        assert self.gen is not None
        job = self.live.pop(which % len(self.live))
        self.gen.cancel(job)

    @invariant()
    def pages_consistent(self) -> None:
        if self.gen is not None:
            self.gen.check_invariants()

    def teardown(self) -> None:
        if self.gen is None:
            return
        for _ in range(2000):
            if not self.gen.has_work():
                break
            self.gen.iterate()
            self.gen.check_invariants()
        assert not self.gen.has_work(), "jobs never finished"
        assert all_pages_idle(self.gen)
        assert self.gen.scheduler.inflight_pages() == 0
        assert self.gen.stats().failed_jobs == 0


def test_random_lifecycles_keep_page_invariants(tiny: LoadedModel) -> None:
    machine = GeneratorLifecycle.TestCase
    machine.settings = settings(
        max_examples=40, stateful_step_count=25, deadline=None, suppress_health_check=list(HealthCheck)
    )
    machine().runTest()
