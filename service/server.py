"""`dyngen serve`: the grpc.aio server, health, reflection, metrics, signals.

Health is SERVING only while the engine process is up with its model loaded and warmed up.
SIGTERM (or SIGINT): stop admitting (health NOT_SERVING, new jobs UNAVAILABLE), give running
jobs `shutdown_grace_seconds` to finish, cancel the rest, stop the engine, return 0.
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service.config import ServiceConfig
from service.engine_client import EngineClient
from service.logs import configure_logging
from service.metrics import Metrics
from service.proto.dyngen.v1 import generator_pb2 as pb
from service.proto.dyngen.v1 import generator_pb2_grpc as pb_grpc
from service.servicer import GeneratorService

log = structlog.get_logger("dyngen.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generator"].full_name


def _credentials(config: ServiceConfig) -> grpc.ServerCredentials | None:
    if not config.tls_cert and not config.tls_key:
        return None
    if not (config.tls_cert and config.tls_key):
        raise SystemExit("dyngen: error: --tls-cert and --tls-key go together")
    with open(config.tls_key, "rb") as k, open(config.tls_cert, "rb") as c:
        return grpc.ssl_server_credentials([(k.read(), c.read())])


async def serve(config: ServiceConfig, bound: asyncio.Future[int] | None = None) -> int:
    """Run until SIGTERM/SIGINT; returns the exit status. `bound` receives the gRPC port."""
    loop = asyncio.get_running_loop()
    engine = EngineClient(config, loop)
    metrics = Metrics()
    health_servicer = health.aio.HealthServicer()
    tasks: set[asyncio.Task[None]] = set()

    def set_health(up: bool) -> None:
        metrics.engine_state(up)
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if up and not service.draining
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            task = loop.create_task(health_servicer.set(name, status))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    service = GeneratorService(engine)
    engine.on_state.append(set_health)
    engine.on_event.append(metrics.on_event)
    engine.on_stats.append(metrics.on_stats)
    engine.on_forget.append(metrics.forget)

    options = [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
    ]
    server = grpc.aio.server(options=options)
    pb_grpc.add_GeneratorServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    address = f"{config.host}:{config.port}"
    creds = _credentials(config)
    port = server.add_secure_port(address, creds) if creds is not None else server.add_insecure_port(address)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    if config.metrics_port:
        metrics.serve(config.host, config.metrics_port)

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    engine.start()
    await server.start()
    log.info("listening", address=f"{config.host}:{port}", metrics_port=config.metrics_port or None)
    if bound is not None:
        bound.set_result(port)
    ready = loop.create_task(engine.wait_ready())
    stopped = loop.create_task(stop.wait())
    await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if ready.done() and ready.exception() is not None:
        log.error("engine_failed_to_start", error=str(ready.exception()))
        await server.stop(0)
        return 1
    await stopped

    # Drain: admit nothing new, let running jobs finish within the grace period, cancel the rest.
    service.draining = True
    log.info("draining", open_jobs=len(engine.jobs), grace_seconds=config.shutdown_grace_seconds)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    deadline = time.monotonic() + config.shutdown_grace_seconds
    while engine.jobs and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    for job_id in list(engine.jobs):
        engine.cancel(job_id)
    await asyncio.sleep(0.2)  # lets the cancelled jobs' final events reach their streams
    await server.stop(1.0)
    engine.stop()
    log.info("stopped", cancelled=len(engine.jobs))
    return 0


def main(config: ServiceConfig) -> int:
    configure_logging()
    return asyncio.run(serve(config))
