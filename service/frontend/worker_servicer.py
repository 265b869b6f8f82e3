"""The gateway's worker contract, vllm.grpc.engine.VllmEngine (smg-grpc-proto), beside dyngen.v1.

A gateway (SMG: `smg launch --backend vllm --worker-urls grpc://...`) tokenizes, renders chats and
serves the OpenAI API itself, and calls this service for the rest: Generate on token ids, Abort,
health, model and server facts, loads, the tokenizer's files, and the prefix cache's KV events for
cache-aware routing. Requests go through the same path as dyngen.v1's (GeneratorService: limits,
authentication, the one JobSpec rule, the stream cap); worker_codec.py translates both ways.

A Generate whose caller goes away (the gateway drops the call when its client does) cancels the job
as an Abort does, so its pages are freed at once either way.
"""

from __future__ import annotations

import asyncio
import datetime
import math
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TypeVar

import grpc
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from dyngen_client.errors import ErrorReason
from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from service.frontend.engine_client import EngineBusyError
from service.frontend.engine_load import EngineLoadTracker
from service.frontend.event_buffer import EngineDownError
from service.frontend.job_channel import JobChannel
from service.frontend.kv_event_relay import KvEventRelay, RelayBatch
from service.frontend.limits import RequestError
from service.frontend.servicer import GeneratorService, Malformed, lenient, serialize, why_left
from service.frontend.tokenizer_bundle import TokenizerBundle
from service.frontend.worker_codec import (
    chunk,
    complete,
    engine_load,
    generate_request,
    kv_event,
    output_logprobs,
    sample_requests,
    scheduler_load,
)

Req = TypeVar("Req")
Resp = TypeVar("Resp")

WORKER_SERVICE_NAME = vpb.DESCRIPTOR.services_by_name["VllmEngine"].full_name
SERVER_TYPE = "dyngen-grpc"
HEARTBEAT_SECONDS = 1.0  # an idle KV event stream sends a load record this often
MAX_KV_SUBSCRIBERS = 16  # open SubscribeKvEvents streams (a gateway holds one per replica)
SNAPSHOT_CHUNK_BLOCKS = 512  # blocks per snapshot batch


class WorkerService:
    def __init__(self, jobs: GeneratorService, load: EngineLoadTracker, served_model_name: str) -> None:
        self.jobs = jobs
        self.engine = jobs.engine
        self.load = load
        load.on_change.append(self.engine.kv_events.notify_load)  # a load record when jobs start or end
        self.served_model_name = served_model_name
        self.started_at = time.monotonic()
        self.last_request_at = 0.0  # wall clock of the last Generate
        # (tenant, request_id) -> its samples' jobs, while it runs: a tenant's ids are its own, so
        # another tenant neither collides with them nor learns which are running.
        self.requests: dict[tuple[str, str], list[JobChannel]] = {}
        self.reserved: set[tuple[str, str]] = set()  # those whose Generate has not got its job yet
        self.kv_subscribers = 0
        self._bundle: tuple[str, TokenizerBundle] | None = None

    # -- Generate and Abort ----------------------------------------------------------------------

    async def Generate(
        self,
        request: vpb.GenerateRequest | Malformed,
        context: grpc.aio.ServicerContext[vpb.GenerateRequest, vpb.GenerateResponse],
    ) -> AsyncIterator[vpb.GenerateResponse]:
        jobs = self.jobs
        req = await jobs.parsed(request, context)
        tenant = await jobs.tenant_of(context)
        bounds = self.engine.bounds
        if bounds is None:
            await jobs.engine_down(context)
        try:
            inner = generate_request(req, bounds)
        except RequestError as exc:
            await jobs.invalid(context, exc)
        rid = req.request_id
        key = (tenant, rid)
        if key in self.requests or key in self.reserved:
            await jobs.fail(
                context,
                grpc.StatusCode.ALREADY_EXISTS,
                f"request_id {rid!r} is already running",
                ErrorReason.REQUEST_ID_IN_USE,
                "request_id",
            )
        if rid:
            self.reserved.add(key)  # before any await: a second call with this id is refused above
        self.last_request_at = time.time()
        samples: list[JobChannel] = []
        ended_by: BaseException | None = None
        try:
            await jobs.open_stream(context)
        except BaseException:
            self.reserved.discard(key)
            raise
        try:
            if inner.WhichOneof("prompt") == "text" and not inner.HasField("max_new_tokens"):
                # The contract's unset max_tokens runs to the end of the context: count the prompt.
                ids = await jobs.token_ids(inner, context)
                inner.token_ids.ids[:] = ids
                inner.max_new_tokens = max(1, bounds.request_tokens - len(ids))
            for sample in sample_requests(inner, max(1, req.sampling_params.n)):
                samples.append(await jobs.submit(sample, tenant, context, streamed=True))
            if rid:
                self.requests[key] = samples
            started = [pb.JobStarted() for _ in samples]
            output_ids: list[list[int]] = [[] for _ in samples]
            deltas: list[list[pb.TextDelta]] = [[] for _ in samples]
            async for i, event in self._merged(samples, context):
                match event.WhichOneof("event"):
                    case "started":
                        started[i] = event.started
                    case "delta" if req.stream:
                        if event.delta.token_ids:
                            yield chunk(event.delta, started[i], i)
                    case "delta":
                        output_ids[i].extend(event.delta.token_ids)
                        if inner.return_logprobs:
                            deltas[i].append(event.delta)
                    case "finished":
                        logprobs = (
                            output_logprobs(deltas[i]) if inner.return_logprobs and not req.stream else None
                        )
                        yield complete(event.finished, output_ids[i], logprobs, i)
        except BaseException as exc:
            ended_by = exc
            raise
        finally:
            jobs.open_streams -= 1
            self.reserved.discard(key)
            if samples and self.requests.get(key) is samples:
                del self.requests[key]
            why = why_left(context, ended_by) if any(not job.finished for job in samples) else ""
            for job in samples:  # a sample whose stream never started is cancelled here
                self.engine.release(job, why)

    async def _merged(
        self, samples: list[JobChannel], context: grpc.aio.ServicerContext[Req, Resp]
    ) -> AsyncIterator[tuple[int, pb.GenerateEvent]]:
        """The samples' events as they come, each with its sample's index; one sample's failure
        (its status already set on the call) ends the call. One sample: its events, no task."""
        if len(samples) == 1:
            async for event in self.jobs.job_events(samples[0], context):
                yield 0, event
            return
        queue: asyncio.Queue[tuple[int, pb.GenerateEvent | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, job: JobChannel) -> None:
            try:
                async for event in self.jobs.job_events(job, context):
                    queue.put_nowait((i, event))
                queue.put_nowait((i, None))
            except BaseException as exc:  # handed to the handler, which raises it
                queue.put_nowait((i, exc))

        tasks = [asyncio.create_task(pump(i, job)) for i, job in enumerate(samples)]
        try:
            running = len(samples)
            while running:
                i, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()

    async def Abort(
        self,
        request: vpb.AbortRequest | Malformed,
        context: grpc.aio.ServicerContext[vpb.AbortRequest, vpb.AbortResponse],
    ) -> vpb.AbortResponse:
        req = await self.jobs.parsed(request, context)
        tenant = await self.jobs.tenant_of(context)
        unknown: list[str] = []
        for rid in req.request_ids:
            samples = self.requests.get((tenant, rid))
            if samples is None:
                unknown.append(rid)
            else:
                for job in samples:
                    self.engine.cancel(job)
        if unknown:
            shown = ", ".join(repr(r[:64]) for r in unknown[:8])
            await self.jobs.fail(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"no running request with id {shown} (unknown, or already finished)",
                ErrorReason.JOB_NOT_FOUND,
                "request_ids",
            )
        return vpb.AbortResponse()

    # -- facts and health ------------------------------------------------------------------------

    async def HealthCheck(
        self,
        request: vpb.HealthCheckRequest | Malformed,
        context: grpc.aio.ServicerContext[vpb.HealthCheckRequest, vpb.HealthCheckResponse],
    ) -> vpb.HealthCheckResponse:
        await self.jobs.parsed(request, context)
        await self.jobs.tenant_of(context)
        if self.jobs.draining or self.jobs.leaving:
            return vpb.HealthCheckResponse(healthy=False, message="the server is shutting down")
        if not self.engine.ready:
            return vpb.HealthCheckResponse(
                healthy=False, message="the engine is not running (starting or restarting)"
            )
        return vpb.HealthCheckResponse(healthy=True, message="serving")

    async def _tokenizer(self, context: grpc.aio.ServicerContext[Req, Resp]) -> TokenizerBundle:
        """The engine's tokenizer folder, zipped once per folder (a restarted engine saves the same)."""
        folder = self.engine.tokenizer_dir
        if folder is None:
            await self.jobs.engine_down(context)
        if self._bundle is None or self._bundle[0] != folder:
            bundle = await asyncio.get_running_loop().run_in_executor(
                None, TokenizerBundle.from_folder, Path(folder)
            )
            self._bundle = (folder, bundle)
        return self._bundle[1]

    async def GetModelInfo(
        self,
        request: vpb.GetModelInfoRequest | Malformed,
        context: grpc.aio.ServicerContext[vpb.GetModelInfoRequest, vpb.GetModelInfoResponse],
    ) -> vpb.GetModelInfoResponse:
        await self.jobs.parsed(request, context)
        await self.jobs.tenant_of(context)
        info = await self.jobs.model_info(context)
        tok = await self._tokenizer(context)
        bounds = self.engine.bounds
        limit = bounds.request_tokens if bounds is not None else info.context_length
        reply = vpb.GetModelInfoResponse(
            model_path=info.model,
            is_generation=True,
            max_context_length=limit,
            vocab_size=info.vocab_size,
            served_model_name=self.served_model_name or info.model,
            model_type="llama",
            architectures=["LlamaForCausalLM"],
            eos_token_ids=tok.eos_token_ids,
            max_req_input_len=max(0, limit - 1),
        )
        if tok.bos_token_id is not None:
            reply.bos_token_id = tok.bos_token_id
        if tok.pad_token_id is not None:
            reply.pad_token_id = tok.pad_token_id
        return reply

    async def GetServerInfo(
        self,
        request: vpb.GetServerInfoRequest | Malformed,
        context: grpc.aio.ServicerContext[vpb.GetServerInfoRequest, vpb.GetServerInfoResponse],
    ) -> vpb.GetServerInfoResponse:
        await self.jobs.parsed(request, context)
        await self.jobs.tenant_of(context)
        info = await self.jobs.model_info(context)
        return vpb.GetServerInfoResponse(
            active_requests=sum(1 for j in self.engine.jobs.values() if not j.finished),
            is_paused=self.jobs.draining,
            last_receive_timestamp=self.last_request_at,
            uptime_seconds=time.monotonic() - self.started_at,
            server_type=SERVER_TYPE,
            data_parallel_size=1,
            kv_cache_dtype=self.engine.kv_cache_dtype,
            block_size=info.page_size,
            model_dtype=info.dtype,
            max_num_seqs=info.max_batch_size,
        )

    async def GetLoads(
        self,
        request: vpb.GetLoadsRequest | Malformed,
        context: grpc.aio.ServicerContext[vpb.GetLoadsRequest, vpb.GetLoadsResponse],
    ) -> vpb.GetLoadsResponse:
        req = await self.jobs.parsed(request, context)
        await self.jobs.tenant_of(context)
        if req.HasField("dp_rank") and req.dp_rank != 0:
            await self.jobs.fail(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"dp_rank: this worker has one rank (0), got {req.dp_rank}",
                ErrorReason.INVALID_ARGUMENT,
                "dp_rank",
            )
        return vpb.GetLoadsResponse(
            timestamp=datetime.datetime.now(datetime.UTC).isoformat(),
            version=SERVER_TYPE,
            dp_rank_count=1,
            loads=[scheduler_load(self.load.sample())],
        )

    async def GetTokenizer(
        self,
        request: cpb.GetTokenizerRequest | Malformed,
        context: grpc.aio.ServicerContext[cpb.GetTokenizerRequest, cpb.GetTokenizerChunk],
    ) -> AsyncIterator[cpb.GetTokenizerChunk]:
        await self.jobs.parsed(request, context)
        await self.jobs.tenant_of(context)
        bundle = await self._tokenizer(context)
        for data, digest in bundle.chunks():
            yield cpb.GetTokenizerChunk(data=data, sha256=digest)

    async def FlushCache(
        self,
        request: cpb.FlushCacheRequest | Malformed,
        context: grpc.aio.ServicerContext[cpb.FlushCacheRequest, cpb.FlushCacheResponse],
    ) -> cpb.FlushCacheResponse:
        await self.jobs.parsed(request, context)
        await self.jobs.tenant_of(context)
        if self.jobs.auth.enabled:
            await self.jobs.fail(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                "FlushCache would drop every tenant's cached prefix pages: it is only served without "
                "authentication (a worker behind a gateway, on a network only the gateway reaches)",
                ErrorReason.NOT_PERMITTED,
            )
        try:
            dropped = await self.engine.flush_cache()
        except (EngineBusyError, EngineDownError) as exc:
            await self.jobs.engine_failed(exc, context)
        return cpb.FlushCacheResponse(
            success=True,
            message=f"dropped {dropped} cached prefix pages; pages that running jobs hold stay",
        )

    async def _unimplemented(self, context: grpc.aio.ServicerContext[Req, Resp], text: str) -> None:
        await self.jobs.tenant_of(context)
        await self.jobs.fail(context, grpc.StatusCode.UNIMPLEMENTED, text, ErrorReason.UNSUPPORTED)

    async def Embed(
        self,
        request: vpb.EmbedRequest | Malformed,
        context: grpc.aio.ServicerContext[vpb.EmbedRequest, vpb.EmbedResponse],
    ) -> vpb.EmbedResponse:
        await self._unimplemented(context, "Embed: this worker serves a generative model only; no embeddings")
        return vpb.EmbedResponse()

    async def StartProfile(
        self,
        request: cpb.StartProfileRequest | Malformed,
        context: grpc.aio.ServicerContext[cpb.StartProfileRequest, cpb.ProfileResponse],
    ) -> cpb.ProfileResponse:
        await self._unimplemented(
            context,
            "StartProfile: not offered; profile with `python -m benchmarks host` on the server's machine",
        )
        return cpb.ProfileResponse()

    async def StopProfile(
        self,
        request: cpb.StopProfileRequest | Malformed,
        context: grpc.aio.ServicerContext[cpb.StopProfileRequest, cpb.ProfileResponse],
    ) -> cpb.ProfileResponse:
        await self._unimplemented(context, "StopProfile: not offered (no profile is ever started)")
        return cpb.ProfileResponse()

    # -- KV events -------------------------------------------------------------------------------

    async def SubscribeKvEvents(
        self,
        request: cpb.SubscribeKvEventsRequest | Malformed,
        context: grpc.aio.ServicerContext[cpb.SubscribeKvEventsRequest, cpb.KvEventBatch],
    ) -> AsyncIterator[cpb.KvEventBatch]:
        """The relay's batches from `start_sequence_number` (0: a snapshot of the current state, then
        every batch after it), each with the engine's load; a load record alone while idle. A cursor
        the relay cannot replay from is OUT_OF_RANGE (subscribe from 0); a subscriber that falls out
        of the history while streaming gets DATA_LOSS."""
        req = await self.jobs.parsed(request, context)
        await self.jobs.tenant_of(context)
        if self.kv_subscribers >= MAX_KV_SUBSCRIBERS:
            await self.jobs.fail(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.kv_subscribers} KV event streams are open, the server's limit",
                ErrorReason.TOO_MANY_STREAMS,
            )
        relay = self.engine.kv_events
        start = req.start_sequence_number
        replay = relay.since(start) if start > 0 else None
        if start > 0 and replay is None:
            await self.jobs.fail(
                context,
                grpc.StatusCode.OUT_OF_RANGE,
                f"start_sequence_number {start}: not in this server's history (last {relay.last_seq}); "
                "subscribe from 0 for a snapshot",
                ErrorReason.KV_EVENTS_GONE,
                "start_sequence_number",
            )
        self.kv_subscribers += 1
        serial = 0
        page_size = self.engine.bounds.page_size if self.engine.bounds is not None else 0
        try:
            version = relay.version
            if replay is None:
                # The snapshot and its cursor together, before any yield lets a batch in between.
                snapshot, cursor = self._snapshot(relay, page_size), relay.last_seq
                for batch in snapshot:
                    serial += 1
                    batch.load.CopyFrom(engine_load(self.load.sample(), serial, False))
                    yield batch
            else:
                cursor = start - 1
                sample = self.load.sample()
                for b in replay:
                    serial += 1
                    yield self._batch(b, page_size, engine_load(sample, serial, False))
                    cursor = b.seq
            sent_load = self.load.sample()
            sent_at = time.monotonic()
            while True:
                version = await relay.wait(version, HEARTBEAT_SECONDS)
                new = relay.since(cursor + 1)
                if new is None:
                    await self.jobs.fail(
                        context,
                        grpc.StatusCode.DATA_LOSS,
                        "this stream fell out of the server's KV event history; subscribe from 0",
                        ErrorReason.INVALID_ARGUMENT,
                    )
                sample = self.load.sample()
                for b in new:
                    serial += 1
                    yield self._batch(b, page_size, engine_load(sample, serial, False))
                    cursor = b.seq
                idle = time.monotonic() - sent_at >= HEARTBEAT_SECONDS
                if new:
                    sent_load, sent_at = sample, time.monotonic()
                elif (sample != sent_load or idle) and cursor > 0:
                    serial += 1
                    yield cpb.KvEventBatch(
                        sequence_number=cursor, timestamp=time.time(), load=engine_load(sample, serial, True)
                    )
                    sent_load, sent_at = sample, time.monotonic()
        finally:
            self.kv_subscribers -= 1

    @staticmethod
    def _batch(b: RelayBatch, page_size: int, load: cpb.EngineLoad) -> cpb.KvEventBatch:
        return cpb.KvEventBatch(
            sequence_number=b.seq,
            timestamp=b.timestamp,
            events=[kv_event(e, b.first_event_id + i, page_size) for i, e in enumerate(b.events)],
            load=load,
        )

    @staticmethod
    def _snapshot(relay: KvEventRelay, page_size: int) -> list[cpb.KvEventBatch]:
        """The relay's live blocks as snapshot chunks numbered up to its last batch (an AllBlocksCleared
        first); none before the relay has published anything."""
        last = relay.last_seq
        if last == 0:
            return []
        blocks = relay.live_blocks()
        count = min(last, max(1, math.ceil(len(blocks) / SNAPSHOT_CHUNK_BLOCKS)))
        per = max(1, math.ceil(len(blocks) / count))
        now = time.time()
        out = []
        for i in range(count):
            events = [kv_event(b, 0, page_size) for b in blocks[i * per : (i + 1) * per]]
            if i == 0:
                events.insert(0, cpb.KvCacheEvent(cleared=cpb.KvCacheCleared()))
            out.append(
                cpb.KvEventBatch(
                    sequence_number=last - count + 1 + i,
                    timestamp=now,
                    events=events,
                    snapshot=cpb.KvSnapshotChunk(index=i, count=count, blocks=len(blocks), unknown_before=0),
                )
            )
        return out


def worker_handler(service: WorkerService) -> grpc.GenericRpcHandler:
    """The worker contract's handlers, with request parsing that never raises."""
    unary = grpc.unary_unary_rpc_method_handler
    stream = grpc.unary_stream_rpc_method_handler
    handlers: dict[str, grpc.RpcMethodHandler[object, object]] = {
        "Generate": stream(service.Generate, lenient(vpb.GenerateRequest), serialize),
        "Abort": unary(service.Abort, lenient(vpb.AbortRequest), serialize),
        "HealthCheck": unary(service.HealthCheck, lenient(vpb.HealthCheckRequest), serialize),
        "GetModelInfo": unary(service.GetModelInfo, lenient(vpb.GetModelInfoRequest), serialize),
        "GetServerInfo": unary(service.GetServerInfo, lenient(vpb.GetServerInfoRequest), serialize),
        "GetLoads": unary(service.GetLoads, lenient(vpb.GetLoadsRequest), serialize),
        "GetTokenizer": stream(service.GetTokenizer, lenient(cpb.GetTokenizerRequest), serialize),
        "FlushCache": unary(service.FlushCache, lenient(cpb.FlushCacheRequest), serialize),
        "Embed": unary(service.Embed, lenient(vpb.EmbedRequest), serialize),
        "StartProfile": unary(service.StartProfile, lenient(cpb.StartProfileRequest), serialize),
        "StopProfile": unary(service.StopProfile, lenient(cpb.StopProfileRequest), serialize),
        "SubscribeKvEvents": stream(
            service.SubscribeKvEvents, lenient(cpb.SubscribeKvEventsRequest), serialize
        ),
    }
    return grpc.method_handlers_generic_handler(WORKER_SERVICE_NAME, handlers)
