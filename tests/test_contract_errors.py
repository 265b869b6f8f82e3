"""The google.rpc.Status details of real errors, read with both Python clients (the Node.js client
reads the same trailer in tests/test_client_node.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest

from dyngen_client import AsyncClient, Chat, ErrorReason, Request, collect, error_details
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
