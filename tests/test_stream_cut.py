"""A stream cut without a gRPC status (a replica dying behind a balancer) reaches the clients'
callers as UNAVAILABLE / REPLICA_LOST, retryable; plain grpcio sees UNKNOWN. The cut is the one
HAProxy 2.6 makes (tests/stream_cut_server.py); tests/test_scaleout.py makes it for real."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from dyngen_client import AsyncClient, Client, ErrorReason, Request, error_details, pb
from dyngen_client.errors import is_stream_cut
from tests.stream_cut_server import StreamCutServer

pytestmark = pytest.mark.timeout(60)


def test_plain_grpc_sees_a_cut_as_unknown() -> None:
    with StreamCutServer() as server, Client(server.target) as client:
        call = client.stub.Generate(Request("hi").to_proto(), timeout=10)
        with pytest.raises(grpc.RpcError) as caught:
            list(call)
    assert caught.value.code() is grpc.StatusCode.UNKNOWN
    assert is_stream_cut(caught.value)


@pytest.mark.parametrize("via", ["generate", "stream"])
def test_the_client_raises_a_cut_as_unavailable_replica_lost(via: str) -> None:
    with StreamCutServer() as server, Client(server.target) as client:
        events = (
            client.generate(Request("hi"), timeout=10) if via == "generate" else client.stream("0" * 32, 10)
        )
        seen: list[pb.GenerateEvent] = []
        with pytest.raises(grpc.RpcError) as caught:
            seen.extend(events)
    assert [e.job_id for e in seen] == ["cut"]  # what arrived before the cut is delivered
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
    d = error_details(caught.value)
    assert d.code is grpc.StatusCode.UNAVAILABLE and d.reason is ErrorReason.REPLICA_LOST
    assert d.retryable and d.retry_delay_seconds == 0.0
    assert "Stream removed" in d.message
    assert not is_stream_cut(caught.value)


def test_the_async_client_raises_a_cut_as_unavailable_replica_lost() -> None:
    async def run() -> grpc.aio.AioRpcError:
        async with AsyncClient(server.target) as client:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in client.generate(Request("hi"), timeout=10):
                    pass
            return caught.value

    with StreamCutServer() as server:
        error = asyncio.run(run())
    assert error.code() is grpc.StatusCode.UNAVAILABLE
    d = error_details(error)
    assert d.reason is ErrorReason.REPLICA_LOST and d.retryable


def test_server_statuses_are_not_cuts() -> None:
    """UNKNOWN or INTERNAL from a server (with or without its details trailer) stay as they are."""

    class Failed(grpc.RpcError):
        def __init__(self, code: grpc.StatusCode, details: str) -> None:
            self._code, self._details = code, details

        def code(self) -> grpc.StatusCode:
            return self._code

        def details(self) -> str:
            return self._details

        def trailing_metadata(self) -> tuple[grpc._Metadatum, ...]:
            return ()

    assert is_stream_cut(
        Failed(grpc.StatusCode.UNKNOWN, "Stream removed (Data frame with END_STREAM flag received)")
    )
    assert is_stream_cut(Failed(grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2"))
    assert not is_stream_cut(Failed(grpc.StatusCode.UNKNOWN, "Exception iterating responses: boom"))
    assert not is_stream_cut(Failed(grpc.StatusCode.CANCELLED, "Received RST_STREAM with error code 8"))
    assert not is_stream_cut(Failed(grpc.StatusCode.UNAVAILABLE, "Socket closed"))
