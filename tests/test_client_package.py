"""The client package on its own: requests as protos, results from events, error details both ways."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from dyngen_client import Chat, ErrorReason, Request, Sampling, acollect, collect, pb
from dyngen_client.cli import main as client_main
from dyngen_client.errors import Failure, details_from_status


def test_request_sets_only_what_was_given() -> None:
    req = Request(
        Chat.user("Hi"),
        max_new_tokens=8,
        sampling=Sampling(temperature=0.0, seed=3, logit_bias=((5, -1.5),), banned_token_ids=(7,)),
        stop_strings=("\n",),
        identifier="tag",
    ).to_proto()
    assert req.WhichOneof("prompt") == "chat"
    assert [(m.role, m.content) for m in req.chat.messages] == [("user", "Hi")]
    assert req.HasField("max_new_tokens") and req.max_new_tokens == 8
    # 0 is a real temperature (greedy): it is sent; what was not given stays unset.
    assert req.sampling.HasField("temperature") and not req.sampling.HasField("top_p")
    assert req.sampling.seed == 3 and list(req.sampling.banned_token_ids) == [7]
    assert [(b.token_id, b.bias) for b in req.sampling.logit_bias] == [(5, -1.5)]
    assert not Request("x").to_proto().HasField("max_new_tokens")
    assert list(Request([1, 2, 3]).to_proto().token_ids.ids) == [1, 2, 3]


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (
            lambda: Request("x", max_new_tokens=-1),
            r"max_new_tokens must be an integer in \[0, 4294967295\] \(uint32\), got -1",
        ),
        (lambda: Request([1, -2]), r"token_ids.ids\[1\] must be an integer"),
        (lambda: Request("x", stop_token_ids=(1, 2**40)), r"stop_token_ids\[1\] must be"),
        (
            lambda: Request("x", priority=2**31),
            r"priority must be an integer in \[-2147483648, 2147483647\] \(int32\)",
        ),
        (lambda: Request("x", stop_on_loop=(-1, 2)), r"stop_on_loop.window must be"),
        (lambda: Sampling(top_k=-1), r"sampling.top_k must be"),
        (lambda: Sampling(seed=-1), r"sampling.seed must be an integer in \[0, 18446744073709551615\]"),
        (lambda: Sampling(logit_bias=((3, 1.0), (-1, 1.0))), r"sampling.logit_bias\[1\].token_id must be"),
        (lambda: Request("x", top_logprobs=1.5), r"top_logprobs must be an integer"),  # type: ignore[arg-type]
    ],
)
def test_a_value_its_field_cannot_hold_is_refused_naming_the_field(make: object, words: str) -> None:
    """protobuf itself would say only "Value out of range: -1"."""
    assert callable(make)
    with pytest.raises(ValueError, match=words):
        make()


def test_collect_joins_deltas_and_the_held_back_tail() -> None:
    events = [
        pb.GenerateEvent(job_id="j", started=pb.JobStarted(prompt_tokens=3)),
        pb.GenerateEvent(job_id="j", delta=pb.TextDelta(text="Hel", token_ids=[1])),
        pb.GenerateEvent(job_id="j", delta=pb.TextDelta(text="lo", token_ids=[2])),
        pb.GenerateEvent(
            job_id="j",
            finished=pb.JobFinished(stop_reason=pb.STOP_REASON_STOP_STRING, text="!", new_tokens=2),
        ),
    ]
    result = collect(events)
    assert (result.job_id, result.text, result.token_ids) == ("j", "Hello!", (1, 2))
    assert result.stop_reason == "stop_string"

    async def stream() -> AsyncIterator[pb.GenerateEvent]:
        for e in events:
            yield e

    assert asyncio.run(acollect(stream())) == result  # the same over asyncio


def test_error_details_round_trip_through_the_status_trailer() -> None:
    limit = Failure(
        grpc.StatusCode.INVALID_ARGUMENT, "too long", ErrorReason.LIMIT_EXCEEDED, "stop_strings[2]"
    )
    d = details_from_status(limit.code, limit.message, limit.status().SerializeToString())
    assert d.reason is ErrorReason.LIMIT_EXCEEDED and not d.retryable
    assert [(v.field, v.description) for v in d.field_violations] == [("stop_strings[2]", "too long")]
    full = Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", ErrorReason.QUEUE_FULL)
    d = details_from_status(full.code, full.message, full.status().SerializeToString())
    assert d.reason is ErrorReason.QUEUE_FULL and d.retry_delay_seconds == 1.0 and not d.field_violations
    # No trailer, or one that does not parse: the status alone.
    assert details_from_status(grpc.StatusCode.INTERNAL, "x", None).reason is None
    assert details_from_status(grpc.StatusCode.INTERNAL, "x", b"\xff\xff").field_violations == ()


def test_client_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "prompts.jsonl"
    bad.write_text(json.dumps({"text": "no prompt key"}) + "\n")
    assert client_main(["generate", "--prompts-file", str(bad), "--server", "127.0.0.1:1"]) == 2
    assert (
        capsys.readouterr().err.strip()
        == f'dyngen-client: error: {bad}:1: expected an object with a string "prompt"'
    )
    assert client_main(["generate", "Hi", "--server", ""]) == 2
    assert "give --server" in capsys.readouterr().err
