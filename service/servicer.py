"""The dyngen.v1.Generator RPCs: validation at the door, then the engine client.

Status codes: a bad argument, or a prompt too long for the context or the cache, is
INVALID_ARGUMENT (the message names the field and the limit; retrying the same request
can never succeed, so not OUT_OF_RANGE); a full queue is RESOURCE_EXHAUSTED; an unknown
job is NOT_FOUND; a second stream of one job is FAILED_PRECONDITION; a stopped engine or
a draining server is UNAVAILABLE. Messages are written for callers; never a traceback.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TypeVar

import grpc
import structlog

from service.engine_client import EngineClient, EngineDownError, EngineRejectedError, JobChannel
from service.ipc import ErrorCode
from service.proto.dyngen.v1 import generator_pb2 as pb
from service.proto.dyngen.v1 import generator_pb2_grpc as pb_grpc

log = structlog.get_logger("dyngen.service")

Req = TypeVar("Req")
Resp = TypeVar("Resp")

_CODES = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.PROMPT_TOO_LONG: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.QUEUE_FULL: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
}


class GeneratorService(pb_grpc.GeneratorServicer):
    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine
        self.draining = False

    async def _submit(
        self,
        request: pb.GenerateRequest,
        context: grpc.aio.ServicerContext[Req, Resp],
        streamed: bool,
    ) -> JobChannel:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        try:
            return await self.engine.submit(request, streamed)
        except EngineRejectedError as exc:
            await context.abort(_CODES[exc.rejection.code], exc.rejection.message)
        except EngineDownError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    async def _events(
        self, job: JobChannel, context: grpc.aio.ServicerContext[Req, Resp]
    ) -> AsyncIterator[pb.GenerateEvent]:
        # Any way out of here (finished, caller gone, deadline, engine down) releases the job,
        # and an unfinished job is cancelled in the engine at once.
        try:
            while True:
                item = await job.events.get()
                if isinstance(item, EngineDownError):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(item))
                yield item
                if item.HasField("finished"):
                    f = item.finished
                    log.info(
                        "job_finished",
                        job_id=job.job_id,
                        stop_reason=pb.StopReason.Name(f.stop_reason),
                        prompt_tokens=f.prompt_tokens,
                        cached_tokens=f.cached_tokens,
                        new_tokens=f.new_tokens,
                        queued_s=round(f.timings.queued_seconds, 4),
                        prefill_s=round(f.timings.prefill_seconds, 4),
                        decode_s=round(f.timings.decode_seconds, 4),
                    )
                    return
        finally:
            if not job.finished:
                log.info("job_cancelled_by_caller", job_id=job.job_id)
            self.engine.release(job)

    async def Enqueue(
        self,
        request: pb.GenerateRequest,
        context: grpc.aio.ServicerContext[pb.GenerateRequest, pb.EnqueueResponse],
    ) -> pb.EnqueueResponse:
        job = await self._submit(request, context, streamed=False)
        return pb.EnqueueResponse(job_id=job.job_id, prompt_tokens=job.prompt_tokens)

    async def Stream(
        self, request: pb.StreamRequest, context: grpc.aio.ServicerContext[pb.StreamRequest, pb.GenerateEvent]
    ) -> AsyncIterator[pb.GenerateEvent]:
        try:
            job = self.engine.attach(request.job_id)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        if job is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no job {request.job_id!r} (unknown, or already ended)"
            )
        async for event in self._events(job, context):
            yield event

    async def Generate(
        self,
        request: pb.GenerateRequest,
        context: grpc.aio.ServicerContext[pb.GenerateRequest, pb.GenerateEvent],
    ) -> AsyncIterator[pb.GenerateEvent]:
        job = await self._submit(request, context, streamed=True)
        async for event in self._events(job, context):
            yield event

    async def Cancel(
        self,
        request: pb.CancelRequest,
        context: grpc.aio.ServicerContext[pb.CancelRequest, pb.CancelResponse],
    ) -> pb.CancelResponse:
        job = self.engine.jobs.get(request.job_id)
        if job is None or job.finished:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no running job {request.job_id!r}")
        self.engine.cancel(request.job_id)
        return pb.CancelResponse()

    async def GetModelInfo(
        self,
        request: pb.GetModelInfoRequest,
        context: grpc.aio.ServicerContext[pb.GetModelInfoRequest, pb.ModelInfo],
    ) -> pb.ModelInfo:
        try:
            return await self.engine.info()
        except EngineDownError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    async def Tokenize(
        self,
        request: pb.TokenizeRequest,
        context: grpc.aio.ServicerContext[pb.TokenizeRequest, pb.TokenizeResponse],
    ) -> pb.TokenizeResponse:
        try:
            return await self.engine.tokenize(request)
        except EngineRejectedError as exc:
            await context.abort(_CODES[exc.rejection.code], exc.rejection.message)
        except EngineDownError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
