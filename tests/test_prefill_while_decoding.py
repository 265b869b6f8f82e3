"""A forward that carries decode steps carries at most `prefill_while_decoding` prompt tokens
(engine/scheduler.py), on the tiny random model: a long arriving prompt goes in slices while a
stream decodes, and whole when nobody decodes."""

from __future__ import annotations

import itertools
import math

import pytest

from engine.errors import InvalidRequestError
from engine.generator import DynamicGenerator, GeneratorConfig
from engine.jobs import JobId, JobSpec, TokensGenerated
from engine.model.loader import LoadedModel
from engine.scheduler import SchedulerConfig
from tests.tiny_generator import finish, long_prompt

PROMPT = 300


def tiny_gen(tiny: LoadedModel, prefill_while_decoding: int) -> DynamicGenerator:
    config = GeneratorConfig(
        page_size=16,
        num_pages=256,
        scheduler=SchedulerConfig(
            max_batch_size=8, max_chunk_size=2048, prefill_while_decoding=prefill_while_decoding
        ),
    )
    return DynamicGenerator(tiny.model, tiny.tokenizer, config)


@pytest.mark.parametrize("slice_", [32, 100])
def test_a_long_prompt_goes_in_slices_while_a_stream_decodes(tiny: LoadedModel, slice_: int) -> None:
    gen = tiny_gen(tiny, slice_)
    stream = gen.enqueue(JobSpec((5, 6, 7), 60, ignore_eos=True))
    gen.iterate()  # the stream's prompt, then it decodes
    late = gen.enqueue(JobSpec(long_prompt(1, PROMPT), 4, ignore_eos=True))
    done = [0]
    steps_without_stream_token = 0
    first_token_step = None
    for step in range(1, 40):
        events = gen.iterate()
        gen.check_invariants()
        got: set[JobId] = {e.job_id for e in events if isinstance(e, TokensGenerated)}
        if stream not in got:
            steps_without_stream_token += 1
        if late in gen.jobs:
            done.append(gen.jobs[late].computed)
        if late in got and first_token_step is None:
            first_token_step = step
            break
    slices = [b - a for a, b in itertools.pairwise(done) if b > a]
    assert max(slices) <= slice_
    assert steps_without_stream_token == 0  # the stream took a token in every step
    assert first_token_step == math.ceil(PROMPT / slice_)
    finish(gen)


def test_with_nobody_decoding_a_prompt_takes_the_whole_chunk(tiny: LoadedModel) -> None:
    gen = tiny_gen(tiny, 32)
    job = gen.enqueue(JobSpec(long_prompt(2, PROMPT), 4, ignore_eos=True))
    events = gen.iterate()
    assert any(isinstance(e, TokensGenerated) and e.job_id == job for e in events)
    finish(gen)


def test_the_setting_is_checked() -> None:
    with pytest.raises(InvalidRequestError, match="prefill_while_decoding"):
        SchedulerConfig(prefill_while_decoding=0)
