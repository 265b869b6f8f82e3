"""Typed clients of dyngen.v1.Generator: `Client` (blocking) and `AsyncClient` (asyncio).

`generate()` yields the job's events; `enqueue/stream/cancel`, `model_info` and `tokenize`
map one to one onto the RPCs. gRPC errors surface as `grpc.RpcError` (sync) or
`grpc.aio.AioRpcError` (async) with the server's status; `error_details(exc)` reads the
reason, field violations and retry delay they carry. A stream cut without any status (its
replica died behind a balancer) is raised as UNAVAILABLE with the reason REPLICA_LOST.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterable, Generator, Iterator
from contextlib import aclosing

import grpc

from dyngen_client.affinity import DEFAULT_AFFINITY_CHARS, affinity_metadata
from dyngen_client.errors import StreamCutError, is_stream_cut, stream_cut_aio_error
from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from dyngen_client.proto.dyngen.v1 import generator_pb2_grpc as pb_grpc
from dyngen_client.request import Chat, Request, tokenize_request
from dyngen_client.result import Event

DEFAULT_MAX_MESSAGE_BYTES = 4 << 20  # the server's default --max-message-bytes
SERVICE = pb.DESCRIPTOR.services_by_name["Generator"].full_name


def tls_credentials(
    ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None
) -> grpc.ChannelCredentials:
    """TLS to the server: `ca_file` verifies it (default: the system's roots); `cert_file` and
    `key_file` present a client certificate (a server with --tls-client-ca requires one)."""

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()

    if (cert_file is None) != (key_file is None):
        raise ValueError("a client certificate needs both cert_file and key_file")
    return grpc.ssl_channel_credentials(read(ca_file), read(key_file), read(cert_file))


def _auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


def _events(call: Iterator[pb.GenerateEvent]) -> Generator[pb.GenerateEvent, None, None]:
    try:
        yield from call
    except grpc.RpcError as exc:
        if is_stream_cut(exc):
            raise StreamCutError(exc) from exc
        raise


async def _aio_events(call: AsyncIterable[pb.GenerateEvent]) -> AsyncGenerator[pb.GenerateEvent, None]:
    try:
        async for event in call:
            yield event
    except grpc.aio.AioRpcError as exc:
        if is_stream_cut(exc):
            raise stream_cut_aio_error(exc) from exc
        raise


MAX_RETRIES = 4  # gRPC's retry policy allows at most 5 attempts of a call


def retry_service_config(retries: int) -> str:
    """gRPC's service config for `retries` more attempts of every Generator call refused with
    RESOURCE_EXHAUSTED or UNAVAILABLE, each after the delay the server gives (its RetryInfo, sent too
    as gRPC's retry pushback). A stream is retried only before its first event, so no event comes
    twice; a refusal without a delay (a client-side limit) backs off from 1 s."""
    if not 0 <= retries <= MAX_RETRIES:
        raise ValueError(f"retries must be in [0, {MAX_RETRIES}], got {retries}")
    policy = {
        "maxAttempts": retries + 1,
        "initialBackoff": "1s",
        "maxBackoff": "30s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["RESOURCE_EXHAUSTED", "UNAVAILABLE"],
    }
    return json.dumps({"methodConfig": [{"name": [{"service": SERVICE}], "retryPolicy": policy}]})


def _options(max_message_bytes: int, retries: int = 0) -> list[tuple[str, int | str]]:
    options: list[tuple[str, int | str]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]
    if retries:
        options += [("grpc.enable_retries", 1), ("grpc.service_config", retry_service_config(retries))]
    return options


class Client:
    """Blocking client. Use as a context manager, or call close().

    `credentials`: TLS (see `tls_credentials`); `token`: a bearer token sent with every call;
    `retries`: how many times a call refused with a retry delay (RESOURCE_EXHAUSTED, UNAVAILABLE) is
    tried again after that delay (0, the default: never; see `retry_service_config`).
    """

    def __init__(
        self,
        target: str,
        credentials: grpc.ChannelCredentials | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        token: str | None = None,
        affinity_chars: int | None = DEFAULT_AFFINITY_CHARS,
        retries: int = 0,
    ) -> None:
        self.metadata = _auth_metadata(token)
        # Generate and Enqueue carry the prefix-affinity key of their prompt (None: no key).
        self.affinity_chars = affinity_chars
        opts = _options(max_message_bytes, retries)
        self.channel = (
            grpc.secure_channel(target, credentials, opts)
            if credentials is not None
            else grpc.insecure_channel(target, opts)
        )
        self.stub = pb_grpc.GeneratorStub(self.channel)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _job_metadata(self, request: Request) -> tuple[tuple[str, str], ...]:
        return self.metadata + affinity_metadata(request.prompt, self.affinity_chars)

    def close(self) -> None:
        self.channel.close()

    def generate(self, request: Request, timeout: float | None = None) -> Generator[Event, None, None]:
        """The job's events. Closing the generator cancels the call and so the job: close() it, or
        leave a loop over it early when nothing else holds it (Python closes it then); one kept in a
        variable runs on until closed or collected."""
        call = self.stub.Generate(request.to_proto(), timeout=timeout, metadata=self._job_metadata(request))
        try:
            yield from _events(call)
        finally:
            call.cancel()

    def enqueue(self, request: Request, timeout: float | None = None) -> str:
        return str(
            self.stub.Enqueue(
                request.to_proto(), timeout=timeout, metadata=self._job_metadata(request)
            ).job_id
        )

    def stream(self, job_id: str, timeout: float | None = None) -> Generator[Event, None, None]:
        call = self.stub.Stream(pb.StreamRequest(job_id=job_id), timeout=timeout, metadata=self.metadata)
        try:
            yield from _events(call)
        finally:
            call.cancel()

    def cancel(self, job_id: str, timeout: float | None = None) -> None:
        self.stub.Cancel(pb.CancelRequest(job_id=job_id), timeout=timeout, metadata=self.metadata)

    def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout, metadata=self.metadata)

    def tokenize(self, prompt: str | Chat, timeout: float | None = None) -> list[int]:
        return list(
            self.stub.Tokenize(tokenize_request(prompt), timeout=timeout, metadata=self.metadata).token_ids
        )

    def load_adapter(self, name: str, path: str, timeout: float | None = None) -> pb.AdapterInfo:
        """Load a LoRA adapter (a PEFT folder on the server's disk) for requests to name."""
        request = pb.LoadAdapterRequest(name=name, path=path)
        return self.stub.LoadAdapter(request, timeout=timeout, metadata=self.metadata)

    def unload_adapter(self, name: str, timeout: float | None = None) -> None:
        """Unload an adapter (FAILED_PRECONDITION while jobs run with it)."""
        self.stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name), timeout=timeout, metadata=self.metadata)

    def list_adapters(self, timeout: float | None = None) -> list[pb.AdapterInfo]:
        reply = self.stub.ListAdapters(pb.ListAdaptersRequest(), timeout=timeout, metadata=self.metadata)
        return list(reply.adapters)


class AsyncClient:
    """asyncio client over grpc.aio. Use as an async context manager, or await close(). The
    arguments are Client's."""

    def __init__(
        self,
        target: str,
        credentials: grpc.ChannelCredentials | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        token: str | None = None,
        affinity_chars: int | None = DEFAULT_AFFINITY_CHARS,
        retries: int = 0,
    ) -> None:
        self.metadata = _auth_metadata(token)
        # Generate and Enqueue carry the prefix-affinity key of their prompt (None: no key).
        self.affinity_chars = affinity_chars
        opts = _options(max_message_bytes, retries)
        self.channel = (
            grpc.aio.secure_channel(target, credentials, opts)
            if credentials is not None
            else grpc.aio.insecure_channel(target, opts)
        )
        self.stub = pb_grpc.GeneratorStub(self.channel)  # typed as GeneratorAsyncStub for an aio channel

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _job_metadata(self, request: Request) -> tuple[tuple[str, str], ...]:
        return self.metadata + affinity_metadata(request.prompt, self.affinity_chars)

    async def close(self) -> None:
        await self.channel.close()

    async def generate(self, request: Request, timeout: float | None = None) -> AsyncGenerator[Event, None]:
        """The job's events; aclose() (or leaving the loop and dropping it) cancels the call."""
        call = self.stub.Generate(request.to_proto(), timeout=timeout, metadata=self._job_metadata(request))
        try:
            async with aclosing(_aio_events(call)) as events:
                async for event in events:
                    yield event
        finally:
            call.cancel()

    async def enqueue(self, request: Request, timeout: float | None = None) -> str:
        return str(
            (
                await self.stub.Enqueue(
                    request.to_proto(), timeout=timeout, metadata=self._job_metadata(request)
                )
            ).job_id
        )

    async def stream(self, job_id: str, timeout: float | None = None) -> AsyncGenerator[Event, None]:
        call = self.stub.Stream(pb.StreamRequest(job_id=job_id), timeout=timeout, metadata=self.metadata)
        try:
            async with aclosing(_aio_events(call)) as events:
                async for event in events:
                    yield event
        finally:
            call.cancel()

    async def cancel(self, job_id: str, timeout: float | None = None) -> None:
        await self.stub.Cancel(pb.CancelRequest(job_id=job_id), timeout=timeout, metadata=self.metadata)

    async def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout, metadata=self.metadata)

    async def tokenize(self, prompt: str | Chat, timeout: float | None = None) -> list[int]:
        response = await self.stub.Tokenize(tokenize_request(prompt), timeout=timeout, metadata=self.metadata)
        return list(response.token_ids)

    async def load_adapter(self, name: str, path: str, timeout: float | None = None) -> pb.AdapterInfo:
        """Load a LoRA adapter (a PEFT folder on the server's disk) for requests to name."""
        request = pb.LoadAdapterRequest(name=name, path=path)
        return await self.stub.LoadAdapter(request, timeout=timeout, metadata=self.metadata)

    async def unload_adapter(self, name: str, timeout: float | None = None) -> None:
        """Unload an adapter (FAILED_PRECONDITION while jobs run with it)."""
        await self.stub.UnloadAdapter(
            pb.UnloadAdapterRequest(name=name), timeout=timeout, metadata=self.metadata
        )

    async def list_adapters(self, timeout: float | None = None) -> list[pb.AdapterInfo]:
        reply = await self.stub.ListAdapters(
            pb.ListAdaptersRequest(), timeout=timeout, metadata=self.metadata
        )
        return list(reply.adapters)
