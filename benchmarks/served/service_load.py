"""W4: W1 through the gRPC server with 64 concurrent streaming clients, vs W1 in-process.

Starts `dyngen serve` on 127.0.0.1 and a free port, drives it with our own grpc.aio load
generator (one stream per W1 request, all at once, each bounded by a deadline), then stops
the server and runs the same W1 prompts through the in-process generator in this process.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from benchmarks.inprocess.throughput import run_dyngen
from benchmarks.table import Row, render
from benchmarks.workloads import load_workloads
from dyngen_client import AsyncClient, Chat, Request
from engine.model.loader import WeightDtype, load_model
from engine.model.tokenizer import ChatMessage
from service import health_probe
from service.cluster import free_port

CALL_TIMEOUT = 600.0
START_TIMEOUT = 180.0


@dataclass(frozen=True)
class StreamTiming:
    tokens: int
    ttft: float  # call start to first text delta
    gaps: tuple[float, ...]  # between consecutive deltas
    error: str | None


@dataclass(frozen=True)
class LoadResult:
    seconds: float
    streams: tuple[StreamTiming, ...]

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.streams)

    @property
    def errors(self) -> int:
        return sum(1 for s in self.streams if s.error is not None)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def wait_serving(target: str, process: subprocess.Popen[bytes] | None, timeout: float) -> None:
    try:
        health_probe.wait_serving(target, timeout, lambda: None if process is None else process.poll())
    except health_probe.NotServingError as e:
        raise SystemExit(str(e)) from None


async def _one(client: AsyncClient, request: Request) -> StreamTiming:
    t0 = time.perf_counter()
    last: float | None = None
    ttft = float("nan")
    gaps: list[float] = []
    tokens = 0
    try:
        async for event in client.generate(request, timeout=CALL_TIMEOUT):
            if event.HasField("delta"):
                now = time.perf_counter()
                if last is None:
                    ttft = now - t0
                else:
                    gaps.append(now - last)
                last = now
                tokens += len(event.delta.token_ids)
    except grpc.aio.AioRpcError as exc:
        return StreamTiming(tokens, ttft, tuple(gaps), exc.code().name)
    return StreamTiming(tokens, ttft, tuple(gaps), None)


async def drive(target: str, requests: list[Request], concurrency: int) -> LoadResult:
    """At most `concurrency` streams open at once, every request once."""
    gate = asyncio.Semaphore(concurrency)
    async with AsyncClient(target) as client:

        async def bounded(r: Request) -> StreamTiming:
            async with gate:
                return await _one(client, r)

        t0 = time.perf_counter()
        streams = await asyncio.gather(*(bounded(r) for r in requests))
        return LoadResult(time.perf_counter() - t0, tuple(streams))


def run_service(dtype: WeightDtype, requests: list[Request], concurrency: int) -> LoadResult:
    port = free_port()
    target = f"127.0.0.1:{port}"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "service.cli", "serve", "--port", str(port), "--dtype", dtype.value),
            *("--cache-tokens", "32768", "--max-batch-size", "64"),
        ],
        env=env,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_serving(target, process, START_TIMEOUT)
        return asyncio.run(drive(target, requests, concurrency))
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


def run(dtypes: list[WeightDtype], workloads: Path | None, concurrency: int = 64) -> str:
    w = load_workloads(workloads)["W1"]
    new_tokens, ignore_eos = int(w["max_new_tokens"]), bool(w["ignore_eos"])
    requests = [
        Request(Chat.user(m), max_new_tokens=new_tokens, ignore_eos=ignore_eos) for m in w["user_messages"]
    ]
    rows: list[Row] = []
    latency = [
        "",
        "| dtype | TTFT p50 / p90 / p99 s | inter-token p50 / p90 / p99 ms | errors |",
        "| --- | --- | --- | ---: |",
    ]
    for dtype in dtypes:
        served = run_service(dtype, requests, concurrency)
        loaded = load_model(None, dtype, progress=False)
        prompts = [tuple(loaded.tokenizer.encode_chat([ChatMessage("user", m)])) for m in w["user_messages"]]
        local = run_dyngen(loaded, prompts, new_tokens, ignore_eos)
        del loaded
        gc.collect()
        rows.append(
            Row(
                "dyngen gRPC (W4)",
                dtype.value,
                served.tokens / served.seconds,
                "dyngen in-process (W1)",
                f"{concurrency} streams, {served.seconds:.1f} s wall, {served.errors} errors",
            )
        )
        rows.append(
            Row(
                "dyngen in-process (W1)",
                dtype.value,
                local.tokens_per_second,
                "",
                f"{local.seconds:.1f} s wall, TTFT p50 {local.ttft_p50:.2f} s",
            )
        )
        ttft = [s.ttft for s in served.streams if s.error is None]
        gaps = [g * 1000 for s in served.streams for g in s.gaps]
        latency.append(
            f"| {dtype.value} | {percentile(ttft, 50):.2f} / {percentile(ttft, 90):.2f} / {percentile(ttft, 99):.2f} "
            f"| {percentile(gaps, 50):.0f} / {percentile(gaps, 90):.0f} / {percentile(gaps, 99):.0f} | {served.errors} |"
        )
    table = render(f"W4: W1 through gRPC, {concurrency} concurrent streaming clients", "tok/s", rows)
    return table + "\n" + "\n".join(latency)
