"""The dyngen.v1.Generator RPCs: parse, authenticate, limit, tokenize, then the engine client.

Status codes: a malformed message (bad wire bytes, invalid UTF-8), a broken limit, a bad
argument, or a prompt too long for the context or the cache is INVALID_ARGUMENT (the
message names the field and the limit; retrying the same request can never succeed, so
not OUT_OF_RANGE); a full queue, too many open streams or too many waiting calls is
RESOURCE_EXHAUSTED; an unknown job, or another tenant's, is NOT_FOUND; a second stream of
one job is FAILED_PRECONDITION; a stopped engine or a draining server is UNAVAILABLE; a
job that failed inside the engine ends its stream with the status the engine chose
(INTERNAL, or INVALID_ARGUMENT for input it could not handle); no credentials with
authentication on is UNAUTHENTICATED. Messages are written for callers; never a traceback.
Every one of them also carries a google.rpc.Status in its trailers (dyngen_client.errors.Failure):
a stable reason, the field to blame, and how long to wait before retrying where that helps.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import NoReturn, TypeVar

import grpc
import structlog
from google.protobuf.message import DecodeError, Message

from dyngen_client.affinity import AFFINITY_HEADER, chat_text, ids_text, text_key
from dyngen_client.errors import ErrorReason, Failure
from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from engine import defaults
from engine.adapters.adapter_folder import AdapterPathError, check_relative_path
from engine.errors import InvalidRequestError
from engine.jobs import JobSpec
from service.frontend.auth import Authenticator, cache_salt
from service.frontend.codec import job_spec, max_new_tokens
from service.frontend.drain_rate import DrainRate
from service.frontend.engine_client import EngineBusyError, EngineClient, EngineRejectedError
from service.frontend.event_buffer import EngineDownError
from service.frontend.job_channel import JobChannel, short_id
from service.frontend.limits import (
    Limits,
    RequestError,
    check_adapter_name,
    check_job_id,
    check_negative_prompt_ids,
    check_prompt_embeddings,
    check_request,
    check_spec,
    check_tokenize_request,
    request_field,
)
from service.frontend.tenant_adapters import TenantAdapters, caller_name, unscoped
from service.ipc import AdapterCommand, AdapterOp, ErrorCode

log = structlog.get_logger("dyngen.service")

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Msg = TypeVar("Msg", bound=Message)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generator"].full_name

_CODES = {
    ErrorCode.INVALID_ARGUMENT: (grpc.StatusCode.INVALID_ARGUMENT, ErrorReason.INVALID_ARGUMENT),
    ErrorCode.PROMPT_TOO_LONG: (grpc.StatusCode.INVALID_ARGUMENT, ErrorReason.PROMPT_TOO_LONG),
    ErrorCode.QUEUE_FULL: (grpc.StatusCode.RESOURCE_EXHAUSTED, ErrorReason.QUEUE_FULL),
    ErrorCode.INTERNAL: (grpc.StatusCode.INTERNAL, ErrorReason.JOB_FAILED),
    ErrorCode.ADAPTER_NOT_FOUND: (grpc.StatusCode.NOT_FOUND, ErrorReason.ADAPTER_NOT_FOUND),
    ErrorCode.ADAPTER_EXISTS: (grpc.StatusCode.ALREADY_EXISTS, ErrorReason.ADAPTER_EXISTS),
    ErrorCode.ADAPTER_IN_USE: (grpc.StatusCode.FAILED_PRECONDITION, ErrorReason.ADAPTER_IN_USE),
    ErrorCode.ADAPTER_LIMIT: (grpc.StatusCode.RESOURCE_EXHAUSTED, ErrorReason.ADAPTER_LIMIT),
    ErrorCode.ADAPTER_PATH: (grpc.StatusCode.INVALID_ARGUMENT, ErrorReason.ADAPTER_PATH_REFUSED),
    ErrorCode.FAILED_PRECONDITION: (grpc.StatusCode.FAILED_PRECONDITION, ErrorReason.ADAPTER_LOADING_OFF),
}
_BY_NUMBER = {int(code.value[0]): code for code in grpc.StatusCode}


@dataclass(frozen=True)
class Malformed:
    """A request whose bytes did not parse (bad wire format, invalid UTF-8 in a string)."""

    message: str


def lenient(cls: type[Msg]) -> Callable[[bytes], Msg | Malformed]:
    """A request deserializer that never raises: the handler answers INVALID_ARGUMENT itself
    (a raising deserializer would make gRPC answer with a vague INTERNAL)."""

    def parse(data: bytes) -> Msg | Malformed:
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError, RuntimeError) as exc:
            return Malformed(f"malformed {cls.DESCRIPTOR.name}: {exc}"[:300])

    return parse


class GeneratorService:
    def __init__(
        self,
        engine: EngineClient,
        auth: Authenticator,
        limits: Limits,
        max_streams: int,
        max_priority_jobs: int,
        adapter_dir: str | None = None,
        max_adapters_per_tenant: int = defaults.MAX_ADAPTERS_PER_TENANT,
    ) -> None:
        self.engine = engine
        self.adapters = TenantAdapters(auth.enabled, engine.adapter_loads, engine.adapter_loading)
        # Run-time LoadAdapter reads only inside this folder (the engine resolves and checks the
        # path again, links followed); None: refused.
        self.adapter_dir = adapter_dir
        self.max_adapters_per_tenant = max_adapters_per_tenant
        # How fast jobs finish: the retry delay of a refusal that clears as jobs finish.
        self.drain = DrainRate()
        engine.on_event.append(self._observe)
        self.auth = auth
        self.limits = limits
        self.max_streams = max_streams
        # With authentication on: one tenant's jobs of priority > 0 queued or running at once.
        self.max_priority_jobs = max_priority_jobs
        self.open_streams = 0
        self.draining = False  # refusing new jobs (SIGTERM, after the drain delay)
        self.leaving = False  # SIGTERM seen: health says NOT_SERVING while jobs are still admitted

    # -- shared steps --------------------------------------------------------------------------

    def _observe(self, job: JobChannel, event: pb.GenerateEvent) -> None:
        if event.HasField("finished"):
            self.drain.finished()

    @staticmethod
    async def fail(
        context: grpc.aio.ServicerContext[Req, Resp],
        code: grpc.StatusCode,
        text: str,
        reason: ErrorReason,
        field: str | None = None,
        retry_after: float | None = None,
    ) -> NoReturn:
        failure = Failure(code, text, reason, field, retry_after)
        await context.abort(code, text, failure.trailing_metadata())
        raise AssertionError("abort returned")  # abort always raises

    async def parsed(self, request: Msg | Malformed, context: grpc.aio.ServicerContext[Req, Resp]) -> Msg:
        if isinstance(request, Malformed):
            await self.fail(
                context, grpc.StatusCode.INVALID_ARGUMENT, request.message, ErrorReason.MALFORMED_REQUEST
            )
        return request

    async def tenant_of(self, context: grpc.aio.ServicerContext[Req, Resp]) -> str:
        tenant = self.auth.tenant(context.invocation_metadata(), context.auth_context())
        if tenant is None:
            await self.fail(
                context,
                grpc.StatusCode.UNAUTHENTICATED,
                self.auth.denied,
                ErrorReason.UNAUTHENTICATED,
            )
        return tenant

    async def engine_failed(
        self,
        exc: EngineRejectedError | EngineBusyError | EngineDownError,
        context: grpc.aio.ServicerContext[Req, Resp],
        request: pb.GenerateRequest | None = None,
    ) -> NoReturn:
        """A call the engine refused, could not take (too many waiting) or could not answer;
        `request`: the job's, whose fields a refusal may blame."""
        if isinstance(exc, EngineRejectedError):
            code, reason = _CODES[exc.rejection.code]
            field = (
                "path"
                if reason is ErrorReason.ADAPTER_PATH_REFUSED
                else request_field(exc.rejection.field, request)
                if code == grpc.StatusCode.INVALID_ARGUMENT
                else None
            )
            # A full queue clears as jobs finish: come back when one more has.
            retry = self.drain.retry_after() if reason is ErrorReason.QUEUE_FULL else None
            await self.fail(context, code, unscoped(exc.rejection.message), reason, field, retry)
        if isinstance(exc, EngineBusyError):
            await self.fail(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), ErrorReason.ENGINE_BUSY)
        await self.fail(context, grpc.StatusCode.UNAVAILABLE, str(exc), ErrorReason.ENGINE_UNAVAILABLE)

    async def _job_id(self, job_id: str, context: grpc.aio.ServicerContext[Req, Resp]) -> str:
        try:
            check_job_id(job_id)
        except RequestError as exc:
            await self.invalid(context, exc)
        return job_id

    async def open_stream(self, context: grpc.aio.ServicerContext[Req, Resp]) -> None:
        if self.open_streams >= self.max_streams:
            await self.fail(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.open_streams} streams are open, the server's limit; try again later",
                ErrorReason.TOO_MANY_STREAMS,
                retry_after=self.drain.retry_after(),
            )
        self.open_streams += 1

    async def invalid(self, context: grpc.aio.ServicerContext[Req, Resp], exc: RequestError) -> NoReturn:
        """INVALID_ARGUMENT for a limit the request broke, naming its field."""
        await self.fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc), exc.reason, exc.field)

    async def engine_down(self, context: grpc.aio.ServicerContext[Req, Resp]) -> NoReturn:
        await self.fail(
            context, grpc.StatusCode.UNAVAILABLE, "the engine is not running", ErrorReason.ENGINE_UNAVAILABLE
        )

    async def token_ids(
        self, request: pb.GenerateRequest | pb.TokenizeRequest, context: grpc.aio.ServicerContext[Req, Resp]
    ) -> list[int]:
        """The prompt's ids, after its limits: INVALID_ARGUMENT for a broken limit or a refused chat."""
        prompts = self.engine.prompts
        if prompts is None:
            await self.engine_down(context)
        try:
            if isinstance(request, pb.GenerateRequest):
                check_request(request, self.limits)
            else:
                check_tokenize_request(request, self.limits)
            return await prompts.token_ids_async(request)
        except RequestError as exc:
            await self.invalid(context, exc)

    async def _negative_ids(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext[Req, Resp]
    ) -> list[int]:
        """The guidance's negative prompt as ids, tokenized as the prompt is, each id in the vocabulary
        and within the context and the cache on its own (field-precise refusals before the job's)."""
        prompts, bounds = self.engine.prompts, self.engine.bounds
        if prompts is None or bounds is None:
            await self.engine_down(context)
        try:
            ids = await prompts.negative_ids_async(request.guidance)
            check_negative_prompt_ids(ids, max_new_tokens(request), bounds)
            return ids
        except RequestError as exc:
            await self.invalid(context, exc)

    async def _check_embeddings(
        self, request: pb.GenerateRequest, ids: list[int], context: grpc.aio.ServicerContext[Req, Resp]
    ) -> None:
        """The prompt embeddings placed on the tokenized prompt as the engine will place them: rows of
        the model's width, inside the prompt, no overlaps, every placeholder found, and the expanded
        prompt within the context and the cache with max_new_tokens."""
        bounds = self.engine.bounds
        if bounds is None:
            await self.engine_down(context)
        try:
            check_prompt_embeddings(request, ids, max_new_tokens(request), bounds)
        except RequestError as exc:
            await self.invalid(context, exc)

    async def _job(
        self,
        request: pb.GenerateRequest,
        ids: list[int],
        tenant: str,
        context: grpc.aio.ServicerContext[Req, Resp],
    ) -> JobSpec:
        """The job the engine runs, built and checked here, once, by the engine's own rule
        (JobSpec.check): the engine checks only that its adapter is loaded and the queue has room."""
        bounds = self.engine.bounds
        if bounds is None:
            await self.engine_down(context)
        negative = await self._negative_ids(request, context) if request.HasField("guidance") else None
        adapter = self.adapters.engine_name(tenant, request.adapter) if request.adapter else None
        try:
            spec = job_spec(request, ids, negative, tenant, cache_salt(tenant, request.cache_salt), adapter)
            check_spec(spec, bounds, request)
        except InvalidRequestError as exc:  # job_spec's own
            await self.invalid(context, RequestError(str(exc), request_field(exc.field, request)))
        except RequestError as exc:
            await self.invalid(context, exc)
        return spec

    async def _check_priority_jobs(
        self, request: pb.GenerateRequest, tenant: str, context: grpc.aio.ServicerContext[Req, Resp]
    ) -> None:
        """With authentication on, a tenant's jobs of priority > 0 are capped, so that one tenant
        cannot hold the engine's queue ahead of everyone else's with an endless run of them."""
        if request.priority <= 0 or not self.auth.enabled:
            return
        if self.engine.priority_jobs(tenant) >= self.max_priority_jobs:
            await self.fail(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"priority > 0: this tenant has {self.max_priority_jobs} such jobs queued or running, "
                f"the server's limit (--max-priority-jobs); retry when one ends, or send priority <= 0",
                ErrorReason.PRIORITY_LIMIT,
                retry_after=self.drain.retry_after(),
            )

    async def submit(
        self,
        request: pb.GenerateRequest,
        tenant: str,
        context: grpc.aio.ServicerContext[Req, Resp],
        streamed: bool,
    ) -> JobChannel:
        if self.draining:
            await self.fail(
                context, grpc.StatusCode.UNAVAILABLE, "the server is shutting down", ErrorReason.DRAINING
            )
        if not self.engine.ready:
            await self.engine_down(context)
        ids = await self.token_ids(request, context)
        if request.embeddings:
            await self._check_embeddings(request, ids, context)
        if request.adapter:
            lost = self.engine.adapter_lost.get(self.adapters.own_name(tenant, request.adapter))
            if lost is not None:
                await self.fail(
                    context,
                    grpc.StatusCode.NOT_FOUND,
                    f"adapter {request.adapter!r} could not be loaded again after the engine restarted "
                    f"({lost}); load it again",
                    ErrorReason.ADAPTER_NOT_FOUND,
                    "adapter",
                )
        spec = await self._job(request, ids, tenant, context)
        # No await between this count and the job's entry in the engine client's table (submit
        # registers it before its first await), so concurrent calls cannot both pass the cap.
        await self._check_priority_jobs(request, tenant, context)
        try:
            job = await self.engine.submit(spec, tenant, streamed)
            job.affinity = _affinity(request, context)
            return job
        except (EngineRejectedError, EngineBusyError, EngineDownError) as exc:
            await self.engine_failed(exc, context, request)

    async def job_events(
        self, job: JobChannel, context: grpc.aio.ServicerContext[Req, Resp]
    ) -> AsyncIterator[pb.GenerateEvent]:
        # Any way out of here (finished, caller gone, deadline, engine down) releases the job,
        # and an unfinished job is cancelled in the engine at once.
        ended_by: BaseException | None = None
        try:
            while True:
                item = await job.events.get()
                if isinstance(item, EngineDownError):
                    await self.fail(
                        context, grpc.StatusCode.UNAVAILABLE, str(item), ErrorReason.ENGINE_UNAVAILABLE
                    )
                if item.HasField("finished"):
                    f = item.finished
                    f.adapter = caller_name(f.adapter)
                    log.info(
                        "job_finished",
                        job=short_id(job.job_id),
                        affinity=job.affinity,
                        stop_reason=pb.StopReason.Name(f.stop_reason),
                        prompt_tokens=f.prompt_tokens,
                        cached_tokens=f.cached_tokens,
                        new_tokens=f.new_tokens,
                        queued_s=round(f.timings.queued_seconds, 4),
                        prefill_s=round(f.timings.prefill_seconds, 4),
                        decode_s=round(f.timings.decode_seconds, 4),
                    )
                    # The finish event goes out first, even for a failed job: its `error` and counts
                    # are the caller's, and then the stream ends with the failure's status.
                    yield item
                    if f.stop_reason == pb.STOP_REASON_ERROR:
                        code = _BY_NUMBER.get(f.error_code, grpc.StatusCode.INTERNAL)
                        await self.fail(
                            context, code, f.error or "the job failed in the engine", ErrorReason.JOB_FAILED
                        )
                    return
                yield item
        except BaseException as exc:
            ended_by = exc
            raise
        finally:
            why = ""
            if not job.finished:
                why = why_left(context, ended_by)
                log.info("job_left_unfinished", job=short_id(job.job_id), why=why)
            self.engine.release(job, why)

    # -- the RPCs ------------------------------------------------------------------------------

    async def Enqueue(
        self,
        request: pb.GenerateRequest | Malformed,
        context: grpc.aio.ServicerContext[pb.GenerateRequest, pb.EnqueueResponse],
    ) -> pb.EnqueueResponse:
        req = await self.parsed(request, context)
        tenant = await self.tenant_of(context)
        job = await self.submit(req, tenant, context, streamed=False)
        return pb.EnqueueResponse(job_id=job.job_id, prompt_tokens=job.prompt_tokens)

    async def Stream(
        self,
        request: pb.StreamRequest | Malformed,
        context: grpc.aio.ServicerContext[pb.StreamRequest, pb.GenerateEvent],
    ) -> AsyncIterator[pb.GenerateEvent]:
        req = await self.parsed(request, context)
        job_id = await self._job_id(req.job_id, context)
        tenant = await self.tenant_of(context)
        try:
            job = self.engine.attach(job_id, tenant)
        except ValueError as exc:
            await self.fail(
                context, grpc.StatusCode.FAILED_PRECONDITION, str(exc), ErrorReason.JOB_ALREADY_STREAMED
            )
        if job is None:
            await self.fail(
                context,
                grpc.StatusCode.NOT_FOUND,
                "no such job (unknown, or already ended)",
                ErrorReason.JOB_NOT_FOUND,
            )
        await self.open_stream(context)
        try:
            async for event in self.job_events(job, context):
                yield event
        finally:
            self.open_streams -= 1

    async def Generate(
        self,
        request: pb.GenerateRequest | Malformed,
        context: grpc.aio.ServicerContext[pb.GenerateRequest, pb.GenerateEvent],
    ) -> AsyncIterator[pb.GenerateEvent]:
        req = await self.parsed(request, context)
        tenant = await self.tenant_of(context)
        await self.open_stream(context)
        try:
            job = await self.submit(req, tenant, context, streamed=True)
            async for event in self.job_events(job, context):
                yield event
        finally:
            self.open_streams -= 1

    async def Cancel(
        self,
        request: pb.CancelRequest | Malformed,
        context: grpc.aio.ServicerContext[pb.CancelRequest, pb.CancelResponse],
    ) -> pb.CancelResponse:
        req = await self.parsed(request, context)
        job_id = await self._job_id(req.job_id, context)
        tenant = await self.tenant_of(context)
        job = self.engine.lookup(job_id, tenant)
        if job is None or job.finished:
            await self.fail(
                context, grpc.StatusCode.NOT_FOUND, "no running job with that id", ErrorReason.JOB_NOT_FOUND
            )
        self.engine.cancel(job)
        return pb.CancelResponse()

    async def GetModelInfo(
        self,
        request: pb.GetModelInfoRequest | Malformed,
        context: grpc.aio.ServicerContext[pb.GetModelInfoRequest, pb.ModelInfo],
    ) -> pb.ModelInfo:
        await self.parsed(request, context)
        await self.tenant_of(context)
        return await self.model_info(context)

    async def model_info(self, context: grpc.aio.ServicerContext[Req, Resp]) -> pb.ModelInfo:
        """The engine's ModelInfo now; UNAVAILABLE or RESOURCE_EXHAUSTED if it cannot answer."""
        try:
            return await self.engine.info()
        except (EngineBusyError, EngineDownError) as exc:
            await self.engine_failed(exc, context)

    async def Tokenize(
        self,
        request: pb.TokenizeRequest | Malformed,
        context: grpc.aio.ServicerContext[pb.TokenizeRequest, pb.TokenizeResponse],
    ) -> pb.TokenizeResponse:
        req = await self.parsed(request, context)
        await self.tenant_of(context)
        return pb.TokenizeResponse(token_ids=await self.token_ids(req, context))

    async def _adapter_call(
        self, command: AdapterCommand, context: grpc.aio.ServicerContext[Req, Resp]
    ) -> pb.ListAdaptersResponse:
        try:
            return await self.engine.adapters(command)
        except (EngineRejectedError, EngineBusyError, EngineDownError) as exc:
            await self.engine_failed(exc, context)

    async def _adapter_name(self, name: str, field: str, context: grpc.aio.ServicerContext[Req, Resp]) -> str:
        try:
            check_adapter_name(name, field)
        except RequestError as exc:
            await self.invalid(context, exc)
        return name

    async def LoadAdapter(
        self,
        request: pb.LoadAdapterRequest | Malformed,
        context: grpc.aio.ServicerContext[pb.LoadAdapterRequest, pb.AdapterInfo],
    ) -> pb.AdapterInfo:
        req = await self.parsed(request, context)
        tenant = await self.tenant_of(context)
        name = await self._adapter_name(req.name, "name", context)
        if self.adapter_dir is None:
            await self.fail(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                "run-time adapter loading is off: the server was started without --adapter-dir",
                ErrorReason.ADAPTER_LOADING_OFF,
            )
        if not req.path:
            await self.fail(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "path: the adapter's folder is required (a name inside the server's adapter folder)",
                ErrorReason.INVALID_ARGUMENT,
                "path",
            )
        try:
            check_relative_path(req.path)
        except AdapterPathError as exc:
            await self.fail(
                context, grpc.StatusCode.INVALID_ARGUMENT, str(exc), ErrorReason.ADAPTER_PATH_REFUSED, "path"
            )
        engine_name = self.adapters.own_name(tenant, name)
        await self._check_tenant_adapters(tenant, engine_name, context)
        reply = await self._adapter_call(AdapterCommand(AdapterOp.LOAD, engine_name, req.path), context)
        log.info("adapter_loaded", adapter=name, tenant=tenant or None, path=req.path)
        info = reply.adapters[0] if reply.adapters else pb.AdapterInfo(name=engine_name, path=req.path)
        info.name = name
        info.description = unscoped(info.description)
        return info

    async def _check_tenant_adapters(
        self, tenant: str, engine_name: str, context: grpc.aio.ServicerContext[Req, Resp]
    ) -> None:
        """With authentication on, a tenant holds at most --max-adapters-per-tenant adapters of its
        own (loaded or loading), so one tenant cannot take every slot; the server's are shared."""
        if not self.adapters.scoped or engine_name in self.engine.adapter_loads:
            return  # a second load of a held name is ALREADY_EXISTS, from the engine
        held = self.adapters.held(tenant)
        if held >= self.max_adapters_per_tenant:
            await self.fail(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this tenant holds {held} adapters, the server's limit per tenant "
                "(--max-adapters-per-tenant); unload one first",
                ErrorReason.TENANT_ADAPTER_LIMIT,
            )

    async def UnloadAdapter(
        self,
        request: pb.UnloadAdapterRequest | Malformed,
        context: grpc.aio.ServicerContext[pb.UnloadAdapterRequest, pb.UnloadAdapterResponse],
    ) -> pb.UnloadAdapterResponse:
        req = await self.parsed(request, context)
        tenant = await self.tenant_of(context)
        name = await self._adapter_name(req.name, "name", context)
        engine_name = self.adapters.unloadable_name(tenant, name)
        if engine_name is None:
            await self.fail(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"no adapter {name!r} of yours is loaded (the server's own cannot be unloaded by a tenant)",
                ErrorReason.ADAPTER_NOT_FOUND,
            )
        await self._adapter_call(AdapterCommand(AdapterOp.UNLOAD, engine_name), context)
        log.info("adapter_unloaded", adapter=name, tenant=tenant or None)
        return pb.UnloadAdapterResponse()

    async def ListAdapters(
        self,
        request: pb.ListAdaptersRequest | Malformed,
        context: grpc.aio.ServicerContext[pb.ListAdaptersRequest, pb.ListAdaptersResponse],
    ) -> pb.ListAdaptersResponse:
        await self.parsed(request, context)
        tenant = await self.tenant_of(context)
        reply = await self._adapter_call(AdapterCommand(AdapterOp.LIST), context)
        return pb.ListAdaptersResponse(adapters=self.adapters.visible(tenant, reply.adapters))


def serialize(message: object) -> bytes:
    assert isinstance(message, Message)
    return message.SerializeToString()


def generic_handler(service: GeneratorService) -> grpc.GenericRpcHandler:
    """The Generator service's handlers, with request parsing that never raises."""
    handlers: dict[str, grpc.RpcMethodHandler[object, object]] = {
        "Enqueue": grpc.unary_unary_rpc_method_handler(
            service.Enqueue,
            lenient(pb.GenerateRequest),
            serialize,
        ),
        "Stream": grpc.unary_stream_rpc_method_handler(
            service.Stream,
            lenient(pb.StreamRequest),
            serialize,
        ),
        "Cancel": grpc.unary_unary_rpc_method_handler(
            service.Cancel,
            lenient(pb.CancelRequest),
            serialize,
        ),
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.Generate,
            lenient(pb.GenerateRequest),
            serialize,
        ),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            service.GetModelInfo,
            lenient(pb.GetModelInfoRequest),
            serialize,
        ),
        "Tokenize": grpc.unary_unary_rpc_method_handler(
            service.Tokenize,
            lenient(pb.TokenizeRequest),
            serialize,
        ),
        "LoadAdapter": grpc.unary_unary_rpc_method_handler(
            service.LoadAdapter,
            lenient(pb.LoadAdapterRequest),
            serialize,
        ),
        "UnloadAdapter": grpc.unary_unary_rpc_method_handler(
            service.UnloadAdapter,
            lenient(pb.UnloadAdapterRequest),
            serialize,
        ),
        "ListAdapters": grpc.unary_unary_rpc_method_handler(
            service.ListAdapters,
            lenient(pb.ListAdaptersRequest),
            serialize,
        ),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


def why_left(context: grpc.aio.ServicerContext[Req, Resp], ended_by: BaseException | None) -> str:
    """How a call ended before its job finished: its deadline, its caller gone (the handler is
    cancelled, or its generator closed), or the server ending it with an error status."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= 0:
        return "deadline_exceeded"
    if isinstance(ended_by, asyncio.CancelledError | GeneratorExit) or context.cancelled():
        return "caller_gone"
    return "stream_failed"


def _affinity(request: pb.GenerateRequest, context: grpc.aio.ServicerContext[Req, Resp]) -> str:
    """The caller's x-dyngen-affinity header, or the key its client would have sent (same rule)."""
    for key, value in context.invocation_metadata() or ():
        if key == AFFINITY_HEADER and isinstance(value, str):
            return value[:64]
    match request.WhichOneof("prompt"):
        case "text":
            return text_key(request.text)
        case "chat":
            return text_key(chat_text((m.role, m.content) for m in request.chat.messages))
        case _:
            return text_key(ids_text(request.token_ids.ids))
