"""Prompt slices beside decode steps priced by their depth (engine/prompt_depth_cost.py), and the
warm-up's timing of that price, kept per machine (engine/prompt_depth_timing.py)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import engine.generator as generator_module
from engine.cache.kv_events import BlockStored
from engine.generator import DynamicGenerator, GeneratorConfig
from engine.jobs import JobId, JobSpec, TokensGenerated
from engine.model.loader import LoadedModel
from engine.prompt.guidance import Guidance
from engine.prompt_depth_cost import PromptDepthCost
from engine.prompt_depth_timing import DEPTH, MIN_PARITY, SLICE, parity_from
from engine.scheduler import SchedulerConfig
from tests.tiny_generator import all_pages_idle, finish, long_prompt

PROMPT = 600
BUDGET = 64


@given(
    units=st.floats(min_value=0, max_value=5000, allow_nan=False),
    depth=st.integers(min_value=0, max_value=100_000),
    parity=st.floats(min_value=1, max_value=1e6, allow_nan=False),
)
def test_a_slice_is_the_most_tokens_within_the_units(units: float, depth: int, parity: float) -> None:
    price = PromptDepthCost(parity)
    n = price.tokens_within(units, depth)
    assert n >= 0
    assert n == 0 or price.slice_cost(n, depth) <= units
    assert price.slice_cost(n + 1, depth) > units
    assert price.tokens_within(units, depth + 100) <= n  # deeper: never longer


def test_depth_is_free_until_timed() -> None:
    free = PromptDepthCost()
    assert free.tokens_within(128, 0) == free.tokens_within(128, 7000) == 128
    assert free.slice_cost(128, 7000) == 128
    with pytest.raises(ValueError, match="parity"):
        PromptDepthCost(0)


def test_the_parity_comes_back_from_the_two_slices_times() -> None:
    a, b = 4e-4, 3e-7  # a prompt token's seconds, and its seconds per key: parity ~1333
    flat = SLICE * a + b * SLICE * SLICE / 2
    deep = flat + b * SLICE * DEPTH
    assert parity_from(flat, deep, DEPTH).parity == pytest.approx(a / b)
    assert math.isinf(parity_from(flat, flat * 0.98, DEPTH).parity)  # depth looked free
    assert parity_from(flat, flat * 50, DEPTH).parity == MIN_PARITY  # a spoiled timing


def tiny_gen(tiny: LoadedModel, chunk: int = 2048, **scheduler: object) -> DynamicGenerator:
    config = GeneratorConfig(
        page_size=16,
        num_pages=256,
        scheduler=SchedulerConfig(max_batch_size=8, max_chunk_size=chunk, **scheduler),  # type: ignore[arg-type]
    )
    return DynamicGenerator(tiny.model, tiny.tokenizer, config)


def test_deeper_slices_are_shorter_and_each_stays_within_the_budget(tiny: LoadedModel) -> None:
    gen = tiny_gen(tiny, prefill_while_decoding=BUDGET)
    price = PromptDepthCost(200.0)
    gen.scheduler.price_prompts(price)
    stream = gen.enqueue(JobSpec((5, 6, 7), 200, ignore_eos=True))
    gen.iterate()  # the stream's prompt, then it decodes
    late = gen.enqueue(JobSpec(long_prompt(1, PROMPT), 4, ignore_eos=True))
    done = [0]
    for _ in range(200):
        events = gen.iterate()
        gen.check_invariants()
        got: set[JobId] = {e.job_id for e in events if isinstance(e, TokensGenerated)}
        assert stream in got  # the stream took a token in every step
        if late in got:
            break
        done.append(gen.jobs[late].computed)
    else:
        pytest.fail("the long prompt never finished its prefill")
    slices = [(a, b - a) for a, b in itertools.pairwise(done)]
    assert all(n >= 1 for _, n in slices)  # every forward moved the prompt on
    assert slices[0] == (0, BUDGET)  # from depth 0, the setting's own count
    assert all(price.slice_cost(n, depth) <= price.slice_cost(BUDGET, 0) for depth, n in slices)
    assert slices[0][1] > 2 * slices[-1][1]  # the first slice (depth 0) against the last
    # Unpriced, the same budget takes BUDGET tokens a forward at every depth.
    assert len(slices) + 1 > math.ceil(PROMPT / BUDGET)
    finish(gen)


def test_alone_a_deep_chunk_costs_no_more_than_a_whole_chunk_from_depth_0(tiny: LoadedModel) -> None:
    chunk = 256
    gen = tiny_gen(tiny, chunk)
    price = PromptDepthCost(200.0)
    gen.scheduler.price_prompts(price)
    job = gen.enqueue(JobSpec(long_prompt(4, 1000), 2, ignore_eos=True))
    done = [0]
    while not any(isinstance(e, TokensGenerated) for e in gen.iterate()):
        done.append(gen.jobs[job].computed)
    slices = [(a, b - a) for a, b in itertools.pairwise(done)]
    assert slices[0] == (0, chunk)
    assert all(price.slice_cost(n, depth) <= price.slice_cost(chunk, 0) for depth, n in slices)
    assert slices[-1][1] < chunk / 2
    finish(gen)


def test_a_guided_pair_prefills_in_priced_slices(tiny: LoadedModel) -> None:
    gen = tiny_gen(tiny, prefill_while_decoding=BUDGET)
    price = PromptDepthCost(200.0)
    gen.scheduler.price_prompts(price)
    stream = gen.enqueue(JobSpec((5, 6, 7), 400, ignore_eos=True))
    gen.iterate()
    guided = gen.enqueue(
        JobSpec(
            long_prompt(2, 300),
            3,
            ignore_eos=True,
            guidance=Guidance(1.5, long_prompt(3, 280)),
        )
    )
    tokens: list[int] = []
    costs: list[float] = []
    for _ in range(300):
        job = gen.jobs[guided]
        assert job.negative is not None
        before = (job.computed, job.negative.computed)
        for e in gen.iterate():
            if isinstance(e, TokensGenerated) and e.job_id == guided:
                tokens += e.token_ids
        gen.check_invariants()
        if not tokens:  # still prefilling: its two rows' slices of this forward, priced
            costs.append(
                sum(
                    price.slice_cost(b - a, a)
                    for a, b in zip(before, (job.computed, job.negative.computed), strict=True)
                )
            )
        if guided not in gen.jobs:
            break
    assert len(tokens) == 3
    assert len(costs) > 10 and max(costs) <= price.slice_cost(BUDGET, 0)
    assert gen.jobs[stream].new_tokens > 10  # it went on decoding beside the pair's slices
    gen.cancel(stream)
    finish(gen)


def test_the_warm_up_times_the_price_once_and_a_later_start_reads_it(
    tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = tiny_gen(tiny)
    first.warmup(step_costs=tmp_path)
    price = first.scheduler.prompt_cost
    assert price.parity >= MIN_PARITY
    assert len(list(tmp_path.glob("prompt-depth-*.json"))) == 1
    # The timing's pages are under a salt of their own: nothing a router would route by.
    events = first.kv_events(0)
    assert events is not None
    assert not [e for _, e in events if isinstance(e, BlockStored) and not e.salted]
    assert all_pages_idle(first)
    first.close()

    def untimed(*args: object, **kwargs: object) -> PromptDepthCost:
        raise AssertionError("a kept price is not timed again")

    monkeypatch.setattr(generator_module, "time_prompt_depth", untimed)
    second = tiny_gen(tiny)
    second.warmup(step_costs=tmp_path)
    assert second.scheduler.prompt_cost == price
    second.close()


def test_without_a_prefix_cache_depth_stays_free(tiny: LoadedModel) -> None:
    gen = tiny_gen(tiny, prefix_cache=False)
    gen.warmup()
    assert math.isinf(gen.scheduler.prompt_cost.parity)
    gen.close()
