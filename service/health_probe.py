"""Asking a server's standard gRPC health service (grpc.health.v1) whether it serves.

One probe for everything that starts a `dyngen serve` and waits for it: `dyngen cluster` before it
puts a gateway in front of its replicas, the tests' server harness, and the served benchmarks.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2

POLL_SECONDS = 0.2  # between two probes while waiting
PROBE_SECONDS = 2.0  # one probe's deadline: a starting server answers at once or not at all


class NotServingError(Exception):
    """The server did not say SERVING in time, or its process exited while starting."""


def health_status(target: str, timeout: float = PROBE_SECONDS) -> int:
    """The overall service's status (health_pb2.HealthCheckResponse.ServingStatus); grpc.RpcError
    when nothing answers."""
    with grpc.insecure_channel(target) as channel:
        return _check(channel, timeout)


def wait_serving(target: str, timeout: float, exit_code: Callable[[], int | None] = lambda: None) -> None:
    """Until `target` says SERVING. NotServingError at `timeout`, or as soon as `exit_code` (the
    server process's, None while it runs) says it exited."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        while time.monotonic() < deadline:
            code = exit_code()
            if code is not None:
                raise NotServingError(f"the server at {target} exited with status {code} while starting")
            try:
                if _check(channel, PROBE_SECONDS) == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass  # not listening yet
            time.sleep(POLL_SECONDS)
    raise NotServingError(f"{target} not SERVING within {timeout:.0f} s")


def _check(channel: grpc.Channel, timeout: float) -> int:
    # The typeshed HealthStub declares no methods; call the RPC by name.
    check = channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )
    reply: health_pb2.HealthCheckResponse = check(health_pb2.HealthCheckRequest(), timeout=timeout)
    return int(reply.status)
