"""Drive one reflected method with `concurrency` workers over `connections` channels, as ghz does.

Each worker sends one request at a time (rendered from the data template with its request
number) and records the call's latency and final status; for server-streaming calls it also
records when the first text delta arrived (TTFT) and the gaps between deltas. Work ends when
`total` requests have been sent, or at the end of `duration`, when calls still in flight are
cancelled and left out of the figures (ghz's -z).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from benchmarks.served.load_reflection import ReflectedMethod
from benchmarks.served.load_template import CallData, render_json

DELTA_FIELD = "delta"  # the streamed event that carries new text (dyngen.v1.GenerateEvent.delta)


@dataclass(frozen=True)
class Sample:
    start: float  # seconds from the run's start to the call's
    latency: float  # seconds, call start to final status
    status: str  # grpc.StatusCode name ("OK", "DEADLINE_EXCEEDED", ...)
    error: str  # the status message ("" when OK)
    first_token: float | None = None  # seconds to the first text delta (streams with deltas)
    token_gaps: tuple[float, ...] = ()  # seconds between consecutive deltas
    tokens: int = 0  # token ids the deltas carried


@dataclass(frozen=True)
class LoadPlan:
    target: str
    method: ReflectedMethod
    data: str  # JSON template of the request
    metadata: str | None = None  # JSON object template of request metadata
    concurrency: int = 50
    total: int | None = 200  # requests; None with a duration
    duration: float | None = None  # seconds; stops the run (ghz -z)
    timeout: float | None = 20.0  # seconds per call; None = no deadline
    connections: int = 1
    credentials: grpc.ChannelCredentials | None = None
    channel_options: tuple[tuple[str, int], ...] = field(
        default=(("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20))
    )


@dataclass(frozen=True)
class LoadRun:
    samples: tuple[Sample, ...]
    seconds: float  # wall time of the whole run
    cut_short: int  # calls in flight when the duration ended (cancelled, not in samples)


def build_request(plan: LoadPlan, data: CallData) -> tuple[Message, tuple[tuple[str, str], ...]]:
    """The request and metadata of one call (json_format.ParseError for data that does not fit)."""
    request = json_format.Parse(render_json(plan.data, data), plan.method.request_type())
    metadata: tuple[tuple[str, str], ...] = ()
    if plan.metadata:
        obj = json.loads(render_json(plan.metadata, data))
        metadata = tuple((str(k).lower(), str(v)) for k, v in obj.items())
    return request, metadata


def _delta_tokens(message: Message) -> int | None:
    """Token ids in a streamed message's text delta; None if it carries none."""
    if DELTA_FIELD not in message.DESCRIPTOR.fields_by_name or not message.HasField(DELTA_FIELD):
        return None
    delta = getattr(message, DELTA_FIELD)
    ids = getattr(delta, "token_ids", ())
    return len(ids)


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


async def _stream_call(
    channel: grpc.aio.Channel,
    plan: LoadPlan,
    request: Message,
    metadata: tuple[tuple[str, str], ...],
    t0: float,
) -> Sample:
    m = plan.method
    call = channel.unary_stream(
        m.path, request_serializer=_serialize, response_deserializer=m.response_type.FromString
    )(request, timeout=plan.timeout, metadata=metadata)
    start = time.perf_counter()
    first: float | None = None
    last = start
    gaps: list[float] = []
    tokens = 0
    try:
        async for message in call:
            n = _delta_tokens(message)
            if n is None:
                continue
            now = time.perf_counter()
            if first is None:
                first = now - start
            else:
                gaps.append(now - last)
            last = now
            tokens += n
        status, error = "OK", ""
    except grpc.aio.AioRpcError as exc:
        status, error = exc.code().name, exc.details() or ""
    finally:
        call.cancel()
    return Sample(start - t0, time.perf_counter() - start, status, error, first, tuple(gaps), tokens)


async def _unary_call(
    channel: grpc.aio.Channel,
    plan: LoadPlan,
    request: Message,
    metadata: tuple[tuple[str, str], ...],
    t0: float,
) -> Sample:
    m = plan.method
    call = channel.unary_unary(
        m.path, request_serializer=_serialize, response_deserializer=m.response_type.FromString
    )
    start = time.perf_counter()
    try:
        await call(request, timeout=plan.timeout, metadata=metadata)
        status, error = "OK", ""
    except grpc.aio.AioRpcError as exc:
        status, error = exc.code().name, exc.details() or ""
    return Sample(start - t0, time.perf_counter() - start, status, error)


def _channel(plan: LoadPlan) -> grpc.aio.Channel:
    options = list(plan.channel_options)
    if plan.credentials is not None:
        return grpc.aio.secure_channel(plan.target, plan.credentials, options)
    return grpc.aio.insecure_channel(plan.target, options)


async def run_load(plan: LoadPlan, progress: Callable[[int], None] | None = None) -> LoadRun:
    if plan.method.client_streaming:
        raise ValueError(f"{plan.method.path} takes a request stream; only unary requests are supported")
    channels = [_channel(plan) for _ in range(plan.connections)]
    call = _stream_call if plan.method.server_streaming else _unary_call
    numbers = itertools.count()
    samples: list[Sample] = []
    in_flight = 0
    t0 = time.perf_counter()

    async def worker(index: int) -> None:
        nonlocal in_flight
        connection = index % len(channels)
        while True:
            number = next(numbers)
            if plan.duration is None and plan.total is not None and number >= plan.total:
                return
            request, metadata = build_request(plan, CallData(number, f"g{index}c{connection}"))
            in_flight += 1
            try:
                samples.append(await call(channels[connection], plan, request, metadata, t0))
            finally:
                in_flight -= 1
            if progress is not None:
                progress(len(samples))

    workers = [asyncio.ensure_future(worker(i)) for i in range(plan.concurrency)]
    cut_short = 0
    try:
        if plan.duration is None:
            await asyncio.gather(*workers)
        else:
            _, pending = await asyncio.wait(workers, timeout=plan.duration)
            cut_short = in_flight
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    finally:
        for task in workers:
            task.cancel()
        for channel in channels:
            await channel.close()
    return LoadRun(tuple(samples), time.perf_counter() - t0, cut_short)
