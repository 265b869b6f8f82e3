"""`dyngen serve`: the grpc.aio server, health, reflection, metrics, signals.

Health is SERVING only while the engine process is up with its model loaded and warmed up.
SIGTERM (or SIGINT): stop admitting (health NOT_SERVING, new jobs UNAVAILABLE), give running
jobs `shutdown_grace_seconds` to finish (a second signal ends the wait), cancel the rest, stop
the engine, return 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import ssl
import time

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.startup_objects import freeze_startup_objects
from service.config import ServiceConfig
from service.engine_spawn import EarlyEngine
from service.frontend.auth import AuthConfigError, Authenticator, TokenInterceptor
from service.frontend.engine_client import EngineClient
from service.frontend.engine_load import EngineLoadTracker
from service.frontend.event_buffer import EngineRefusedConfigError
from service.frontend.limits import Limits
from service.frontend.metrics import Metrics
from service.frontend.servicer import SERVICE_NAME, GeneratorService, generic_handler
from service.frontend.worker_servicer import WORKER_SERVICE_NAME, WorkerService, worker_handler
from service.logs import configure_logging

log = structlog.get_logger("dyngen.server")

SERVED = ("", SERVICE_NAME, WORKER_SERVICE_NAME)  # the names grpc.health.v1 answers for


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise SystemExit(f"dyngen: error: cannot read {path}: {exc.strerror}") from exc


def _credentials(config: ServiceConfig) -> grpc.ServerCredentials | None:
    if not config.tls_cert and not config.tls_key:
        if config.tls_client_ca:
            raise SystemExit("dyngen: error: --tls-client-ca needs --tls-cert and --tls-key")
        return None
    if not (config.tls_cert and config.tls_key):
        raise SystemExit("dyngen: error: --tls-cert and --tls-key go together")
    _check_tls_files(config.tls_cert, config.tls_key, config.tls_client_ca)
    pair = [(_read(config.tls_key), _read(config.tls_cert))]
    if config.tls_client_ca:
        return grpc.ssl_server_credentials(
            pair, root_certificates=_read(config.tls_client_ca), require_client_auth=True
        )
    return grpc.ssl_server_credentials(pair)


def _check_tls_files(cert: str, key: str, client_ca: str | None) -> None:
    """gRPC reports a bad certificate or key only as a port it could not bind: the files are
    parsed here first, so the start fails naming them."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key, password=b"")  # no prompt: gRPC takes no encrypted key
    except (ssl.SSLError, OSError) as exc:
        raise SystemExit(
            f"dyngen: error: --tls-cert {cert} and --tls-key {key} are not a PEM certificate chain and its "
            f"private key ({exc.strerror or exc})"
        ) from exc
    if client_ca:
        try:
            context.load_verify_locations(cafile=client_ca)
        except (ssl.SSLError, OSError) as exc:
            raise SystemExit(
                f"dyngen: error: --tls-client-ca {client_ca} is not a PEM CA bundle ({exc.strerror or exc})"
            ) from exc


def _options(config: ServiceConfig) -> list[tuple[str, int]]:
    options = [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        # Above --max-streams: past that the servicer answers RESOURCE_EXHAUSTED at once, where an
        # HTTP/2 limit would make callers wait in silence.
        ("grpc.max_concurrent_streams", 2 * config.max_streams + 16),
        ("grpc.keepalive_time_ms", int(config.keepalive_seconds * 1000)),
        ("grpc.keepalive_timeout_ms", 20_000),
        # Clients may ping this often without being cut off for it.
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        # gRPC's Linux default lets a second server bind a port in use and take part of its calls:
        # a port in use must fail the start instead.
        ("grpc.so_reuseport", 0),
    ]
    if config.max_connection_age_seconds > 0:
        options += [
            ("grpc.max_connection_age_ms", int(config.max_connection_age_seconds * 1000)),
            # Streams open when a connection ages out may finish within the drain grace.
            ("grpc.max_connection_age_grace_ms", int(config.shutdown_grace_seconds * 1000)),
        ]
    return options


async def serve(
    config: ServiceConfig, bound: asyncio.Future[int] | None = None, early: EarlyEngine | None = None
) -> int:
    """Run until SIGTERM/SIGINT; returns the exit status. `bound` receives the gRPC port; `early` is
    the first engine if it was started before the front end (`dyngen serve`)."""
    loop = asyncio.get_running_loop()
    try:
        try:
            auth = Authenticator.load(config.auth_tokens_file, mtls=bool(config.tls_client_ca))
        except AuthConfigError as exc:
            raise SystemExit(f"dyngen: error: {exc}") from exc
        creds = _credentials(config)
    except BaseException:
        if early is not None:
            early.discard()
        raise
    engine = EngineClient(config, loop, early)
    metrics = Metrics()
    health_servicer = health.aio.HealthServicer()
    tasks: set[asyncio.Task[None]] = set()
    service = GeneratorService(
        engine,
        auth,
        Limits(max_prompt_chars=config.max_prompt_chars),
        config.max_streams,
        config.max_priority_jobs,
        config.adapter_dir,
        config.max_adapters_per_tenant,
    )

    leaving = asyncio.Event()  # SIGTERM seen: health stays NOT_SERVING whatever the engine does

    def set_health(up: bool) -> None:
        metrics.engine_state(up)
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if up and not service.draining and not leaving.is_set()
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in SERVED:
            task = loop.create_task(health_servicer.set(name, status))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    stop = asyncio.Event()
    engine.on_state.append(set_health)
    engine.on_event.append(metrics.on_event)
    engine.on_stats.append(metrics.on_stats)
    engine.on_forget.append(metrics.forget)
    engine.on_dropped.append(metrics.dropped)
    engine.on_adapter_gone.append(metrics.adapter_gone)
    engine.on_restart.append(metrics.engine_restarted)
    engine.on_recovered.append(metrics.recovered)
    engine.on_failed.append(stop.set)

    interceptors = [TokenInterceptor(auth)] if auth.tokens else []
    server = grpc.aio.server(options=_options(config), interceptors=interceptors)
    worker = WorkerService(
        service, EngineLoadTracker(engine, config.max_batch_size), config.served_model_name
    )
    server.add_generic_rpc_handlers((generic_handler(service), worker_handler(worker)))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if config.reflection:
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                WORKER_SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
    address = f"{config.host}:{config.port}"
    try:
        port = (
            server.add_secure_port(address, creds) if creds is not None else server.add_insecure_port(address)
        )
    except RuntimeError as exc:  # gRPC says only that the bind failed
        engine.stop()
        raise SystemExit(f"dyngen: error: cannot listen on {address} (in use, or not this host's)") from exc
    engine.replica = config.replica_id or f"{socket.gethostname()}:{port}"
    for name in SERVED:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    if config.metrics_port:
        metrics_host = config.metrics_host or config.host
        try:
            metrics.serve(metrics_host, config.metrics_port)
        except OSError as exc:
            await server.stop(0)
            engine.stop()
            raise SystemExit(
                f"dyngen: error: cannot serve metrics on {metrics_host}:{config.metrics_port}: {exc.strerror}"
            ) from exc

    # SIGHUP (its terminal closed) drains as SIGTERM does. A second signal (Ctrl-C pressed again)
    # cuts the drain short: what still runs is cancelled at once, its readers still getting their
    # CANCELLED finish.
    hurry = asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():
            hurry.set()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, on_signal)

    engine.start()
    await server.start()
    log.info(
        "listening",
        address=f"{config.host}:{port}",
        tls=creds is not None,
        mtls=bool(config.tls_client_ca),
        auth_tokens=len(auth.tokens),
        reflection=config.reflection,
        metrics=f"{config.metrics_host or config.host}:{config.metrics_port}"
        if config.metrics_port
        else None,
    )
    if bound is not None:
        bound.set_result(port)
    ready = loop.create_task(engine.wait_ready())
    stopped = loop.create_task(stop.wait())
    await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if ready.done() and ready.exception() is not None:
        log.error("engine_failed_to_start", error=str(ready.exception()))
        await server.stop(0)
        engine.stop()
        # 2 as for any refused flag (what `dyngen generate` gives the same model), 1 for a crash.
        return 2 if isinstance(ready.exception(), EngineRefusedConfigError) else 1
    if ready.done():
        # Serving from here on: the modules, the gRPC server and the tokenizer live as long as the
        # process, and a full collection walking them (~9 ms here) would hold up every stream.
        freeze_startup_objects()
    await stopped
    if engine.failed:  # crash loop: a supervisor should see this server fail, not a silent husk
        await server.stop(0)
        engine.stop()
        return 1

    # Leave the balancer first: NOT_SERVING at once, still admitting while its health checks see it.
    leaving.set()
    service.leaving = True
    for name in SERVED:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    if config.drain_delay_seconds > 0:
        log.info("leaving", delay_seconds=config.drain_delay_seconds)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(hurry.wait(), config.drain_delay_seconds)
    # Drain: admit nothing new, let running jobs finish within the grace period, cancel the rest.
    service.draining = True
    # Finished jobs whose events wait for a Stream call are not waited for: they run nothing, and a
    # cancelled Enqueue'd job had held every drain for the whole grace period.
    log.info("draining", open_jobs=engine.unfinished_jobs(), grace_seconds=config.shutdown_grace_seconds)
    deadline = time.monotonic() + config.shutdown_grace_seconds
    while engine.unfinished_jobs() and time.monotonic() < deadline and not hurry.is_set():
        await asyncio.sleep(0.05)
    if hurry.is_set():
        log.info("drain_cut_short", open_jobs=engine.unfinished_jobs())
    cancelled = engine.unfinished_jobs()
    engine.cancel_all()
    # The cancelled jobs' JobFinished events still reach their readers before the server stops.
    settle = time.monotonic() + 5.0
    while (engine.unfinished_jobs() or service.open_streams) and engine.ready and time.monotonic() < settle:
        await asyncio.sleep(0.02)
    await server.stop(1.0)
    engine.stop()
    log.info("stopped", cancelled=cancelled)
    return 0


def main(config: ServiceConfig, early: EarlyEngine | None = None) -> int:
    configure_logging()
    return asyncio.run(serve(config, early=early))
