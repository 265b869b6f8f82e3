"""The google.rpc.Status every deliberate error carries, so callers in any language can act on it.

gRPC's rich error model: the status (code, message) goes out as usual and a serialized
`google.rpc.Status` with the same code and message goes in the `grpc-status-details-bin`
trailer, holding an `ErrorInfo` (a stable reason in the `dyngen.v1` domain), a `BadRequest`
when a field of the request is to blame, and a `RetryInfo` when waiting may help
(RESOURCE_EXHAUSTED, UNAVAILABLE). `dyngen_client.errors` reads it back; docs/CONTRACT.md lists
the reasons.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

from dyngen_client.errors import DETAILS_KEY, DOMAIN, ErrorReason

# How long a caller should wait before retrying. A full queue or too many open streams drain at
# the pace jobs finish (seconds); an engine restart takes its backoff plus a model load.
RETRY_BUSY_SECONDS = 1.0
RETRY_UNAVAILABLE_SECONDS = 5.0

_RETRY_SECONDS = {
    ErrorReason.QUEUE_FULL: RETRY_BUSY_SECONDS,
    ErrorReason.TOO_MANY_STREAMS: RETRY_BUSY_SECONDS,
    ErrorReason.ENGINE_BUSY: RETRY_BUSY_SECONDS,
    ErrorReason.ENGINE_UNAVAILABLE: RETRY_UNAVAILABLE_SECONDS,
    ErrorReason.DRAINING: RETRY_UNAVAILABLE_SECONDS,
}


@dataclass(frozen=True)
class Failure:
    """An error status as the service raises it: what, why, and which field (if one is to blame)."""

    code: grpc.StatusCode
    message: str
    reason: ErrorReason
    field: str | None = None  # a path into the request, e.g. "stop_strings[3]"

    @property
    def retry_seconds(self) -> float | None:
        return _RETRY_SECONDS.get(self.reason)

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

    def trailing_metadata(self) -> tuple[tuple[str, bytes]]:
        return ((DETAILS_KEY, self.status().SerializeToString()),)


def _pack(
    message: error_details_pb2.ErrorInfo | error_details_pb2.BadRequest | error_details_pb2.RetryInfo,
) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed
