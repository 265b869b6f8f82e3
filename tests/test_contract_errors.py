"""The google.rpc.Status details of real errors, read with both Python clients (the Node.js client
reads the same trailer in tests/test_client_node.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from dyngen_client import AsyncClient, Chat, ErrorReason, Request, collect, error_details
from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from tests.service_harness import ServerProcess, start_tiny_server
from tests.tiny_service_model import write_servable_tiny_gguf

pytestmark = pytest.mark.timeout(300)

LONG = Request(Chat.user("Tell me a very long story."), max_new_tokens=4000, ignore_eos=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = write_servable_tiny_gguf(tmp_path_factory.mktemp("errors") / "tiny.gguf")
    s = start_tiny_server(model, "--max-streams", "1")
    yield s
    assert s.stop() == 0


def test_sync_client_reads_field_violations_and_reasons(server: ServerProcess) -> None:
    with server.client() as client:
        with pytest.raises(grpc.RpcError) as bad:
            collect(client.generate(Request("Hi", stop_strings=tuple(f"s{i}" for i in range(17)))))
        d = error_details(bad.value)
        assert d.code is grpc.StatusCode.INVALID_ARGUMENT and d.reason is ErrorReason.LIMIT_EXCEEDED
        assert [v.field for v in d.field_violations] == ["stop_strings"] and not d.retryable
        with pytest.raises(grpc.RpcError) as missing:
            client.cancel("0" * 32)
        d = error_details(missing.value)
        assert d.code is grpc.StatusCode.NOT_FOUND and d.reason is ErrorReason.JOB_NOT_FOUND
        with pytest.raises(grpc.RpcError) as malformed:
            client.cancel("not-a-job-id")
        assert [v.field for v in error_details(malformed.value).field_violations] == ["job_id"]


def _bad(**fields: object) -> pb.GenerateRequest:
    req = pb.GenerateRequest(text="Hi", max_new_tokens=4)
    for path, value in fields.items():
        target: Any = req
        *parents, name = path.split("__")
        for parent in parents:
            target = getattr(target, parent)
        if isinstance(value, list):
            getattr(target, name).extend(value)
        else:
            setattr(target, name, value)
    return req


JSON_BAD = pb.GenerateRequest(text="Hi", max_new_tokens=4)
JSON_BAD.response_format.json_schema = '{"type": "object", "properties": 7}'
REGEX_BAD = pb.GenerateRequest(text="Hi", max_new_tokens=4)
REGEX_BAD.response_format.regex = "(unclosed"
GBNF_UNDEFINED = pb.GenerateRequest(text="Hi", max_new_tokens=4)
GBNF_UNDEFINED.response_format.gbnf_grammar = "root ::= item"  # a rule never defined
HEALED_FORMAT = pb.GenerateRequest(text="Hi", max_new_tokens=4, token_healing=True)
HEALED_FORMAT.response_format.regex = "a+"

# Each value the service can never run, and the field its BadRequest names: checked in the front
# end by the engine's rule (JobSpec.check), or refused by the engine (a grammar that does not compile).
FIELD_OF: list[tuple[pb.GenerateRequest, str]] = [
    (_bad(max_new_tokens=0), "max_new_tokens"),
    (_bad(min_new_tokens=9), "min_new_tokens"),
    (_bad(sampling__temperature=-1.0), "sampling.temperature"),
    (_bad(sampling__temperature=float("nan")), "sampling.temperature"),
    (_bad(sampling__top_p=0.0), "sampling.top_p"),
    (_bad(sampling__min_p=1.0), "sampling.min_p"),
    (_bad(sampling__typical=0.0), "sampling.typical"),
    (_bad(sampling__repetition_penalty=0.0), "sampling.repetition_penalty"),
    (_bad(sampling__frequency_penalty=float("inf")), "sampling.frequency_penalty"),
    (_bad(sampling__logit_bias=[pb.LogitBias(token_id=10**6, bias=1.0)]), "sampling.logit_bias[0].token_id"),
    (_bad(sampling__logit_bias=[pb.LogitBias(token_id=1, bias=500.0)]), "sampling.logit_bias[0].bias"),
    (
        _bad(sampling__logit_bias=[pb.LogitBias(token_id=1, bias=1.0), pb.LogitBias(token_id=1, bias=2.0)]),
        "sampling.logit_bias[1].token_id",
    ),
    (_bad(sampling__banned_token_ids=[10**6]), "sampling.banned_token_ids"),
    (_bad(top_logprobs=21, return_logprobs=True), "top_logprobs"),
    (_bad(stop_strings=["x", ""]), "stop_strings[1]"),
    (_bad(banned_strings=[""]), "banned_strings[0]"),
    (_bad(stop_token_ids=[10**6]), "stop_token_ids"),
    (_bad(text=""), "text"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 10**6]), max_new_tokens=4), "token_ids"),
    (JSON_BAD, "response_format.json_schema"),
    (REGEX_BAD, "response_format.regex"),
    (GBNF_UNDEFINED, "response_format.gbnf_grammar"),
    (HEALED_FORMAT, "token_healing"),
]


@pytest.mark.parametrize(("request_", "field"), FIELD_OF, ids=[f for _, f in FIELD_OF])
def test_every_invalid_value_names_its_field(
    server: ServerProcess, request_: pb.GenerateRequest, field: str
) -> None:
    with server.client() as client:
        with pytest.raises(grpc.RpcError) as bad:
            list(client.stub.Generate(request_, timeout=60))
        d = error_details(bad.value)
        assert d.code is grpc.StatusCode.INVALID_ARGUMENT, d
        assert [v.field for v in d.field_violations] == [field], bad.value.details()


def test_async_client_reads_retry_info_past_the_stream_limit(server: ServerProcess) -> None:
    async def run() -> None:
        async with AsyncClient(server.target) as client:
            events = client.generate(LONG)
            first = await events.__anext__()  # one stream open: the server's limit
            assert first.HasField("started")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                [e async for e in client.generate(LONG)]
            d = error_details(refused.value)
            assert d.code is grpc.StatusCode.RESOURCE_EXHAUSTED and d.reason is ErrorReason.TOO_MANY_STREAMS
            assert d.retry_delay_seconds == 1.0
            await events.aclose()  # cancels the open stream's call, and so its job

    asyncio.run(run())


def test_unknown_reasons_and_domains_are_not_guessed() -> None:
    from google.protobuf import any_pb2
    from google.rpc import error_details_pb2, status_pb2

    from dyngen_client.errors import details_from_status

    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.ErrorInfo(reason="QUEUE_FULL", domain="someone.else"))
    status = status_pb2.Status(code=8, message="x", details=[detail])
    d = details_from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "x", status.SerializeToString())
    assert d.reason is None and d.retry_delay_seconds is None


def test_a_job_that_fails_in_the_engine_sends_its_finish_event_then_the_status(server: ServerProcess) -> None:
    """Its finish event carries STOP_REASON_ERROR, the error and the status code; the stream then
    ends with that status (JOB_FAILED). A regex that can only spell a banned string fails in the
    engine whatever the model."""
    request = pb.GenerateRequest(text="Hi", max_new_tokens=8, banned_strings=["abc"])
    request.response_format.regex = "abc"
    events: list[pb.GenerateEvent] = []
    with server.client() as client, pytest.raises(grpc.RpcError) as failed:
        for event in client.stub.Generate(request, timeout=60):
            events.append(event)
    d = error_details(failed.value)
    assert d.reason is ErrorReason.JOB_FAILED, d
    assert [e.WhichOneof("event") for e in events][-1] == "finished"
    finished = events[-1].finished
    assert finished.stop_reason == pb.STOP_REASON_ERROR and "banned strings" in finished.error
    assert finished.error_code == failed.value.code().value[0]
