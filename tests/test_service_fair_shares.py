"""Fair shares through `dyngen serve` with authentication (a tiny random-weight model on
127.0.0.1): tenant A floods 200 jobs, and tenant B's single job still gets its first token within a
few engine iterations (the bound of docs/ARCHITECTURE.md: the next iteration, plus the ones that
pass while the calls travel); and a tenant that fills its part of the queue is RESOURCE_EXHAUSTED
with a retry delay, while others are not."""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from dyngen_client.client import Client
from dyngen_client.errors import PUSHBACK_KEY, ErrorReason, error_details
from dyngen_client.request import Request
from tests.service_harness import ServerProcess, start_tiny_server
from tests.tiny_service_model import write_servable_tiny_gguf

pytestmark = [pytest.mark.timeout(300)]

ALICE, BOB = "alice-token-0123456789", "bob-token-9876543210xx"
# Iterations between reading the counter before B's request and after its first token, beyond the
# one the scheduler needs: the iteration in progress when B's request arrives, and those that run
# while B's request, its first token and the second GetModelInfo travel (each a few ms; an
# iteration of 64 tiny jobs takes about as long).
SLACK = 6
BATCH = 64  # the batch these counts are written for (the flood fills it, its rows hold some of A's jobs)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("fair")
    model = write_servable_tiny_gguf(folder / "tiny.gguf")
    tokens = folder / "tokens"
    tokens.write_text(f"alice {ALICE}\nbob {BOB}\n")
    s = start_tiny_server(
        model,
        "--auth-tokens-file",
        str(tokens),
        "--max-queue-per-tenant",
        "220",
        "--stream-grace-seconds",
        "120",
        "--max-batch-size",
        str(BATCH),
    )
    yield s
    assert s.stop() == 0


def _cancel(client: Client, jobs: list[str]) -> None:
    """Cancel what is left of `jobs` (one that ended meanwhile is NOT_FOUND: nothing to do)."""
    for job in jobs:
        with contextlib.suppress(grpc.RpcError):
            client.cancel(job)


def _first_token(client: Client, prompt: list[int]) -> tuple[float, int, int]:
    """(TTFT in seconds, the engine's iterations before the call and after its first token)."""
    before = client.model_info().iterations
    start = time.perf_counter()
    ttft = 0.0
    for event in client.generate(Request(prompt, max_new_tokens=4, ignore_eos=True)):
        if event.HasField("delta") and not ttft:
            ttft = time.perf_counter() - start
            after = client.model_info().iterations
    return ttft, before, after


def test_a_flood_from_one_tenant_leaves_another_its_first_token_in_a_few_iterations(
    server: ServerProcess,
) -> None:
    with Client(server.target, token=ALICE) as a, Client(server.target, token=BOB) as b:
        idle = [_first_token(b, [20 + i, 21, 22, 23, 24])[0] for i in range(5)]
        flood = [
            a.enqueue(Request([30 + i % 40, 31, 32, 33], max_new_tokens=400, ignore_eos=True))
            for i in range(200)
        ]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            info = a.model_info()
            if info.running_jobs == info.max_batch_size and info.queued_jobs >= 100:
                break
            time.sleep(0.05)
        assert info.running_jobs == info.max_batch_size and info.queued_jobs >= 100, info
        ttft, before, after = _first_token(b, [50, 51, 52, 53, 54])
        print(
            f"B's TTFT: idle median {statistics.median(idle) * 1000:.1f} ms, under A's flood "
            f"{ttft * 1000:.1f} ms, {after - before} engine iterations"
        )
        assert after - before <= 1 + SLACK
        left = a.model_info()
        assert left.queued_jobs >= 100  # A's flood was still waiting: B did not just find a quiet moment
        # B's job took a row from one of A's (the batch was full): the metrics count the preemption.
        assert _preemptions(server, at_least=1) >= 1
        _cancel(a, flood)


def _preemptions(server: ServerProcess, at_least: int) -> float:
    """dyngen_preemptions_total once it reaches `at_least` (the engine's stats come periodically)."""
    deadline = time.monotonic() + 10
    while True:
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        count = next(
            float(line.split()[1])
            for line in text.splitlines()
            if line.startswith("dyngen_preemptions_total ")
        )
        if count >= at_least or time.monotonic() > deadline:
            return count
        time.sleep(0.2)


def test_a_tenant_past_its_part_of_the_queue_is_told_when_to_retry(server: ServerProcess) -> None:
    """RESOURCE_EXHAUSTED with RetryInfo (and gRPC's pushback of the same delay); a client with
    retries on waits that long and tries again, and gets in once room was made meanwhile."""
    with Client(server.target, token=ALICE) as a, Client(server.target, token=BOB) as b:
        held: list[str] = []
        with pytest.raises(grpc.RpcError) as exc:
            for i in range(400):
                held.append(a.enqueue(Request([60 + i % 30, 61, 62], max_new_tokens=400, ignore_eos=True)))
        details = error_details(exc.value)
        assert (exc.value.code(), details.reason) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            ErrorReason.QUEUE_FULL,
        )
        assert "max-queue-per-tenant" in details.message
        assert details.retry_delay_seconds is not None and 0 < details.retry_delay_seconds <= 30
        pushback = next((m.value for m in exc.value.trailing_metadata() or () if m.key == PUSHBACK_KEY), None)
        assert str(pushback) == str(round(details.retry_delay_seconds * 1000))
        assert 220 <= len(held) <= 220 + BATCH  # its part of the queue, and the batch's rows
        job = b.enqueue(Request([70, 71, 72], max_new_tokens=2, ignore_eos=True))  # B's part is its own
        _cancel(b, [job])

        # Retries on: the refusal is retried after its delay; room made meanwhile lets it in.
        request = Request([80, 81, 82], max_new_tokens=2, ignore_eos=True)
        with pytest.raises(grpc.RpcError):
            a.enqueue(request)  # no retries: refused at once

        def make_room() -> None:
            _cancel(a, held[:40])

        threading.Timer(0.3, make_room).start()
        with Client(server.target, token=ALICE, retries=4) as patient:
            started = time.monotonic()
            job = patient.enqueue(request)
            assert job and time.monotonic() - started >= 0.1
        _cancel(a, [*held[40:], job])
