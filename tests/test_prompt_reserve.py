"""The share of a forward's prompt budget a long prompt leaves to the prompts behind it
(`prompt_reserve`, engine/scheduler.py): a short request starts beside a long prefill instead of
waiting it out, and what the short ones leave, the long one takes back."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.generator import DynamicGenerator
from engine.jobs import JobId, JobSpec, TokensGenerated
from engine.model.loader import LoadedModel
from engine.prompt.guidance import Guidance
from engine.prompt_depth_cost import PromptDepthCost
from engine.scheduler import SchedulerConfig
from tests.tiny_generator import finish, long_prompt, scheduled_gen

CHUNK = 128
LONG = 900


def tiny_gen(tiny: LoadedModel, reserve: float, **scheduler: object) -> DynamicGenerator:
    config = SchedulerConfig(max_batch_size=8, max_chunk_size=CHUNK, prompt_reserve=reserve, **scheduler)  # type: ignore[arg-type]
    return scheduled_gen(tiny, config)


def first_tokens(gen: DynamicGenerator, jobs: list[JobId], limit: int = 100) -> dict[JobId, int]:
    """The forward (counted from 1) in which each of `jobs` got its first token."""
    first: dict[JobId, int] = {}
    for step in range(1, limit + 1):
        for e in gen.iterate():
            if isinstance(e, TokensGenerated) and e.job_id in jobs:
                first.setdefault(e.job_id, step)
        gen.check_invariants()
        if len(first) == len(jobs):
            return first
    pytest.fail(f"no first token in {limit} forwards: {first}")


@pytest.mark.parametrize("reserve", [0.25, 0.5])
def test_a_short_request_starts_beside_a_long_prefill(tiny: LoadedModel, reserve: float) -> None:
    gen = tiny_gen(tiny, reserve)
    long = gen.enqueue(JobSpec(long_prompt(1, LONG), 2, ignore_eos=True, tenant="a"))
    gen.iterate()
    short = gen.enqueue(JobSpec(long_prompt(2, 20), 2, ignore_eos=True, tenant="b"))
    before = gen.jobs[long].computed
    first = first_tokens(gen, [short, long])
    assert first[short] == 1  # its whole prompt in the next forward, its token from it
    # The long prompt kept all but the reserve of that forward, and went on after it.
    assert gen.jobs[long].computed >= LONG
    assert first[long] > first[short]
    finish(gen)
    assert before == CHUNK  # alone, it took its whole first chunk


def test_without_a_reserve_the_short_request_waits_out_the_long_prefill(tiny: LoadedModel) -> None:
    gen = tiny_gen(tiny, 0.0)
    long = gen.enqueue(JobSpec(long_prompt(1, LONG), 2, ignore_eos=True, tenant="a"))
    gen.iterate()
    short = gen.enqueue(JobSpec(long_prompt(2, 20), 2, ignore_eos=True, tenant="b"))
    first = first_tokens(gen, [short, long])
    assert first[short] >= first[long]  # arrival order: 0 is the old behaviour
    finish(gen)


def test_alone_a_long_prompt_takes_its_reserve_back(tiny: LoadedModel) -> None:
    gen = tiny_gen(tiny, 0.5)
    job = gen.enqueue(JobSpec(long_prompt(3, LONG), 2, ignore_eos=True))
    done = [0]
    while not any(isinstance(e, TokensGenerated) for e in gen.iterate()):
        done.append(gen.jobs[job].computed)
    slices = [b - a for a, b in itertools.pairwise(done)]
    assert slices[:-1] == [CHUNK] * (len(slices) - 1)  # no forward lost its reserve's share
    finish(gen)


def test_the_long_prompt_keeps_its_share_while_a_medium_one_prefills(tiny: LoadedModel) -> None:
    reserve = 0.25
    gen = tiny_gen(tiny, reserve)
    long = gen.enqueue(JobSpec(long_prompt(4, LONG), 2, ignore_eos=True, tenant="a"))
    gen.iterate()
    medium = gen.enqueue(JobSpec(long_prompt(5, 200), 2, ignore_eos=True, tenant="b"))
    shares: list[tuple[int, int]] = []
    while gen.jobs[medium].computed < gen.jobs[medium].prompt_len:
        before = (gen.jobs[long].computed, gen.jobs[medium].computed)
        gen.iterate()
        gen.check_invariants()
        shares.append((gen.jobs[long].computed - before[0], gen.jobs[medium].computed - before[1]))
    assert len(shares) > 3  # 200 tokens through a 32-token reserve
    for n_long, n_medium in shares:
        assert n_long + n_medium <= CHUNK
        assert n_long >= int(CHUNK * (1 - reserve))  # never below its held share
        assert n_medium >= 1
    finish(gen)


def test_a_prompt_no_shorter_than_the_held_one_waits_its_turn(tiny: LoadedModel) -> None:
    gen = tiny_gen(tiny, 0.25)
    first = gen.enqueue(JobSpec(long_prompt(6, LONG), 2, ignore_eos=True, tenant="a"))
    gen.iterate()
    second = gen.enqueue(JobSpec(long_prompt(7, LONG), 2, ignore_eos=True, tenant="b"))
    gen.iterate()
    # Longer than what the first has left: arrival order, the whole budget to the first.
    assert gen.jobs[first].computed == 2 * CHUNK
    assert second not in {j.job_id for j in gen.scheduler.running}  # not admitted to sit on pages
    short = gen.enqueue(JobSpec(long_prompt(8, 20), 2, ignore_eos=True, tenant="c"))
    firsts = first_tokens(gen, [short, first, second])
    assert firsts[short] == 1 < firsts[first] < firsts[second]
    finish(gen)


def test_the_reserve_goes_to_the_shortest_prompt_first(tiny: LoadedModel) -> None:
    gen = tiny_gen(tiny, 0.25)
    long = gen.enqueue(JobSpec(long_prompt(14, LONG), 2, ignore_eos=True, tenant="a"))
    gen.iterate()
    medium = gen.enqueue(JobSpec(long_prompt(15, 300), 2, ignore_eos=True, tenant="b"))
    gen.iterate()  # admitted beside the long one: 32 of its 300 tokens
    assert gen.jobs[medium].computed == CHUNK - int(CHUNK * 0.75)
    short = gen.enqueue(JobSpec(long_prompt(16, 10), 2, ignore_eos=True, tenant="c"))
    firsts = first_tokens(gen, [short, medium, long])
    # The reserve goes to the shortest first: the queued short prompt before the running medium one.
    assert firsts[short] == 1
    assert firsts[short] < firsts[medium] and firsts[short] < firsts[long]
    finish(gen)


def test_a_queued_prompt_is_as_long_as_what_its_prefix_hits_leave(tiny: LoadedModel) -> None:
    gen = tiny_gen(tiny, 0.25)
    cached = long_prompt(17, LONG)
    gen.enqueue(JobSpec(cached, 1, ignore_eos=True))
    while gen.has_work():
        gen.iterate()
    long = gen.enqueue(JobSpec(long_prompt(18, LONG), 2, ignore_eos=True, tenant="a"))
    gen.iterate()
    # 920 tokens, all but the last few pages' worth cached: shorter than what the long one has left.
    follow_up = gen.enqueue(JobSpec((*cached, *long_prompt(19, 20)), 2, ignore_eos=True, tenant="b"))
    firsts = first_tokens(gen, [follow_up, long])
    assert firsts[follow_up] == 1
    finish(gen)


def test_beside_decode_steps_the_reserve_is_a_share_of_the_stall_budget(tiny: LoadedModel) -> None:
    budget = 64
    gen = tiny_gen(tiny, 0.25, prefill_while_decoding=budget)
    price = PromptDepthCost(200.0)
    gen.scheduler.price_prompts(price)
    stream = gen.enqueue(JobSpec((5, 6, 7), 400, ignore_eos=True, tenant="s"))
    gen.iterate()
    long = gen.enqueue(JobSpec(long_prompt(9, 600), 2, ignore_eos=True, tenant="a"))
    gen.iterate()
    short = gen.enqueue(JobSpec(long_prompt(10, 12), 2, ignore_eos=True, tenant="b"))
    before = (gen.jobs[long].computed, 0)
    events = gen.iterate()
    got = {e.job_id for e in events if isinstance(e, TokensGenerated)}
    assert stream in got and short in got  # the stream stepped, the short prompt went through whole
    n_long = gen.jobs[long].computed - before[0]
    cost = price.slice_cost(n_long, before[0]) + price.slice_cost(12, 0)
    assert cost <= price.slice_cost(budget, 0)
    assert n_long >= 1
    gen.cancel(stream)
    finish(gen)


def test_a_guided_pair_held_back_keeps_its_rows_together(tiny: LoadedModel) -> None:
    gen = tiny_gen(tiny, 0.25)
    guided = gen.enqueue(
        JobSpec(long_prompt(11, 500), 3, ignore_eos=True, guidance=Guidance(1.5, long_prompt(12, 480)))
    )
    gen.iterate()
    short = gen.enqueue(JobSpec(long_prompt(13, 16), 2, ignore_eos=True, tenant="b"))
    first = first_tokens(gen, [short, guided])
    assert first[short] == 1
    finish(gen)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    arrivals=st.lists(
        st.tuples(st.integers(0, 6), st.integers(1, 700), st.integers(1, 6)), min_size=1, max_size=6
    ),
    reserve=st.sampled_from([0.0, 0.25, 0.5]),
    alone=st.sampled_from([None, 48]),
)
def test_any_arrivals_stay_within_the_budget_and_all_finish(
    tiny: LoadedModel, arrivals: list[tuple[int, int, int]], reserve: float, alone: int | None
) -> None:
    if alone is None:
        gen = tiny_gen(tiny, reserve)
    else:  # a forward with no decode step held to `alone` tokens (prefill_alone_ms)
        gen = tiny_gen(tiny, reserve, prefill_while_decoding=16)
        gen.scheduler.price_prompts(
            PromptDepthCost(token_seconds=gen.scheduler.config.prefill_alone_ms / 1000 / alone)
        )
        assert gen.scheduler.alone_tokens == alone
    pending = sorted(arrivals)
    jobs: list[JobId] = []
    step = 0
    while pending or gen.has_work():
        while pending and pending[0][0] <= step:
            _, n, new = pending.pop(0)
            jobs.append(gen.enqueue(JobSpec(long_prompt(len(jobs), n), new, ignore_eos=True)))
        before = {j: gen.jobs[j].computed for j in jobs if j in gen.jobs}
        gen.iterate()
        gen.check_invariants()
        moved = sum(gen.jobs[j].computed - c for j, c in before.items() if j in gen.jobs)
        assert moved <= CHUNK
        assert moved <= gen.scheduler.alone_tokens + 8  # prompt tokens, and a decode token a row
        step += 1
        assert step < 200
    finish(gen)
