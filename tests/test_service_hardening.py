"""The service's hardening: no lost event, no orphaned job, a watched engine, limits, tenants.

Unit tests drive the EngineClient's message handling directly (the races are about what
arrives in one read of the pipe); the rest start a real `dyngen serve` on 127.0.0.1 with
the tiny random-weight model (the real one where a busy engine is the point).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2
from smg_grpc_proto.generated import common_pb2 as cpb

from dyngen_client import (
    AsyncClient,
    Chat,
    Client,
    ErrorReason,
    Request,
    collect,
    error_details,
    tls_credentials,
)
from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from engine.jobs import JobEvent, JobFinished, JobId, JobSpec, JobTimings, StopReason, TokensGenerated
from service.config import ServiceConfig
from service.frontend.auth import AuthConfigError, Authenticator, cache_salt
from service.frontend.engine_client import EngineClient, _Process
from service.frontend.event_buffer import EventBuffer
from service.frontend.limits import Limits, RequestError, check_job_id, check_request
from service.frontend.restart_policy import RestartPolicy, RestartTracker
from service.frontend.server import serve
from service.ipc import Accepted, Message, Submit, Tag, pack_events
from tests.certs import CertAuthority
from tests.service_harness import (
    ServerProcess,
    is_idle,
    launch_server,
    log_count,
    start_server,
    start_tiny_server,
    wait_pool_idle,
)
from tests.tiny_service_model import write_servable_tiny_gguf

pytestmark = pytest.mark.timeout(300)


# -- the engine client's races (no process) ------------------------------------------------------


def _fake_engine(client: EngineClient) -> queue.SimpleQueue[bytes | None]:
    """Make `client` believe an engine runs; returns the outbox its commands go to."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe(duplex=False)
    outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    client._proc = _Process(ctx.Process(target=print), b, a, outbox, 1, 0.0, time.monotonic())
    client.ready = True
    return outbox


def _request() -> JobSpec:
    return JobSpec((1, 2, 3))


def _event(job_id: str, kind: str) -> JobEvent:
    if kind == "delta":
        return TokensGenerated(JobId(job_id), None, "hi", (7,))
    return JobFinished(JobId(job_id), None, StopReason.EOS, None, None, 3, 1, 0, JobTimings(0.0, 0.0, 0.0))


def test_events_in_the_same_read_as_the_acceptance_reach_the_stream() -> None:
    """A job can start and finish in the iteration that accepts it: its events come in the same
    read of the pipe as ACCEPTED, before the submitting coroutine resumes. None may be lost."""

    async def scenario() -> list[pb.GenerateEvent]:
        client = EngineClient(ServiceConfig(), asyncio.get_running_loop())
        try:
            outbox = _fake_engine(client)
            task = asyncio.get_running_loop().create_task(client.submit(_request(), "", streamed=True))
            await asyncio.sleep(0)
            data = outbox.get_nowait()
            assert data is not None
            sent = Message.decode(data)
            job_id = Submit.from_bytes(sent.payload).job_id
            # Both dispatched in one loop turn, as the reader thread hands them over.
            client._dispatch(Message(Tag.ACCEPTED, sent.request, Accepted(job_id, 3).to_bytes()))
            client._dispatch(
                Message(Tag.EVENTS, 0, pack_events([_event(job_id, "delta"), _event(job_id, "end")]))
            )
            job = await task
            got = [await job.events.get(), await job.events.get()]
            return [g for g in got if isinstance(g, pb.GenerateEvent)]
        finally:
            shutil.rmtree(client._runtime_dir, ignore_errors=True)

    events = asyncio.run(scenario())
    assert [e.WhichOneof("event") for e in events] == ["delta", "finished"]


def test_a_caller_gone_before_acceptance_gets_its_job_cancelled() -> None:
    async def scenario() -> tuple[list[Message], int]:
        client = EngineClient(ServiceConfig(), asyncio.get_running_loop())
        try:
            outbox = _fake_engine(client)
            task = asyncio.get_running_loop().create_task(client.submit(_request(), "", streamed=True))
            await asyncio.sleep(0)
            task.cancel()  # the deadline passed, or the caller hung up, before the engine answered
            with pytest.raises(asyncio.CancelledError):
                await task
            sent = []
            while not outbox.empty():
                data = outbox.get_nowait()
                assert data is not None
                sent.append(Message.decode(data))
            return sent, len(client.jobs)
        finally:
            shutil.rmtree(client._runtime_dir, ignore_errors=True)

    sent, open_jobs = asyncio.run(scenario())
    assert [m.tag for m in sent] == [Tag.SUBMIT, Tag.CANCEL]
    assert sent[1].payload.decode() == Submit.from_bytes(sent[0].payload).job_id
    assert open_jobs == 0


def test_a_slow_reader_gets_every_event_merged_never_dropped() -> None:
    async def scenario() -> list[pb.GenerateEvent]:
        buffer = EventBuffer(max_items=4)
        started = pb.GenerateEvent(job_id="j")
        started.started.prompt_tokens = 3
        buffer.put(started)
        for i in range(100):
            e = pb.GenerateEvent(job_id="j")
            e.delta.text = f"{i},"
            e.delta.token_ids.append(i)
            buffer.put(e)
        end = pb.GenerateEvent(job_id="j")
        end.finished.stop_reason = pb.STOP_REASON_MAX_NEW_TOKENS
        buffer.put(end)
        assert len(buffer) <= 6
        out: list[pb.GenerateEvent] = []
        while len(buffer):
            item = await buffer.get()
            assert isinstance(item, pb.GenerateEvent)
            out.append(item)
        return out

    out = asyncio.run(scenario())
    text = "".join(e.delta.text for e in out if e.HasField("delta"))
    ids = [i for e in out if e.HasField("delta") for i in e.delta.token_ids]
    assert text == "".join(f"{i}," for i in range(100))
    assert ids == list(range(100))
    assert out[0].HasField("started") and out[-1].HasField("finished")


def test_restarts_back_off_and_give_up_on_a_crash_loop() -> None:
    tracker = RestartTracker(RestartPolicy(backoff_seconds=0.5, max_backoff_seconds=3.0, max_failures=4))
    assert [tracker.after_exit(None) for _ in range(4)] == [0.5, 1.0, 2.0, 3.0]
    assert tracker.after_exit(None) is None
    healthy = RestartTracker(RestartPolicy(backoff_seconds=0.5, max_failures=2, stable_seconds=60))
    for _ in range(10):  # an engine that served a while before each crash never exhausts the limit
        assert healthy.after_exit(3600.0) == 0.5


def test_tokens_file_tenants_and_salts(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# tenant token\nalice 0123456789abcdef0123\nbob   fedcba9876543210fedc\n")
    auth = Authenticator.load(str(tokens), mtls=False)
    assert auth.token_tenant([("authorization", "Bearer 0123456789abcdef0123")]) == "alice"
    assert auth.token_tenant([("authorization", "bearer fedcba9876543210fedc")]) == "bob"
    assert auth.token_tenant([("authorization", "Bearer 0123456789abcdef012")]) is None
    assert auth.token_tenant([]) is None
    assert auth.tenant([], {}) is None
    assert Authenticator().tenant([], {}) == ""
    tokens.write_text("alice short\n")
    with pytest.raises(AuthConfigError):
        Authenticator.load(str(tokens), mtls=False)
    assert cache_salt("", "") == ""
    assert len({cache_salt("a", ""), cache_salt("b", ""), cache_salt("a", "x"), cache_salt("", "a")}) == 4


def test_limits_name_the_field() -> None:
    limits = Limits()
    req = pb.GenerateRequest(text="hi", stop_strings=["s"] * 17)
    with pytest.raises(RequestError, match="stop_strings count"):
        check_request(req, limits)
    req = pb.GenerateRequest(text="x" * (limits.max_prompt_chars + 1))
    with pytest.raises(RequestError, match="text length"):
        check_request(req, limits)
    req = pb.GenerateRequest(text="hi")
    req.sampling.logit_bias.extend(pb.LogitBias(token_id=1, bias=1.0) for _ in range(1025))
    with pytest.raises(RequestError, match="logit_bias"):
        check_request(req, limits)
    with pytest.raises(RequestError, match="prompt"):
        check_request(pb.GenerateRequest(), limits)
    for bad in ("", "0" * 31, "g" * 32, "A" * 32, "0" * 33):
        with pytest.raises(RequestError, match="job_id"):
            check_job_id(bad)
    check_job_id("0123456789abcdef" * 2)


# -- a real server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_servable_tiny_gguf(tmp_path_factory.mktemp("hardening") / "tiny.gguf")


def engine_pid(server: ServerProcess, nth: int = -1) -> int:
    return server.engine_pid(nth)


def wait_health(server: ServerProcess, status: int, timeout: float) -> float:
    """Seconds until health reports `status` (fails after `timeout`)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if server.health() == status:
                return time.monotonic() - start
        except grpc.RpcError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"health never became {status} within {timeout} s: {server.logs[-5:]}")


def scrape(host: str, port: int) -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as r:
        text: str = r.read().decode()
        return text


def test_stopped_engine_turns_not_serving_then_is_replaced(tiny_model: Path) -> None:
    s = start_tiny_server(tiny_model, "--watchdog-seconds", "1", "--hang-seconds", "5")
    try:
        pid = engine_pid(s)
        os.kill(pid, signal.SIGSTOP)  # hung: no heartbeat, no loop
        assert wait_health(s, health_pb2.HealthCheckResponse.NOT_SERVING, 5) < 5
        s.wait_serving(timeout=120)
        assert engine_pid(s) != pid
        assert log_count(s, "engine_hung") == 1
        assert "dyngen_engine_restarts_total 1.0" in scrape("127.0.0.1", s.metrics_port)
        with s.client() as c:
            r = collect(list(c.generate(Request("hello", max_new_tokens=8, ignore_eos=True), timeout=60)))
            assert r.finished.new_tokens == 8
    finally:
        assert s.stop() == 0


def test_a_drain_waits_for_running_jobs_not_for_finished_unstreamed_ones(tiny_model: Path) -> None:
    """SIGTERM waits for what still runs. Enqueued jobs that ended before anyone streamed them
    (cancelled, or done) keep their events for a Stream call until their grace timer; they run
    nothing and do not hold the drain (they had held every drain for the whole grace period)."""
    s = start_tiny_server(tiny_model, "--shutdown-grace-seconds", "120", "--stream-grace-seconds", "120")
    try:
        with s.client() as client:
            done = client.enqueue(Request([5, 6, 7], max_new_tokens=2, ignore_eos=True))
            cancelled = [
                client.enqueue(Request([8, 9, 10], max_new_tokens=400, ignore_eos=True)) for _ in range(3)
            ]
            for job in cancelled:
                client.cancel(job)
            assert is_idle(wait_pool_idle(client))
            # Each one's finish is still there for its Stream call.
            assert collect(client.stream(done)).stop_reason == "max_new_tokens"
            assert collect(client.stream(cancelled[0])).stop_reason == "cancelled"
        s.process.send_signal(signal.SIGTERM)
        assert s.process.wait(60) == 0  # not the 120 s grace
        (draining,) = [r for r in s.logs if r.get("event") == "draining"]
        (stopped,) = [r for r in s.logs if r.get("event") == "stopped"]
        assert draining["open_jobs"] == 0 and stopped["cancelled"] == 0
    finally:
        s.stop()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_the_whole_process_group_drains_with_the_engine_alive(
    tiny_model: Path, sig: signal.Signals
) -> None:
    """Ctrl-C in a terminal, or a service manager's stop, signals every process of the server's
    group: the engine ignores it and runs the front end's drain. (Killed by it, the engine was
    restarted in the middle of the drain and its jobs resumed on the new one.)"""
    s = start_tiny_server(tiny_model, "--speculate", "none")
    try:
        with s.client() as client:
            job = client.enqueue(Request([5, 6, 7], max_new_tokens=3000, ignore_eos=True))
            events = client.stream(job)
            first = next(events)
            os.kill(engine_pid(s), sig)
            os.kill(s.process.pid, sig)
            finished = collect([first, *events])
        assert finished.stop_reason == "max_new_tokens" and len(finished.token_ids) == 3000
        assert s.process.wait(60) == 0
        assert log_count(s, "engine_starting") == 1 and log_count(s, "engine_down") == 0
    finally:
        s.stop()


def test_a_second_signal_cuts_the_drain_short(tiny_model: Path) -> None:
    """Ctrl-C pressed again: the running job is cancelled at once instead of being given the whole
    grace period, and its reader still gets its CANCELLED finish."""
    s = start_tiny_server(tiny_model, "--speculate", "none", "--shutdown-grace-seconds", "300")
    try:
        with s.client() as client:
            job = client.enqueue(Request([5, 6, 7], max_new_tokens=3500, ignore_eos=True))
            events = client.stream(job)
            first = next(events)
            s.process.send_signal(signal.SIGINT)
            s.wait_log("draining")
            s.process.send_signal(signal.SIGINT)
            finished = collect([first, *events])
        assert finished.stop_reason == "cancelled" and len(finished.token_ids) < 3500
        assert s.process.wait(30) == 0
        assert log_count(s, "drain_cut_short") == 1
    finally:
        s.stop()


def test_a_killed_engine_leaves_no_semaphore_behind(tiny_model: Path) -> None:
    """An engine makes no multiprocessing lock of its own (tqdm makes one even for a disabled
    bar): a killed engine's would be named on every crash and warned about at the server's exit."""
    s = start_tiny_server(tiny_model)
    try:
        s.kill_engine()
        s.wait_log("engine_ready", after=len(s.logs))  # the new engine's
        assert s.stop() == 0
        raw = [str(r.get("line")) for r in list(s.logs) if r.get("event") == "raw"]
        assert not [line for line in raw if "leaked semaphore" in line], raw
    finally:
        s.stop()


def test_a_brief_stall_recovers_without_a_restart(tiny_model: Path) -> None:
    s = start_tiny_server(tiny_model, "--watchdog-seconds", "1", "--hang-seconds", "120")
    try:
        pid = engine_pid(s)
        os.kill(pid, signal.SIGSTOP)
        wait_health(s, health_pb2.HealthCheckResponse.NOT_SERVING, 5)
        os.kill(pid, signal.SIGCONT)
        wait_health(s, health_pb2.HealthCheckResponse.SERVING, 10)
        assert log_count(s, "engine_starting") == 1
    finally:
        assert s.stop() == 0


def test_a_model_that_cannot_load_backs_off_then_the_server_exits(tiny_model: Path, tmp_path: Path) -> None:
    model = tmp_path / "doomed.gguf"
    shutil.copy(tiny_model, model)
    s = start_tiny_server(model, "--restart-backoff-seconds", "0.2", "--max-restart-failures", "3")
    try:
        model.unlink()
        os.kill(engine_pid(s), signal.SIGKILL)
        assert s.process.wait(180) == 1
        delays = [r["delay_seconds"] for r in s.logs if r.get("event") == "engine_restart_scheduled"]
        assert delays == [0.2, 0.4, 0.8]
        assert log_count(s, "engine_starting") == 4
        assert log_count(s, "engine_crash_loop") == 1
    finally:
        s.stop()


@pytest.fixture(scope="module")
def tiny_server(tiny_model: Path) -> Iterator[ServerProcess]:
    s = start_tiny_server(
        tiny_model, "--max-streams", "2", "--reflection", "false", "--stream-grace-seconds", "1"
    )
    yield s
    assert s.stop() == 0


def test_a_chat_template_error_is_invalid_argument_and_the_engine_lives(tiny_server: ServerProcess) -> None:
    pid = engine_pid(tiny_server)
    with tiny_server.client() as c:
        bad = Chat((("villain", "hi"),))  # the template raise_exception()s on unknown roles
        with pytest.raises(grpc.RpcError) as info:
            list(c.generate(Request(bad, max_new_tokens=4)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unknown role" in str(info.value.details())
        with pytest.raises(grpc.RpcError) as info:
            c.tokenize(bad)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        r = collect(list(c.generate(Request(Chat.user("hi"), max_new_tokens=4, ignore_eos=True))))
        assert r.finished.new_tokens == 4
    assert engine_pid(tiny_server) == pid and log_count(tiny_server, "engine_starting") == 1


def test_streams_past_the_limit_are_resource_exhausted(tiny_server: ServerProcess) -> None:
    long = Request("once", max_new_tokens=4000, ignore_eos=True)
    with tiny_server.client() as c:
        calls = [c.stub.Generate(long.to_proto(), timeout=120) for _ in range(2)]
        for call in calls:
            next(call)  # started: both streams are open on the server
        with pytest.raises(grpc.RpcError) as info:
            list(c.generate(Request("x", max_new_tokens=2)))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for call in calls:
            call.cancel()
        assert wait_pool_idle(c).pages_used == 0
        r = collect(list(c.generate(Request("x", max_new_tokens=2, ignore_eos=True))))
        assert r.finished.new_tokens == 2


def finished_counts(server: ServerProcess) -> dict[str, float]:
    """dyngen_jobs_finished_total by its reason label."""
    counts = {}
    for line in scrape("127.0.0.1", server.metrics_port).splitlines():
        if line.startswith("dyngen_jobs_finished_total{"):
            label, value = line.split("} ")
            counts[label.split('reason="')[1].rstrip('"')] = float(value)
    return counts


def test_jobs_that_end_unfinished_are_counted_by_how_they_ended(tiny_server: ServerProcess) -> None:
    """A job whose stream ended before it did is counted once, by how: its engine's JobFinished
    reaches nobody, so without this, deadlines and disconnects went uncounted."""
    long = Request("once", max_new_tokens=4000, ignore_eos=True)
    before = finished_counts(tiny_server)
    with tiny_server.client() as c:
        with pytest.raises(grpc.RpcError) as info:
            list(c.stub.Generate(long.to_proto(), timeout=0.5))
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        call = c.stub.Generate(long.to_proto(), timeout=120)
        next(call)
        call.cancel()
        c.enqueue(long)  # never streamed: dropped after --stream-grace-seconds
        c.cancel(c.enqueue(Request("x", max_new_tokens=4000, ignore_eos=True)))
        expected = {"deadline_exceeded": 1.0, "caller_gone": 1.0, "not_streamed": 1.0, "cancelled": 1.0}
        deadline = time.monotonic() + 30
        while True:
            after = finished_counts(tiny_server)
            grown = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in {*after, *before}}
            grown = {k: v for k, v in grown.items() if v}
            if grown.keys() >= expected.keys() or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert wait_pool_idle(c).pages_used == 0
    assert grown == expected  # the Cancel's job by its own JobFinished, the others by how they ended


def reflection_refused(target: str) -> grpc.StatusCode:
    """The status a token-less reflection listing ends with (it must fail)."""
    with grpc.insecure_channel(target) as channel:
        reflect = channel.stream_stream(
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as info:
            list(reflect(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
        code: grpc.StatusCode = info.value.code()
        return code


def test_reflection_can_be_switched_off(tiny_server: ServerProcess) -> None:
    assert reflection_refused(tiny_server.target) == grpc.StatusCode.UNIMPLEMENTED


def test_metrics_listen_on_their_own_address(tiny_model: Path) -> None:
    s = start_tiny_server(tiny_model, "--metrics-host", "127.0.0.2")
    try:
        assert "dyngen_engine_up 1.0" in scrape("127.0.0.2", s.metrics_port)
        with pytest.raises(urllib.error.URLError):
            scrape("127.0.0.1", s.metrics_port)
    finally:
        assert s.stop() == 0


@pytest.mark.parametrize("taken", ["grpc", "metrics"])
def test_a_port_in_use_fails_the_start_in_one_line(taken: str, tmp_path: Path) -> None:
    """gRPC's Linux default (SO_REUSEPORT) would let the server bind a port another server holds
    and quietly take part of its calls: the start fails instead, before any engine runs."""
    with socket.socket() as held, socket.socket() as free:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as another gRPC server's
        held.bind(("127.0.0.1", 0))
        held.listen()
        free.bind(("127.0.0.1", 0))
        ports = {"grpc": held.getsockname()[1], "metrics": free.getsockname()[1]}
        if taken == "metrics":
            ports = {"grpc": ports["metrics"], "metrics": ports["grpc"]}
        free.close()  # the other port is free again for the server
        config = ServiceConfig(
            model=str(tmp_path / "never-loaded.gguf"),
            host="127.0.0.1",
            port=ports["grpc"],
            metrics_port=ports["metrics"],
        )
        with pytest.raises(
            SystemExit, match=f"cannot (listen|serve metrics) on 127.0.0.1:{held.getsockname()[1]}"
        ):
            asyncio.run(serve(config))


def test_a_certificate_that_is_not_one_fails_the_start_naming_it(tmp_path: Path) -> None:
    """gRPC itself would report a bad certificate as a port it cannot bind."""
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    config = ServiceConfig(
        model=str(tmp_path / "never-loaded.gguf"), port=0, tls_cert=str(junk), tls_key=str(junk)
    )
    with pytest.raises(SystemExit, match=f"--tls-cert {junk} and --tls-key {junk} are not a PEM"):
        asyncio.run(serve(config))


def test_a_model_the_engine_refuses_ends_the_start_with_status_2(tmp_path: Path) -> None:
    """As `dyngen generate` does for the same model: 2 is a refused configuration, which a
    supervisor need not retry; the reason is one line."""
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", "--port", "0", "--model", str(tmp_path / "nope.gguf")],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"dyngen: engine error: model not found: {tmp_path / 'nope.gguf'}" in done.stderr
    assert "refused its configuration" in done.stderr and "Traceback" not in done.stderr


PAGE_SIZE = 16


def test_tokens_own_jobs_and_salt_the_prefix_cache(tiny_model: Path, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    alice, bob = "alice-token-0123456789", "bob-token-9876543210xx"
    tokens.write_text(f"alice {alice}\nbob {bob}\n")
    s = start_tiny_server(tiny_model, "--auth-tokens-file", str(tokens), "--page-size", str(PAGE_SIZE))
    prompt = "The same long system prompt, shared by everyone who sends it. " * 3
    try:
        assert s.health() == health_pb2.HealthCheckResponse.SERVING  # probes need no token
        with Client(s.target) as anonymous:
            with pytest.raises(grpc.RpcError) as info:
                list(anonymous.generate(Request("hi", max_new_tokens=2)))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert reflection_refused(s.target) == grpc.StatusCode.UNAUTHENTICATED  # reflection is guarded too
        with Client(s.target, token="not-a-token-at-all") as stranger:
            with pytest.raises(grpc.RpcError) as info:
                stranger.model_info()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with Client(s.target, token=alice) as a, Client(s.target, token=bob) as b:
            job = a.enqueue(Request("a private job", max_new_tokens=2000, ignore_eos=True))
            for attempt in (lambda: list(b.stream(job, timeout=10)), lambda: b.cancel(job, timeout=10)):
                with pytest.raises(grpc.RpcError) as info:
                    attempt()
                assert info.value.code() == grpc.StatusCode.NOT_FOUND
            a.cancel(job)
            ended = collect(list(a.stream(job, timeout=30)))
            assert ended.finished.stop_reason == pb.STOP_REASON_CANCELLED

            def cached(client: Client, salt: str = "") -> int:
                req = Request(prompt, max_new_tokens=1, ignore_eos=True, cache_salt=salt)
                return collect(list(client.generate(req, timeout=60))).finished.cached_tokens

            first = cached(a)
            assert cached(a) >= PAGE_SIZE > first  # alice's second request hits her pages
            assert cached(b) == 0  # bob's identical prompt never sees them
            assert cached(a, salt="other") == 0  # nor does alice's own request under another salt
            assert cached(b) >= PAGE_SIZE  # bob now hits his own
        # The gateway's worker contract sits behind the same tokens, and a tenant cannot flush the
        # prefix pages every tenant shares the cache with.
        with grpc.insecure_channel(s.target) as channel:
            flush = channel.unary_unary(
                "/vllm.grpc.engine.VllmEngine/FlushCache",
                request_serializer=cpb.FlushCacheRequest.SerializeToString,
                response_deserializer=cpb.FlushCacheResponse.FromString,
            )
            for metadata, code in (
                ((), grpc.StatusCode.UNAUTHENTICATED),
                ((("authorization", f"Bearer {alice}"),), grpc.StatusCode.PERMISSION_DENIED),
            ):
                with pytest.raises(grpc.RpcError) as info:
                    flush(cpb.FlushCacheRequest(), metadata=metadata, timeout=10)
                assert info.value.code() == code
                wanted = (
                    ErrorReason.NOT_PERMITTED
                    if code == grpc.StatusCode.PERMISSION_DENIED
                    else ErrorReason.UNAUTHENTICATED
                )
                assert error_details(info.value).reason is wanted
        token_file = tmp_path / "alice.token"
        token_file.write_text(alice + "\n")
        cli = [
            sys.executable,
            "-m",
            "service.cli",
            "generate",
            "hi",
            "--server",
            s.target,
            "--max-new-tokens",
            "3",
        ]
        ok = subprocess.run(
            [*cli, "--token-file", str(token_file), "--json"], check=False, capture_output=True, text=True
        )
        assert ok.returncode == 0 and json.loads(ok.stdout)["new_tokens"] >= 1, ok.stderr
        refused = subprocess.run(
            cli, check=False, capture_output=True, text=True, env={**os.environ, "DYNGEN_TOKEN": ""}
        )
        assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr
        full_ids = [str(r.get("job")) for r in s.logs if "job" in r]
        assert full_ids and all(len(j) == 8 for j in full_ids)
        assert not any(job in str(r) for r in s.logs)
    finally:
        assert s.stop() == 0


def test_mtls_requires_a_client_certificate_and_names_the_tenant(tiny_model: Path, tmp_path: Path) -> None:
    ca = CertAuthority(tmp_path)
    server_pair = ca.issue("localhost", server=True)
    alice, bob = ca.issue("alice"), ca.issue("bob")
    s = launch_server(
        "--model",
        str(tiny_model),
        "--cache-tokens",
        "8192",
        "--tls-cert",
        str(server_pair.cert),
        "--tls-key",
        str(server_pair.key),
        "--tls-client-ca",
        str(ca.pair.cert),
    )
    try:
        s.wait_log("engine_ready")
        no_cert = tls_credentials(str(ca.pair.cert))
        with Client(s.target, credentials=no_cert) as c:
            with pytest.raises(grpc.RpcError) as info:
                c.model_info(timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        as_alice = tls_credentials(str(ca.pair.cert), str(alice.cert), str(alice.key))
        as_bob = tls_credentials(str(ca.pair.cert), str(bob.cert), str(bob.key))
        with Client(s.target, credentials=as_alice) as a, Client(s.target, credentials=as_bob) as b:
            deadline = time.monotonic() + 30
            while True:  # engine_ready is logged just before health flips; calls may race it
                try:
                    a.model_info(timeout=10)
                    break
                except grpc.RpcError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            r = collect(list(a.generate(Request("hi", max_new_tokens=3, ignore_eos=True), timeout=60)))
            assert r.finished.new_tokens == 3
            job = a.enqueue(Request("mine", max_new_tokens=1000, ignore_eos=True))
            with pytest.raises(grpc.RpcError) as info:
                b.cancel(job, timeout=10)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            a.cancel(job, timeout=10)
    finally:
        assert s.stop() == 0


@pytest.mark.slow
def test_deadlines_passing_before_acceptance_leave_no_job() -> None:
    """50 Generate calls with 20 ms deadlines against a busy engine (the real model): every one
    ends DEADLINE_EXCEEDED and none keeps running in the engine."""
    s = start_server("--cache-tokens", "16384", "--stream-grace-seconds", "600")
    try:
        with s.client() as c:
            busy = [
                c.enqueue(Request(Chat.user(f"Tell me story {i}."), max_new_tokens=3000, ignore_eos=True))
                for i in range(4)
            ]
            deadline = time.monotonic() + 60
            while c.model_info().running_jobs < 4:
                assert time.monotonic() < deadline
                time.sleep(0.1)

            async def storm() -> list[grpc.StatusCode]:
                async with AsyncClient(s.target) as ac:

                    async def one(i: int) -> grpc.StatusCode:
                        req = Request(Chat.user(f"Question {i}?"), max_new_tokens=500, ignore_eos=True)
                        try:
                            async for _ in ac.generate(req, timeout=0.02):
                                pass
                        except grpc.aio.AioRpcError as exc:
                            return exc.code()
                        return grpc.StatusCode.OK

                    return await asyncio.gather(*(one(i) for i in range(50)))

            codes = asyncio.run(storm())
            assert set(codes) == {grpc.StatusCode.DEADLINE_EXCEEDED}
            settle = time.monotonic() + 15
            while True:
                info = c.model_info()
                if (info.running_jobs, info.queued_jobs) == (4, 0) or time.monotonic() > settle:
                    break
                time.sleep(0.1)
            assert (info.running_jobs, info.queued_jobs) == (4, 0)
            for job in busy:
                c.cancel(job)
            assert wait_pool_idle(c).pages_used == 0
    finally:
        assert s.stop() == 0


def test_an_engine_left_running_at_exit_is_killed_not_waited_on(tmp_path: Path) -> None:
    """An engine ignores SIGTERM, which multiprocessing ends its daemon children with at exit
    before waiting for them: a front end that exits without stopping its engine (an error on the
    way out) kills it instead of waiting forever."""
    script = (
        "import sys\n"
        "from service.engine_config import EngineConfig, EngineSettings\n"
        "from service.engine_spawn import spawn_engine\n"
        f"e = spawn_engine(EngineConfig(EngineSettings(model=None)).to_json(), {str(tmp_path)!r}, spare=True)\n"
        "assert e.events.poll(60)\n"  # its first heartbeat: its signals are set by then
        "print(e.process.pid, flush=True)\n"
        "sys.exit(0)\n"
    )
    child = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60
    )
    assert child.returncode == 0, child.stderr
    pid = int(child.stdout.split()[0])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
