"""Loop detection (engine/output/loop_detector.py, JobSpec.stop_on_loop): the rule against a brute-force
reading of it; the shipped model's looping poems stopped where the rule first holds, inside a batch
whose other jobs are untouched; the wire field through `dyngen serve`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dyngen_client.errors import error_details
from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from dyngen_client.request import Request
from dyngen_client.result import collect
from engine.errors import InvalidRequestError
from engine.generator import DynamicGenerator, GeneratorConfig
from engine.jobs import JobSpec, StopReason
from engine.model.loader import LoadedModel
from engine.model.tokenizer import ChatMessage
from engine.output.loop_detector import LoopStop, loop_period
from tests.service_harness import start_tiny_server
from tests.tiny_service_model import write_servable_tiny_gguf


def brute(tokens: Sequence[int], start: int, rule: LoopStop) -> int | None:
    """The rule as written: some p in 1..window whose last min_repetitions blocks of p output tokens are equal."""
    out = list(tokens[start:])
    for p in range(1, rule.window + 1):
        span = p * rule.min_repetitions
        if span > len(out):
            break
        tail = out[-span:]
        blocks = [tail[i * p : (i + 1) * p] for i in range(rule.min_repetitions)]
        if all(b == blocks[0] for b in blocks):
            return p
    return None


@given(
    prefix=st.lists(st.integers(0, 3), max_size=12),
    body=st.lists(st.integers(0, 3), max_size=40),
    start=st.integers(0, 6),
    window=st.integers(1, 8),
    reps=st.integers(2, 4),
)
def test_rule_matches_the_brute_force_reading(
    prefix: list[int], body: list[int], start: int, window: int, reps: int
) -> None:
    tokens = prefix + body
    rule = LoopStop(window, reps)
    assert loop_period(tokens, start, rule) == brute(tokens, start, rule)


@given(
    pattern=st.lists(st.integers(0, 50), min_size=1, max_size=8),
    reps=st.integers(2, 5),
    lead=st.integers(0, 5),
)
def test_a_repeated_pattern_is_found(pattern: list[int], reps: int, lead: int) -> None:
    tokens = [99] * lead + pattern * reps
    p = loop_period(tokens, lead, LoopStop(8, reps))
    assert p is not None and len(pattern) % p == 0


def test_bad_rules_are_refused() -> None:
    for rule in (LoopStop(0, 3), LoopStop(257, 3), LoopStop(8, 1), LoopStop(8, 65)):
        with pytest.raises(InvalidRequestError, match="stop_on_loop"):
            JobSpec((1, 2), stop_on_loop=rule).validate(100)


POEMS = ("Write a poem about the queen.", "Write a poem about the sea.", "Write a song about a king.")
PLAIN = "Describe a cat in French."
RULE = LoopStop(16, 3)
MAX_NEW = 200


@pytest.mark.slow
def test_looping_poems_stop_where_the_rule_first_holds(smollm: LoadedModel) -> None:
    """Greedy float32: each job's output with stop_on_loop is its output without, cut at the first
    token where the rule holds; other jobs of the same batch are untouched."""
    gen = DynamicGenerator(smollm.model, smollm.tokenizer, GeneratorConfig(page_size=16, num_pages=512))
    prompts = [tuple(smollm.tokenizer.encode_chat([ChatMessage("user", t)])) for t in (*POEMS, PLAIN)]
    free = gen.generate([JobSpec(p, max_new_tokens=MAX_NEW) for p in prompts])
    mixed = [JobSpec(p, max_new_tokens=MAX_NEW, stop_on_loop=RULE) for p in prompts[:3]]
    mixed.append(JobSpec(prompts[3], max_new_tokens=MAX_NEW))  # no rule: runs as in `free`
    stopped = gen.generate(mixed)
    gen.close()
    loops = 0
    for prompt, f, s, spec in zip(prompts, free, stopped, mixed, strict=True):
        tokens = list(prompt) + list(f.token_ids)
        cut = next(
            (
                k
                for k in range(1, len(f.token_ids) + 1)
                if brute(tokens[: len(prompt) + k], len(prompt), RULE)
            ),
            None,
        )
        if spec.stop_on_loop is None or cut is None:
            assert s.token_ids == f.token_ids and s.finished.stop_reason == f.finished.stop_reason
        else:
            loops += 1
            assert s.finished.stop_reason is StopReason.LOOP
            assert s.token_ids == f.token_ids[:cut]
            assert f.finished.stop_reason is StopReason.MAX_NEW_TOKENS or len(f.token_ids) > cut
    assert loops >= 2  # the small model does loop on these prompts (all three here)


def test_the_wire_field_and_its_limits(tmp_path: Path) -> None:
    """Greedy on the tiny model, this prompt falls into a two-token loop after 36 tokens (other
    prompts loop on one token): with stop_on_loop the job ends there with STOP_REASON_LOOP, its
    tokens those of the same job without the rule, cut where the rule first holds."""
    server = start_tiny_server(write_servable_tiny_gguf(tmp_path / "tiny.gguf"))
    try:
        with server.client() as c:
            prompt = LOOPING_PROMPT
            free = collect(c.generate(Request(prompt, max_new_tokens=120, ignore_eos=True)))
            ids = prompt + list(free.token_ids)
            cut = next(
                (
                    k
                    for k in range(1, len(free.token_ids) + 1)
                    if brute(ids[: len(prompt) + k], len(prompt), RULE_SMALL)
                ),
                None,
            )
            assert cut is not None and cut < 120, free.token_ids  # the settings do loop
            result = collect(
                c.generate(Request(prompt, max_new_tokens=120, ignore_eos=True, stop_on_loop=(4, 3)))
            )
            assert result.finished.stop_reason == pb.STOP_REASON_LOOP
            assert list(result.token_ids) == list(free.token_ids[:cut])
            with pytest.raises(grpc.RpcError) as exc:
                collect(c.generate(Request(prompt, max_new_tokens=4, stop_on_loop=(0, 3))))
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert [v.field for v in error_details(exc.value).field_violations] == ["stop_on_loop.window"]
    finally:
        assert server.stop() == 0


LOOPING_PROMPT = [40, 82, 28, 189, 21]
RULE_SMALL = LoopStop(4, 3)
