"""Scale-out: two `dyngen serve` replicas behind HAProxy (service/cluster.py), on loopback.

The replicas run the tiny random-weight model: the point is routing, health and draining, not
the text. Prefix-cache hit rate (cached_tokens / prompt_tokens) is deterministic for sequential
requests, so it can be asserted: hashing on the affinity header keeps each system prompt on one
replica (as good as one replica), round robin computes each prompt once per replica.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil  # type: ignore[import-untyped, unused-ignore]
import pytest

from dyngen_client import Chat, Client, ErrorReason, Request, Result, collect, error_details
from service.cluster import Cluster, free_port
from service.haproxy_config import example_config, render
from tests.service_harness import TINY_SERVER_FLAGS
from tests.tiny_service_model import write_servable_tiny_gguf

ROOT = Path(__file__).resolve().parent.parent

needs_haproxy = pytest.mark.skipif(
    shutil.which("haproxy") is None, reason="haproxy not installed (.ci/run installs it)"
)


def test_the_shipped_haproxy_config_is_the_generators() -> None:
    assert (ROOT / "deploy" / "haproxy" / "haproxy.cfg").read_text() == render(example_config())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    folder = tmp_path_factory.mktemp("cluster")
    model = write_servable_tiny_gguf(folder / "tiny.gguf")
    # A drain grace far past the drained job's length, even on a loaded CI machine.
    flags = ["--model", str(model), *TINY_SERVER_FLAGS, "--shutdown-grace-seconds", "120"]
    c = Cluster(2, flags, check_interval_ms=300, workdir=folder)
    c.start()
    try:
        _wait_both_up(c)
        yield c
    finally:
        c.stop()


def _generate(client: Client, request: Request, timeout: float = 30) -> Result:
    return collect(client.generate(request, timeout=timeout))


def _wait_both_up(c: Cluster, timeout: float = 90) -> None:
    """Until requests through HAProxy have reached both replicas."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    with Client(c.target, affinity_chars=None) as client:  # round robin
        while seen != {"replica-0", "replica-1"}:
            assert time.monotonic() < deadline, f"replicas seen: {seen}"
            try:
                seen.add(_generate(client, Request("hi", max_new_tokens=1), 5).finished.replica)
            except grpc.RpcError:
                time.sleep(0.3)


def _system_prompt(tag: str) -> str:
    return " ".join(f"{tag} rule {i}: answer briefly and politely." for i in range(30))


def _hit_rate(target: str, tag: str, affinity: bool) -> tuple[float, set[str]]:
    """A W2-like run: 4 system prompts x 16 questions, in order; cached / prompt tokens."""
    cached = total = 0
    replicas: set[str] = set()
    with Client(target, affinity_chars=2048 if affinity else None) as client:
        for q in range(16):
            for p in range(4):
                chat = Chat((("system", _system_prompt(f"{tag}{p}")), ("user", f"question {q}?")))
                r = _generate(client, Request(chat, max_new_tokens=1))
                cached += r.finished.cached_tokens
                total += r.finished.prompt_tokens
                replicas.add(r.finished.replica)
    return cached / total, replicas


@needs_haproxy
@pytest.mark.timeout(300)
def test_affinity_keeps_the_hit_rate_of_one_replica(cluster: Cluster) -> None:
    single, on = _hit_rate(cluster.replica_target(0), "single", affinity=True)
    affine, _ = _hit_rate(cluster.target, "affine", affinity=True)
    robin, spread = _hit_rate(cluster.target, "robin", affinity=False)
    print(f"hit rate: one replica {single:.3f}, 2 with affinity {affine:.3f}, 2 round robin {robin:.3f}")
    assert on == {"replica-0"}
    assert spread == {"replica-0", "replica-1"}
    assert affine >= 0.9 * single
    assert robin < affine - 0.02  # each replica computes each system prompt once


def _replica_of(client: Client, chat: Chat) -> str:
    return _generate(client, Request(chat, max_new_tokens=1)).finished.replica


class _LongJob:
    """A long generation of `chat` (EOS ignored) on its own thread: its result, or its error."""

    def __init__(self, client: Client, chat: Chat, tokens: int) -> None:
        self.result: Result | None = None
        self.error: grpc.RpcError | None = None
        request = Request(chat, max_new_tokens=tokens, ignore_eos=True)
        self._thread = threading.Thread(target=self._run, args=(client, request))
        self._thread.start()

    def _run(self, client: Client, request: Request) -> None:
        try:
            self.result = _generate(client, request, timeout=120)
        except grpc.RpcError as exc:
            self.error = exc

    def join(self, timeout: float) -> bool:
        """Whether it ended within `timeout` seconds."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


@needs_haproxy
@pytest.mark.timeout(300)
def test_bounded_load_spills_a_hot_prefix_to_the_other_replica(cluster: Cluster) -> None:
    """Six concurrent streams with one key: hash-balance-factor 150 caps a replica at 1.5x the
    average, so the key's replica takes about 4 and the next one on the ring the rest."""
    chat = Chat((("system", _system_prompt("hot")), ("user", "go")))
    with Client(cluster.target) as client:
        home = _replica_of(client, chat)
        jobs = []
        for _ in range(6):
            jobs.append(_LongJob(client, chat, 400))
            time.sleep(0.05)
        assert all(job.join(120) for job in jobs)
    where = [job.result.finished.replica for job in jobs if job.result is not None]
    assert len(where) == 6
    assert 2 <= where.count(home) <= 5, where
    assert set(where) == {"replica-0", "replica-1"}


@needs_haproxy
@pytest.mark.timeout(300)
def test_a_killed_replica_leaves_the_ring_and_rejoins(cluster: Cluster) -> None:
    chat = Chat((("system", _system_prompt("kill")), ("user", "go")))
    with Client(cluster.target) as client:
        victim = int(_replica_of(client, chat).removeprefix("replica-"))
        job = _LongJob(client, chat, 2500)
        time.sleep(1.0)
        killed_at = time.monotonic()
        cluster.signal_replica(victim, signal.SIGKILL)
        assert job.join(30), "the in-flight call on the dead replica hung"
        # HAProxy 2.6 ends it without gRPC trailers; the client raises that as UNAVAILABLE.
        assert job.error is not None and job.error.code() is grpc.StatusCode.UNAVAILABLE
        assert error_details(job.error).reason is ErrorReason.REPLICA_LOST
        # The same key now goes to the survivor, once the health checks have seen the death.
        survivor = f"replica-{1 - victim}"
        while True:
            try:
                if _replica_of(client, chat) == survivor:
                    break
            except grpc.RpcError:
                pass
            assert time.monotonic() - killed_at < 10 * cluster.config.leave_seconds
            time.sleep(0.1)
        cluster.start_replica(victim)
        deadline = time.monotonic() + 90
        while True:  # consistent hashing: its keys return
            try:
                if _replica_of(client, chat) == f"replica-{victim}":
                    break
            except grpc.RpcError as e:
                # The restarted front end listens at once (it loads no torch), before HAProxy has
                # marked the killed one down: calls may reach it while its engine still loads.
                assert e.code() is grpc.StatusCode.UNAVAILABLE, e
            assert time.monotonic() < deadline, "the restarted replica did not rejoin the ring"
            time.sleep(0.3)


@needs_haproxy
@pytest.mark.timeout(300)
def test_sigterm_drains_a_replica(cluster: Cluster) -> None:
    chat = Chat((("system", _system_prompt("drain")), ("user", "go")))
    with Client(cluster.target) as client:
        victim = int(_replica_of(client, chat).removeprefix("replica-"))
        job = _LongJob(client, chat, 600)
        time.sleep(0.5)
        cluster.signal_replica(victim, signal.SIGTERM)
        # New requests keep succeeding, on the other replica once HAProxy has seen it leave.
        deadline = time.monotonic() + 5 * cluster.config.leave_seconds
        while _replica_of(client, chat) != f"replica-{1 - victim}":
            assert time.monotonic() < deadline
        assert job.join(120) and job.result is not None, job.error
        assert job.result.finished.replica == f"replica-{victim}"
        assert len(job.result.token_ids) == 600  # the running job finished in full
        assert cluster.wait_replica(victim, 60) == 0
        cluster.start_replica(victim)
        _wait_both_up(cluster)


@needs_haproxy
@pytest.mark.timeout(300)
@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_drains_the_replicas_before_the_balancer_stops(tmp_path: Path, presses: int) -> None:
    """Ctrl-C in `dyngen cluster`'s terminal signals the foreground process group: the cluster alone
    (its replicas and HAProxy have groups of their own), which drains the replicas, then stops
    HAProxy. (With all of them in its group, the stream through HAProxy was cut: UNAVAILABLE,
    socket closed.) Pressed twice, it ends the replicas' drains: the job's reader gets its
    CANCELLED finish through HAProxy."""
    model = write_servable_tiny_gguf(tmp_path / "tiny.gguf")
    port = free_port()
    command = [
        *(sys.executable, "-m", "service.cli", "cluster", "--replicas", "1", "--port", str(port)),
        *("--check-interval-ms", "300", "--", "--model", str(model), *TINY_SERVER_FLAGS),
        *("--shutdown-grace-seconds", "120"),
    ]
    process = subprocess.Popen(command, stderr=subprocess.DEVNULL, start_new_session=True)
    children: list[psutil.Process] = []
    tokens = 300 if presses == 1 else 3500  # the second press cuts the long one short
    try:
        with Client(f"127.0.0.1:{port}") as client:
            deadline = time.monotonic() + 120
            while True:
                try:
                    _generate(client, Request([5, 6, 7], max_new_tokens=1), timeout=10)
                    break
                except grpc.RpcError:
                    assert process.poll() is None and time.monotonic() < deadline
                    time.sleep(0.3)
            children = psutil.Process(process.pid).children(recursive=True)
            events = client.generate(Request([5, 6, 7], max_new_tokens=tokens, ignore_eos=True), timeout=120)
            first = next(events)  # the job runs
            for _ in range(presses):
                os.killpg(process.pid, signal.SIGINT)
                time.sleep(0.5)
            result = collect([first, *events])
        if presses == 1:
            assert len(result.token_ids) == tokens
        else:
            assert result.stop_reason == "cancelled" and len(result.token_ids) < tokens
        assert process.wait(120) == 0
        assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    finally:
        if process.poll() is None:
            process.kill()
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.kill()
