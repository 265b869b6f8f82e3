"""The error details a failed call carries, read as typed values.

The server puts a `google.rpc.Status` in the `grpc-status-details-bin` trailer of every error
it raises on purpose, holding an `ErrorInfo` (a stable `reason` in the `dyngen.v1` domain),
a `BadRequest` (which field broke which limit) for INVALID_ARGUMENT where a field is to blame,
and a `RetryInfo` (how long to wait) for RESOURCE_EXHAUSTED and UNAVAILABLE. Callers in any
language read the same trailer; docs/CONTRACT.md lists the reasons.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2

DETAILS_KEY = "grpc-status-details-bin"  # the trailer gRPC's rich error model uses
DOMAIN = "dyngen.v1"  # ErrorInfo.domain of every reason below


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
