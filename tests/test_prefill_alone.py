"""A forward with no decode step carries the prompt work the warm-up timed at `prefill_alone_ms`
(engine/scheduler.py, engine/prompt_depth_cost.py), on the tiny random model: a long prompt alone goes
in forwards of that much, so a request arriving beside it waits for a short forward, not a whole chunk;
untimed, or at 0, a forward takes the whole chunk as before."""

from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path

import pytest

from engine.errors import InvalidRequestError
from engine.generator import DynamicGenerator
from engine.jobs import JobId, JobSpec, TokensGenerated
from engine.model.loader import LoadedModel
from engine.prompt_depth_cost import PromptDepthCost
from engine.prompt_depth_timing import SLICE, parity_from, read_prompt_depth, write_prompt_depth
from engine.scheduler import SchedulerConfig
from engine.timing_key import TimingKey
from service.config import add_serve_arguments
from tests.tiny_generator import finish, long_prompt, scheduled_gen

CHUNK = 512
BESIDE = 32
LONG = 1000
TOKEN_SECONDS = 0.001  # a depth-0 prompt token's time, as if the warm-up had timed it


def tiny_gen(tiny: LoadedModel, alone_ms: float) -> DynamicGenerator:
    config = SchedulerConfig(
        max_batch_size=8, max_chunk_size=CHUNK, prefill_while_decoding=BESIDE, prefill_alone_ms=alone_ms
    )
    return scheduled_gen(tiny, config)


def prefill_slices(gen: DynamicGenerator, job: JobId) -> list[tuple[int, int]]:
    """(depth, tokens) of each forward until the job's first token."""
    done = [gen.jobs[job].computed]
    for _ in range(200):
        events = gen.iterate()
        gen.check_invariants()
        done.append(gen.jobs[job].computed)
        if any(isinstance(e, TokensGenerated) and e.job_id == job for e in events):
            return [(a, b - a) for a, b in itertools.pairwise(done)]
    pytest.fail("the prompt never finished its prefill")


def test_alone_a_long_prompt_goes_in_forwards_of_the_timed_work(tiny: LoadedModel) -> None:
    gen = tiny_gen(tiny, alone_ms=100.0)
    price = PromptDepthCost(400.0, TOKEN_SECONDS)
    gen.scheduler.price_prompts(price)
    assert gen.scheduler.alone_tokens == 100  # 100 ms of 1 ms tokens
    job = gen.enqueue(JobSpec(long_prompt(1, LONG), 2, ignore_eos=True))
    slices = prefill_slices(gen, job)
    assert slices[0] == (0, 100)
    assert all(price.slice_cost(n, depth) <= price.slice_cost(100, 0) for depth, n in slices)
    assert slices[-2][1] < 50  # deeper tokens cost more: fewer of them a forward
    assert "alone: 100 from depth 0" in gen.scheduler.describe_slices()
    finish(gen)


def test_a_request_arriving_beside_a_long_prefill_waits_one_short_forward(tiny: LoadedModel) -> None:
    gen = tiny_gen(tiny, alone_ms=100.0)
    gen.scheduler.price_prompts(PromptDepthCost(token_seconds=TOKEN_SECONDS))
    long = gen.enqueue(JobSpec(long_prompt(2, LONG), 2, ignore_eos=True, tenant="a"))
    gen.iterate()
    assert gen.jobs[long].computed == 100
    short = gen.enqueue(JobSpec(long_prompt(3, 20), 2, ignore_eos=True, tenant="b"))
    events = gen.iterate()
    assert any(isinstance(e, TokensGenerated) and e.job_id == short for e in events)
    assert gen.jobs[long].computed == 180  # its held share of the 100, the rest the short one left
    finish(gen)


@pytest.mark.parametrize(
    ("alone_ms", "price", "tokens"),
    [
        (0.0, PromptDepthCost(token_seconds=TOKEN_SECONDS), CHUNK),  # off: the whole chunk
        (100.0, PromptDepthCost(), CHUNK),  # untimed: the whole chunk
        (10_000.0, PromptDepthCost(token_seconds=TOKEN_SECONDS), CHUNK),  # a fast device: the chunk bounds it
        (
            5.0,
            PromptDepthCost(token_seconds=TOKEN_SECONDS),
            BESIDE,
        ),  # a slow one: never under the slice beside decoding
    ],
)
def test_the_timed_budget_stays_within_the_slice_and_the_chunk(
    tiny: LoadedModel, alone_ms: float, price: PromptDepthCost, tokens: int
) -> None:
    gen = tiny_gen(tiny, alone_ms=alone_ms)
    gen.scheduler.price_prompts(price)
    assert gen.scheduler.alone_tokens == tokens
    job = gen.enqueue(JobSpec(long_prompt(4, LONG), 2, ignore_eos=True))
    assert prefill_slices(gen, job)[0] == (0, tokens)
    finish(gen)


def test_the_chunk_bounds_the_budget_alone_before_the_slice_beside_decoding() -> None:
    timed = PromptDepthCost(token_seconds=TOKEN_SECONDS)
    assert timed.alone_tokens(100.0, at_least=32, at_most=512) == 100
    assert timed.alone_tokens(100.0, at_least=256, at_most=200) == 200  # a chunk below the slice


def test_beside_decode_steps_the_smaller_slice_bounds_the_prompt(tiny: LoadedModel) -> None:
    gen = tiny_gen(tiny, alone_ms=100.0)
    gen.scheduler.price_prompts(PromptDepthCost(token_seconds=TOKEN_SECONDS))
    stream = gen.enqueue(JobSpec((5, 6, 7), 200, ignore_eos=True))
    gen.iterate()
    late = gen.enqueue(JobSpec(long_prompt(5, 300), 2, ignore_eos=True))
    done = [0]
    for _ in range(20):
        got = {e.job_id for e in gen.iterate() if isinstance(e, TokensGenerated)}
        assert stream in got
        done.append(gen.jobs[late].computed)
        if late in got:
            break
    assert max(b - a for a, b in itertools.pairwise(done)) == BESIDE
    finish(gen)


def test_the_warm_up_keeps_a_tokens_seconds_and_retimes_a_price_without_them(tmp_path: Path) -> None:
    flat = 0.064
    price = parity_from(flat, flat * 1.5, 512)
    assert price.token_seconds == pytest.approx(flat / SLICE)
    assert parity_from(flat, flat * 0.9, 512) == PromptDepthCost(token_seconds=flat / SLICE)
    key = TimingKey.make("prompt-depth-test", "model", "cpu", "cache")
    write_prompt_depth(key, tmp_path, price)
    assert read_prompt_depth(key, tmp_path) == price
    # A price kept before a token's seconds were: timed again (None), not read as untimed.
    key.write(tmp_path, "prompt-depth", {"parity": 900.0})
    assert read_prompt_depth(key, tmp_path) is None


def test_the_setting_is_checked() -> None:
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(InvalidRequestError, match="prefill_alone_ms"):
            SchedulerConfig(prefill_alone_ms=bad)
    with pytest.raises(ValueError, match="seconds"):
        PromptDepthCost(token_seconds=0.0)
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert parser.parse_args(["--prefill-alone-ms", "80"]).prefill_alone_ms == 80.0
    with pytest.raises(SystemExit):
        parser.parse_args(["--prefill-alone-ms", "-5"])
