"""The error details a failed call carries: written (`Failure`) and read back as typed values.

The server puts a `google.rpc.Status` in the `grpc-status-details-bin` trailer of every error
it raises on purpose, holding an `ErrorInfo` (a stable `reason` in the `dyngen.v1` domain),
a `BadRequest` (which field broke which limit) for INVALID_ARGUMENT where a field is to blame,
and a `RetryInfo` (how long to wait) for RESOURCE_EXHAUSTED and UNAVAILABLE. Callers in any
language read the same trailer; docs/CONTRACT.md lists the reasons.

One error is the clients' own: a stream that ends without any gRPC status. That is how a
balancer ends a call whose replica died mid-stream (HAProxy closes it cleanly, without
trailers; grpc-core then reports UNKNOWN "Stream removed"), and the server never does it. The
clients raise it as UNAVAILABLE with the reason REPLICA_LOST: the job is gone, retry it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple, cast

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

DETAILS_KEY = "grpc-status-details-bin"  # the trailer gRPC's rich error model uses
DOMAIN = "dyngen.v1"  # ErrorInfo.domain of every reason below
PUSHBACK_KEY = "grpc-retry-pushback-ms"  # gRPC's retry pushback: the RetryInfo delay, for its retry policy


class ErrorReason(enum.StrEnum):
    """ErrorInfo.reason: what went wrong, stable across releases (messages are for people)."""

    MALFORMED_REQUEST = "MALFORMED_REQUEST"  # bad wire bytes or invalid UTF-8
    LIMIT_EXCEEDED = "LIMIT_EXCEEDED"  # a field past one of the server's limits (BadRequest says which)
    INVALID_ARGUMENT = "INVALID_ARGUMENT"  # a value the engine refused (token id, sampling range...)
    PROMPT_TOO_LONG = "PROMPT_TOO_LONG"  # prompt + max_new_tokens past the context or the cache
    QUEUE_FULL = "QUEUE_FULL"  # the engine's queue is full (retry later)
    TOO_MANY_STREAMS = "TOO_MANY_STREAMS"  # --max-streams Generate/Stream calls are open (retry later)
    ENGINE_BUSY = "ENGINE_BUSY"  # --max-pending-calls wait for the engine (retry later)
    ENGINE_UNAVAILABLE = "ENGINE_UNAVAILABLE"  # the engine is starting or restarting (retry later)
    DRAINING = "DRAINING"  # the server is shutting down (retry on another replica or later)
    JOB_NOT_FOUND = "JOB_NOT_FOUND"  # unknown job, already ended, or another tenant's
    JOB_ALREADY_STREAMED = "JOB_ALREADY_STREAMED"  # a job has exactly one stream
    UNAUTHENTICATED = "UNAUTHENTICATED"  # no valid bearer token or client certificate
    JOB_FAILED = "JOB_FAILED"  # the job failed inside the engine; other jobs carry on
    REPLICA_LOST = "REPLICA_LOST"  # set by the clients: the stream ended without a status (retry)
    ADAPTER_NOT_FOUND = "ADAPTER_NOT_FOUND"  # no LoRA adapter of that name (or no adapter files at the path)
    ADAPTER_EXISTS = "ADAPTER_EXISTS"  # a LoRA adapter of that name is loaded already
    ADAPTER_IN_USE = "ADAPTER_IN_USE"  # jobs run with the adapter: unload when they end (retry later)
    ADAPTER_LIMIT = "ADAPTER_LIMIT"  # --max-adapters are loaded: unload one first
    PRIORITY_LIMIT = "PRIORITY_LIMIT"  # the tenant has --max-priority-jobs jobs of priority > 0 (retry later)
    ADAPTER_PATH_REFUSED = "ADAPTER_PATH_REFUSED"  # LoadAdapter's path is not inside the adapter folder
    ADAPTER_LOADING_OFF = (
        "ADAPTER_LOADING_OFF"  # the server takes no run-time adapter loads (no --adapter-dir)
    )
    TENANT_ADAPTER_LIMIT = "TENANT_ADAPTER_LIMIT"  # the tenant holds --max-adapters-per-tenant adapters
    # The gateway's worker contract:
    UNSUPPORTED = "UNSUPPORTED"  # an RPC this server does not provide (UNIMPLEMENTED)
    REQUEST_ID_IN_USE = "REQUEST_ID_IN_USE"  # the tenant's request_id is running already (ALREADY_EXISTS)
    KV_EVENTS_GONE = "KV_EVENTS_GONE"  # the KV events asked for are no longer kept: subscribe from 0
    NOT_PERMITTED = "NOT_PERMITTED"  # an RPC not served with authentication on (PERMISSION_DENIED)


@dataclass(frozen=True)
class FieldViolation:
    field: str  # a path into the request, e.g. "stop_strings[3]" or "chat.messages"
    description: str


@dataclass(frozen=True)
class ErrorDetails:
    code: grpc.StatusCode
    message: str
    reason: ErrorReason | None = None  # None: no ErrorInfo, or a reason this client does not know
    field_violations: tuple[FieldViolation, ...] = ()
    retry_delay_seconds: float | None = None  # from RetryInfo: wait this long before retrying

    @property
    def retryable(self) -> bool:
        return self.retry_delay_seconds is not None


# How long a caller should wait before retrying. A full queue or too many open streams drain at
# the pace jobs finish (seconds); an engine restart takes its backoff plus a model load; a job
# whose replica died can run again at once, elsewhere.
RETRY_BUSY_SECONDS = 1.0
RETRY_UNAVAILABLE_SECONDS = 5.0
RETRY_ADAPTER_SECONDS = 5.0  # an adapter slot frees when its holder unloads: no rate predicts it

_RETRY_SECONDS = {
    ErrorReason.QUEUE_FULL: RETRY_BUSY_SECONDS,
    ErrorReason.TOO_MANY_STREAMS: RETRY_BUSY_SECONDS,
    ErrorReason.ENGINE_BUSY: RETRY_BUSY_SECONDS,
    ErrorReason.ENGINE_UNAVAILABLE: RETRY_UNAVAILABLE_SECONDS,
    ErrorReason.DRAINING: RETRY_UNAVAILABLE_SECONDS,
    ErrorReason.REPLICA_LOST: 0.0,
    ErrorReason.ADAPTER_IN_USE: RETRY_BUSY_SECONDS,
    ErrorReason.PRIORITY_LIMIT: RETRY_BUSY_SECONDS,
    ErrorReason.ADAPTER_LIMIT: RETRY_ADAPTER_SECONDS,
    ErrorReason.TENANT_ADAPTER_LIMIT: RETRY_ADAPTER_SECONDS,
}


@dataclass(frozen=True)
class Failure:
    """An error status as dyngen raises it (the server; the clients for REPLICA_LOST): what, why,
    and which field (if one is to blame). `trailing_metadata()` is its details trailer."""

    code: grpc.StatusCode
    message: str
    reason: ErrorReason
    field: str | None = None  # a path into the request, e.g. "stop_strings[3]"
    retry_after: float | None = None  # the server's estimate (its drain rate); else the reason's default

    @property
    def retry_seconds(self) -> float | None:
        return self.retry_after if self.retry_after is not None else _RETRY_SECONDS.get(self.reason)

    def status(self) -> status_pb2.Status:
        details: list[any_pb2.Any] = []
        info = error_details_pb2.ErrorInfo(reason=self.reason.value, domain=DOMAIN)
        details.append(_pack(info))
        if self.field is not None:
            violation = error_details_pb2.BadRequest.FieldViolation(
                field=self.field, description=self.message
            )
            details.append(_pack(error_details_pb2.BadRequest(field_violations=[violation])))
        if self.retry_seconds is not None:
            delay = duration_pb2.Duration()
            delay.FromTimedelta(timedelta(seconds=self.retry_seconds))
            details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
        return status_pb2.Status(code=self.code.value[0], message=self.message, details=details)

    def trailing_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        """The details trailer and, where a retry is worth it, gRPC's own pushback (the same delay), which
        clients with retries on (`Client(retries=N)`, grpc's retry policy) wait before trying again."""
        details: tuple[tuple[str, str | bytes], ...] = ((DETAILS_KEY, self.status().SerializeToString()),)
        if self.retry_seconds is None:
            return details
        return (*details, (PUSHBACK_KEY, str(round(self.retry_seconds * 1000))))


def _pack(
    message: error_details_pb2.ErrorInfo | error_details_pb2.BadRequest | error_details_pb2.RetryInfo,
) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def _reason(text: str) -> ErrorReason | None:
    try:
        return ErrorReason(text)
    except ValueError:
        return None


def details_from_status(code: grpc.StatusCode, message: str, status_bytes: bytes | None) -> ErrorDetails:
    """ErrorDetails from a status and the raw `grpc-status-details-bin` trailer (None: absent)."""
    if status_bytes is None:
        return ErrorDetails(code, message)
    try:
        status = status_pb2.Status.FromString(status_bytes)
    except DecodeError:
        return ErrorDetails(code, message)
    reason: ErrorReason | None = None
    violations: list[FieldViolation] = []
    delay: float | None = None
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        bad = error_details_pb2.BadRequest()
        retry = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            reason = _reason(info.reason) if info.domain == DOMAIN else None
        elif detail.Unpack(bad):
            violations.extend(FieldViolation(v.field, v.description) for v in bad.field_violations)
        elif detail.Unpack(retry):
            delay = retry.retry_delay.ToTimedelta().total_seconds()
    return ErrorDetails(code, message, reason, tuple(violations), delay)


def _status_trailer(error: grpc.RpcError) -> bytes | None:
    if isinstance(error, grpc.aio.AioRpcError):
        value = error.trailing_metadata().get(DETAILS_KEY)
    else:  # grpcio's sync errors are calls whose metadata items are (key, value) namedtuples
        value = next((m.value for m in error.trailing_metadata() or () if m.key == DETAILS_KEY), None)
    return value if isinstance(value, bytes) else None


def error_details(error: grpc.RpcError) -> ErrorDetails:
    """The typed details of a failed call, from `grpc.RpcError` (sync) or `AioRpcError` (asyncio);
    both carry the status and the trailers (grpcio raises no other kind)."""
    return details_from_status(error.code(), error.details() or "", _status_trailer(error))


# What grpc-core reports for a call that ended without a gRPC status: the stream closed without
# trailers ("Stream removed"), or reset by a proxy ("Received RST_STREAM with error code N").
_CUT_CODES = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
_CUT_DETAILS = ("Stream removed", "Received RST_STREAM")


def is_stream_cut(error: grpc.RpcError) -> bool:
    """Whether a call ended without a gRPC status: the replica serving it went away mid-stream
    (every status the server raises on purpose carries the details trailer)."""
    return (
        error.code() in _CUT_CODES
        and _status_trailer(error) is None
        and (error.details() or "").startswith(_CUT_DETAILS)
    )


def _lost(cut: grpc.RpcError) -> Failure:
    """The status the replica could not send: UNAVAILABLE, REPLICA_LOST, retry at once."""
    message = f"the replica running this call went away mid-stream ({cut.details()})"
    return Failure(grpc.StatusCode.UNAVAILABLE, message, ErrorReason.REPLICA_LOST)


class _Metadatum(NamedTuple):
    key: str
    value: str | bytes


class StreamCutError(grpc.RpcError):
    """UNAVAILABLE (REPLICA_LOST) in place of a blocking call's cut stream (is_stream_cut)."""

    def __init__(self, cut: grpc.RpcError) -> None:
        lost = _lost(cut)
        self._message = lost.message
        self._trailer = tuple(_Metadatum(key, value) for key, value in lost.trailing_metadata())
        super().__init__(self._message)

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._message

    def initial_metadata(self) -> tuple[_Metadatum, ...]:
        return ()

    def trailing_metadata(self) -> tuple[grpc._Metadatum, ...]:
        # grpcio's metadata items are (key, value) tuples; its stubs name them a check-only type.
        return cast("tuple[grpc._Metadatum, ...]", self._trailer)


def stream_cut_aio_error(cut: grpc.aio.AioRpcError) -> grpc.aio.AioRpcError:
    """The asyncio form of StreamCutError."""
    lost = _lost(cut)
    return grpc.aio.AioRpcError(
        lost.code,
        cut.initial_metadata(),
        grpc.aio.Metadata(*lost.trailing_metadata()),
        lost.message,
        cut.debug_error_string(),
    )
