"""An engine crash loses no job: against a live server (real engine process, loopback), 16 open
streams of every kind (greedy, seeded sampling, a JSON schema, stop strings, banned strings, a
run-time LoRA adapter, guidance, penalties) survive a SIGKILL, a SIGSTOP (a hang the watchdog
replaces) and two SIGKILLs in a row: each ends OK with the tokens, text and stop reason of the same
requests on an engine nobody killed, no token twice and usage counts matching. A request that
kills the engine whenever it runs (the test-only --fault-crash-marker hook) ends INTERNAL after
two crashes, and every other job completes.

The shipped model with the server's defaults (--quant auto: its own quantized linears; --kv-cache
auto: float16, bfloat16 where it times faster, or int8 on AMX tiles): a token's numbers do not
depend on what runs beside it or on how its job's tokens were split into steps (the native
attention attends each chunk token as a decode row; adapter deltas are made a row at a time), so
a resumed stream is held to the uninterrupted run's tokens exactly. The kill-to-first-resumed-token times are printed (`-s`) for
the record.
"""

from __future__ import annotations

import os
import signal
import statistics
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from benchmarks.inprocess.lora_throughput import write_adapter
from dyngen_client.errors import ErrorReason, error_details
from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from dyngen_client.request import Chat, Guidance, JsonSchema, Request, Sampling
from engine.model.gguf_source import GGUFSource
from engine.model.shipped_model import default_model_path
from tests.service_harness import ServerProcess, log_count, start_server

pytestmark = pytest.mark.slow

MARKER = "crash-resume-poison"
N = 64


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    config = GGUFSource(default_model_path()).config
    write_adapter(root / "mine", config, 4, ["q_proj", "down_proj"], range(config.num_layers), 2, scale=0.3)
    return root


@pytest.fixture(scope="module")
def server(adapter_root: Path) -> Iterator[ServerProcess]:
    s = start_server(
        *("--adapter-dir", str(adapter_root)),
        *("--watchdog-seconds", "1", "--hang-seconds", "2", "--fault-crash-marker", MARKER),
        *("--spare-engine", "true"),
    )
    with s.client() as c:
        c.load_adapter("mine", "mine")  # a run-time load: loaded again on every restarted engine
    s.wait_log("engine_spare_started")
    time.sleep(4)  # its imports done: the first kill finds it waiting
    yield s
    assert s.stop() == 0


def requests() -> list[Request]:
    topics = [
        "Tell me a story about a dragon.",
        "Explain how rain forms.",
        "Write a poem about the sea.",
        "Describe a busy city street.",
        "What makes a good friend?",
    ]
    schema: dict[str, object] = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
        "required": ["name", "age", "city"],
    }
    return [
        *(Request(Chat.user(t), max_new_tokens=N) for t in topics),
        *(
            Request(Chat.user(t), max_new_tokens=N, sampling=Sampling(temperature=0.8, seed=100 + i))
            for i, t in enumerate(topics)
        ),
        Request(
            Chat.user("Describe a person as JSON."),
            max_new_tokens=N,
            response_format=JsonSchema(schema),
            sampling=Sampling(temperature=0.8, seed=7),
        ),
        Request(
            Chat.user("List ten fruits, one per line, numbered."), max_new_tokens=N, stop_strings=("7.",)
        ),
        Request(
            Chat.user("What is the capital of France? Explain its history."),
            max_new_tokens=N,
            banned_strings=("Paris", "capital"),
            sampling=Sampling(temperature=0.8, seed=3),
        ),
        Request(Chat.user("Tell me about cats."), max_new_tokens=N, adapter="mine"),
        Request(
            Chat.user("Write about the moon."),
            max_new_tokens=N,
            guidance=Guidance(1.5, Chat.user("Write.")),
            sampling=Sampling(temperature=0.8, seed=5),
        ),
        Request(
            Chat.user("Describe your favourite food."),
            max_new_tokens=N,
            sampling=Sampling(temperature=0.7, seed=9, repetition_penalty=1.2, frequency_penalty=0.3),
        ),
    ]


@dataclass
class Stream:
    """One Generate call on a thread of its own, and everything it received."""

    request: Request
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    token_times: list[float] = field(default_factory=list)
    finished: pb.JobFinished | None = None
    error: grpc.RpcError | None = None
    starts: int = 0
    done: threading.Event = field(default_factory=threading.Event)

    def run(self, server: ServerProcess) -> None:
        try:
            with server.client() as c:
                for event in c.generate(self.request, timeout=240):
                    if event.HasField("started"):
                        self.starts += 1
                    elif event.HasField("delta"):
                        self.tokens.extend(event.delta.token_ids)
                        self.text += event.delta.text
                        self.token_times.extend([time.monotonic()] * len(event.delta.token_ids))
                    elif event.HasField("finished"):
                        self.finished = event.finished
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.done.set()


def run_streams(
    server: ServerProcess, reqs: list[Request], during: Callable[[list[Stream]], None]
) -> list[Stream]:
    streams = [Stream(r) for r in reqs]
    threads = [threading.Thread(target=s.run, args=(server,), daemon=True) for s in streams]
    for t in threads:
        t.start()
    during(streams)
    for t in threads:
        t.join(300)
    return streams


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def mid_generation(streams: list[Stream], at_least: int = 4) -> None:
    """Every stream has some tokens (or ended): the kill comes mid-generation."""
    wait_until(lambda: all(len(s.tokens) >= at_least or s.done.is_set() for s in streams), 120, "tokens")


def kill(server: ServerProcess, sig: signal.Signals) -> tuple[int, float]:
    """Signal the engine; (log mark, when)."""
    mark = len(server.logs)
    os.kill(server.engine_pid(), sig)
    return mark, time.monotonic()


@pytest.fixture(scope="module")
def reference(server: ServerProcess) -> list[Stream]:
    streams = run_streams(server, requests(), lambda _: None)
    for s in streams:
        assert s.error is None and s.finished is not None, s.error
    return streams


def check_like_reference(streams: list[Stream], reference: list[Stream]) -> None:
    for s, ref in zip(streams, reference, strict=True):
        assert s.error is None, (s.request.prompt, s.error)
        assert s.finished is not None and ref.finished is not None
        assert s.starts == 1  # the caller saw its job start once
        assert len(s.tokens) == s.finished.new_tokens  # no token twice, none missing, usage right
        assert s.tokens == ref.tokens, s.request.prompt
        assert s.text + s.finished.text == ref.text + ref.finished.text
        assert s.finished.stop_reason == ref.finished.stop_reason
        assert s.finished.prompt_tokens == ref.finished.prompt_tokens


def first_tokens_after(streams: list[Stream], when: float) -> list[float]:
    """Per stream still open at `when`: seconds from `when` to its next token."""
    return [
        next(t for t in s.token_times if t > when) - when
        for s in streams
        if any(t > when for t in s.token_times)
    ]


def report(what: str, delays: list[float], server: ServerProcess, mark: int) -> None:
    recovered = server.wait_log("engine_recovered", after=mark)
    print(
        f"\n{what}: first resumed token after {statistics.median(delays):.2f} s (p50), "
        f"{max(delays):.2f} s (max) over {len(delays)} streams; outage {recovered['outage_seconds']} s"
    )


def test_model_info_names_the_autotune_cache_without_its_server_path(server: ServerProcess) -> None:
    """GetModelInfo is every caller's: the autotuned linears name their cache file, not its folder."""
    with server.client() as c:
        linears = c.model_info().linears
    assert "linear-autotune" in linears, linears  # the server's defaults autotune (--quant auto)
    assert "/linear-autotune" not in linears and os.sep + "linear-autotune" not in linears, linears


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["sigkill", "sigstop-hang"])
def test_a_dead_or_hung_engine_only_pauses_every_stream(
    server: ServerProcess, reference: list[Stream], sig: signal.Signals
) -> None:
    """SIGKILL: the engine is gone at once. SIGSTOP: it hangs, and the watchdog replaces it."""
    hit: list[tuple[int, float]] = []

    def during(streams: list[Stream]) -> None:
        mid_generation(streams)
        hit.append(kill(server, sig))

    streams = run_streams(server, requests(), during)
    check_like_reference(streams, reference)
    mark, when = hit[0]
    if sig is signal.SIGSTOP:
        assert log_count(server, "engine_hung") >= 1
    report(sig.name, first_tokens_after(streams, when), server, mark)
    record = server.wait_log("engine_recovered", after=mark)
    assert record["poisoned"] == []
    assert len(record["resumed"]) >= 8  # type: ignore[arg-type]


def test_a_second_sigkill_while_resumed_jobs_run_resumes_them_again(
    server: ServerProcess, reference: list[Stream]
) -> None:
    def during(streams: list[Stream]) -> None:
        mid_generation(streams)
        mark, when = kill(server, signal.SIGKILL)
        server.wait_log("engine_recovered", after=mark)
        # Every open stream has had a token from the restarted engine: then kill it again.
        wait_until(
            lambda: all(s.done.is_set() or any(t > when for t in s.token_times) for s in streams),
            120,
            "resumed",
        )
        kill(server, signal.SIGKILL)

    streams = run_streams(server, requests(), during)
    check_like_reference(streams, reference)


def test_a_request_the_engine_died_without_answering_resumes_on_the_next(
    server: ServerProcess, reference: list[Stream]
) -> None:
    """Its SUBMIT is in the pipe when the engine hangs (SIGSTOP, before the watchdog notices) and
    the engine is replaced: the call neither fails nor runs twice. It waits for the successor as a
    suspect (the engine may have died admitting it), is tried alone, and gives the uninterrupted
    run's tokens."""
    mark = len(server.logs)
    os.kill(server.engine_pid(), signal.SIGSTOP)
    (stream,) = run_streams(server, requests()[:1], lambda _: None)
    check_like_reference([stream], reference[:1])
    assert any(r.get("event") == "engine_hung" for r in list(server.logs)[mark:])
    record = server.wait_log("engine_recovered", after=mark)
    assert record["poisoned"] == [] and record["resumed"] == [] and len(record["probes"]) == 1  # type: ignore[arg-type]


def test_a_request_that_kills_the_engine_is_isolated(server: ServerProcess, reference: list[Stream]) -> None:
    greedy = requests()[:4]
    marker = Request(Chat.user("Anything."), max_new_tokens=N, identifier=MARKER)
    mark = len(server.logs)
    poisoned: list[Stream] = []

    def during(streams: list[Stream]) -> None:
        mid_generation(streams)
        poison = Stream(marker)
        poisoned.append(poison)
        threading.Thread(target=poison.run, args=(server,), daemon=True).start()
        poison.done.wait(120)

    streams = run_streams(server, greedy, during)
    check_like_reference(streams, reference[:4])
    (poison,) = poisoned
    assert poison.error is not None and poison.error.code() == grpc.StatusCode.INTERNAL
    assert error_details(poison.error).reason is ErrorReason.JOB_FAILED
    assert "engine failed twice" in str(poison.error.details())
    assert poison.tokens == []
    downs = [r for r in server.logs[mark:] if r.get("event") == "engine_down"]
    assert len(downs) == 2 and downs[0]["poisoned"] == [] and len(downs[1]["poisoned"]) == 1  # type: ignore[arg-type]
    assert server.health() == health_pb2.HealthCheckResponse.SERVING
    metrics = scrape(server)
    assert "dyngen_jobs_poisoned_total 1.0" in metrics
    assert "dyngen_jobs_resumed_total" in metrics and "dyngen_engine_outage_seconds_count" in metrics


def scrape(server: ServerProcess) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5) as r:
        text: str = r.read().decode()
        return text
