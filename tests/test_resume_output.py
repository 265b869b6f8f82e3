"""A job re-created from its prompt and the output it already delivered (JobSpec.resume_output, what
the front end sends a restarted engine) goes on exactly where it stopped: its later events are
those of the uninterrupted run, token for token and character for character, with the same stop.

Checked on the shipped model for greedy and seeded sampled jobs with penalties, stop strings,
banned strings, a JSON schema, guidance, token healing and min_new_tokens, cut after its first and
before its last event; and the positioned draws themselves (engine/sampling/positioned_uniform.py).
"""

from __future__ import annotations

import dataclasses

import pytest

from engine.errors import InvalidRequestError
from engine.generator import DynamicGenerator, GeneratorConfig
from engine.grammar.response_format import GrammarKind, ResponseFormat
from engine.jobs import JobSpec, SamplingSettings, TokensGenerated
from engine.model.loader import LoadedModel
from engine.model.tokenizer import ChatMessage
from engine.output.text_stream import TextStream
from engine.prompt.guidance import Guidance
from engine.sampling.positioned_uniform import positioned_uniform, seed_key
from engine.sampling.sampler_state import SamplerState
from tests.job_events import run_jobs

pytestmark = pytest.mark.slow


def _chat(model: LoadedModel, text: str) -> tuple[int, ...]:
    return tuple(model.tokenizer.encode_chat([ChatMessage("user", text)]))


def _tokens(deltas: list[TokensGenerated]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def _text(deltas: list[TokensGenerated]) -> str:
    return "".join(d.text for d in deltas)


@pytest.fixture(scope="module")
def gen(smollm: LoadedModel) -> DynamicGenerator:
    return DynamicGenerator(smollm.model, smollm.tokenizer, GeneratorConfig(16, 256))


def _specs(m: LoadedModel) -> dict[str, JobSpec]:
    story = _chat(m, "Write a short story about a cat named Tom.")
    capital = _chat(m, "What is the capital of France? Answer in two sentences.")
    sampled = SamplingSettings(temperature=0.8, top_p=0.95, seed=11, repetition_penalty=1.1)
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    return {
        "greedy": JobSpec(story, max_new_tokens=40),
        "seeded": JobSpec(story, max_new_tokens=40, sampling=sampled),
        "penalties": JobSpec(
            story,
            max_new_tokens=40,
            sampling=SamplingSettings(temperature=1.0, seed=5, frequency_penalty=0.5, presence_penalty=0.3),
        ),
        "stop": JobSpec(capital, max_new_tokens=48, stop_strings=("Paris is", ". It")),
        "banned": JobSpec(
            capital,
            max_new_tokens=40,
            banned_strings=("Paris", "capital city"),
            sampling=SamplingSettings(temperature=0.7, seed=3),
        ),
        "json": JobSpec(
            _chat(m, "Describe a person as JSON with a name and an age."),
            max_new_tokens=40,
            response_format=ResponseFormat(GrammarKind.JSON_SCHEMA, str(schema).replace("'", '"')),
            sampling=SamplingSettings(temperature=0.7, seed=9),
        ),
        "guided": JobSpec(
            story,
            max_new_tokens=32,
            guidance=Guidance(1.5, _chat(m, "Write something.")),
            sampling=SamplingSettings(temperature=0.8, seed=4),
        ),
        "healing": JobSpec(tuple(m.tokenizer.encode("The capital of France is Par")), 24, token_healing=True),
        "min_tokens": JobSpec(_chat(m, "Say hi."), max_new_tokens=24, min_new_tokens=12),
    }


@pytest.mark.parametrize(
    "name", ["greedy", "seeded", "penalties", "stop", "banned", "json", "guided", "healing", "min_tokens"]
)
def test_a_resumed_job_continues_the_uninterrupted_run(
    smollm: LoadedModel, gen: DynamicGenerator, name: str
) -> None:
    spec = _specs(smollm)[name]
    ((deltas, fin),) = run_jobs(gen, [spec])
    assert len(deltas) >= 3, f"{name}: too short to cut ({fin.stop_reason}, {_text(deltas)!r})"
    for cut in sorted({1, len(deltas) - 1}):
        delivered = deltas[:cut]
        resumed = dataclasses.replace(spec, resume_output=tuple(_tokens(delivered)))
        # Beside another job, as a restarted engine runs it with the others it resumes.
        (rest, rest_fin), _ = run_jobs(gen, [resumed, _specs(smollm)["greedy"]])
        assert _tokens(delivered) + _tokens(rest) == _tokens(deltas), (name, cut)
        assert _text(delivered) + _text(rest) + rest_fin.text == _text(deltas) + fin.text, (name, cut)
        assert (rest_fin.stop_reason, rest_fin.stop_string) == (fin.stop_reason, fin.stop_string), (name, cut)
        assert rest_fin.new_tokens == fin.new_tokens and rest_fin.prompt_tokens == fin.prompt_tokens


def test_resume_output_is_checked(smollm: LoadedModel, gen: DynamicGenerator) -> None:
    prompt = _chat(smollm, "Hello")
    with pytest.raises(InvalidRequestError, match="leaves none to generate"):
        gen.enqueue(JobSpec(prompt, max_new_tokens=2, resume_output=(5, 6)))
    with pytest.raises(InvalidRequestError, match="resume_output token ids"):
        gen.enqueue(JobSpec(prompt, max_new_tokens=8, resume_output=(10**7,)))
    regex = ResponseFormat(GrammarKind.REGEX, "[0-9]+")
    letter = smollm.tokenizer.encode("abc")[0]
    with pytest.raises(InvalidRequestError, match="breaks the response_format"):
        gen.enqueue(JobSpec(prompt, max_new_tokens=8, response_format=regex, resume_output=(letter,)))


def test_positioned_draws_are_a_function_of_seed_position_and_stream() -> None:
    a = SamplerState(SamplingSettings(temperature=1.0, seed=42), [1], 100)
    b = SamplerState(SamplingSettings(temperature=1.0, seed=42), [1], 100)
    assert [a.uniform(p) for p in range(50)] == [b.uniform(p) for p in reversed(range(50))][::-1]
    assert a.uniform(7) != a.uniform(7, 1) != a.uniform(7, 2)
    c = SamplerState(SamplingSettings(temperature=1.0, seed=43), [1], 100)
    assert [a.uniform(p) for p in range(20)] != [c.uniform(p) for p in range(20)]
    # Unpositioned draws go on in a sequence of their own.
    assert a.uniform() != a.uniform()
    # Uniform in [0, 1): ten bins of 100,000 draws within 5 standard deviations of 10,000 each.
    key = seed_key(1)
    counts = [0] * 10
    for p in range(100_000):
        u = positioned_uniform(key, p, 0)
        assert 0.0 <= u < 1.0
        counts[int(u * 10)] += 1
    assert all(abs(n - 10_000) < 5 * 95 for n in counts), counts


def test_a_banned_string_completing_across_committed_text_rewinds_only_new_tokens(
    smollm: LoadedModel,
) -> None:
    tok = smollm.tokenizer
    first, second = tok.encode(" capital"), tok.encode(" city")
    stream = TextStream(tok, (), True, ("capital city",))
    for t in first:
        stream.push([t])
    assert stream.held == len(first)  # " capital" may start the banned string
    stream.commit()  # delivered by an earlier engine: final
    assert stream.held == 0
    for t in second:
        delta = stream.push([t])
        if delta.banned is not None:
            assert delta.banned.token == len(first)  # the first token after the committed ones
            break
    else:
        raise AssertionError("the banned string was not found")
