"""`python -m benchmarks tenants`: what one tenant's actions cost the others, through `dyngen serve`
with the shipped model on 127.0.0.1.

1. Adapter loads while 32 streams run: each stream's inter-token gaps, p50/p99 before, during and
   after a run-time LoadAdapter (rank 16 and rank 64 on every projection), beside how long the read
   itself took (what each stream paused for when the engine loop read the files itself).
2. A flood: tenant A enqueues 200 W1 jobs; tenant B's single request's TTFT and the engine
   iterations it waited, against B's TTFT on the idle server, and against the same request from A
   itself (one tenant: arrival order, what every tenant got before fair shares).
3. A long prompt: tenant A sends a 7600-token prompt (8 new tokens); 1 s later tenant B's single chat request:
   B's TTFT and A's, with the default `--prompt-reserve` and `--prefill-alone-ms`, with forwards
   alone of the whole `--chunk-size` (B waits for the forward in flight), and with neither (arrival
   order: B waits out A's whole prefill).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from benchmarks.inprocess.lora_throughput import write_adapter
from benchmarks.served.service_load import percentile, wait_serving
from benchmarks.workloads import load_workloads
from dyngen_client import AsyncClient, Chat, Request
from engine import defaults
from engine.model.gguf_source import GGUFSource
from engine.model.shipped_model import default_model_path
from kernels.cpu_features import cpu_features
from service.cluster import free_port

LONG_PROMPT = 7600
EVERY = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STREAMS = 32
ALICE, BOB = "alice-benchmark-token-0123", "bob-benchmark-token-456789"


@dataclass(frozen=True)
class Window:
    label: str
    gaps_ms: list[float]

    def row(self) -> str:
        g = self.gaps_ms
        return f"| {self.label} | {len(g)} | {percentile(g, 50):.1f} | {percentile(g, 99):.1f} |"


def _serve(port: int, *flags: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.Popen(
        [sys.executable, "-m", "service.cli", "serve", "--port", str(port), *flags],
        env=env,
        stderr=subprocess.DEVNULL,
    )


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()


async def _stream(client: AsyncClient, request: Request, arrivals: list[float]) -> None:
    async for event in client.generate(request, timeout=600):
        if event.HasField("delta"):
            arrivals.append(time.perf_counter())


async def _adapter_loads(target: str, prompts: list[str]) -> tuple[list[str], list[str]]:
    rows: list[str] = []
    notes: list[str] = []
    async with AsyncClient(target) as client:
        for rank in (16, 64):
            arrivals: list[list[float]] = [[] for _ in range(STREAMS)]
            requests = [Request(Chat.user(p), max_new_tokens=400, ignore_eos=True) for p in prompts[:STREAMS]]
            tasks = [
                asyncio.create_task(_stream(client, r, a)) for r, a in zip(requests, arrivals, strict=True)
            ]
            while min(len(a) for a in arrivals) < 40:  # every stream decoding, well past its prefill
                await asyncio.sleep(0.05)
            await asyncio.sleep(2.0)
            start = time.perf_counter()
            await client.load_adapter(f"rank{rank}", f"rank{rank}")
            end = time.perf_counter()
            await asyncio.sleep(2.0)
            after_end = time.perf_counter()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await client.unload_adapter(f"rank{rank}")
            windows: dict[str, list[float]] = {"before": [], "during": [], "after": []}
            for stamps in arrivals:
                for prev, now in itertools.pairwise(stamps):
                    label = (
                        "before"
                        if now < start
                        else "during"
                        if prev <= end
                        else "after"
                        if now <= after_end
                        else ""
                    )
                    if label:
                        windows[label].append((now - prev) * 1000)
            for label, gaps in windows.items():
                rows.append(Window(f"rank {rank}: {label} the load", gaps).row())
            before, during = percentile(windows["before"], 99), percentile(windows["during"], 99)
            notes.append(
                f"rank {rank}: LoadAdapter took {(end - start) * 1000:.0f} ms; inter-token p99 during / before = "
                f"{during / before:.2f}x"
            )
    return rows, notes


async def _ttft(client: AsyncClient, prompt: str | list[int]) -> tuple[float, int]:
    """(TTFT in seconds, engine iterations from before the call to its first token) of a chat
    message, or of token ids."""
    before = (await client.model_info()).iterations
    start = time.perf_counter()
    request = Request(
        Chat.user(prompt) if isinstance(prompt, str) else prompt, max_new_tokens=8, ignore_eos=True
    )
    async for event in client.generate(request, timeout=600):
        if event.HasField("delta"):
            ttft = time.perf_counter() - start
            after = (await client.model_info()).iterations
            return ttft, after - before
    raise RuntimeError("no token")


async def _flood(target: str, prompts: list[str], question: str) -> list[str]:
    rows: list[str] = []
    async with AsyncClient(target, token=ALICE) as a, AsyncClient(target, token=BOB) as b:
        idle = [await _ttft(b, f"{question} ({i})") for i in range(5)]
        rows.append(
            f"| B alone, idle server (median of 5) | {statistics.median(t for t, _ in idle) * 1000:.0f} | "
            f"{statistics.median(n for _, n in idle):.0f} |"
        )
        for who, client in (("B, beside A's flood (fair shares)", b), ("A itself, behind its own flood", a)):
            jobs = await asyncio.gather(
                *(
                    a.enqueue(
                        Request(Chat.user(prompts[i % len(prompts)]), max_new_tokens=128, ignore_eos=True)
                    )
                    for i in range(200)
                )
            )
            # Until A's jobs fill the batch; on a part too fast for that, until none waits (no flood left
            # to wait for).
            while (info := await a.model_info()).running_jobs < info.max_batch_size and info.queued_jobs:
                await asyncio.sleep(0.05)
            ttft, steps = await _ttft(client, question)
            rows.append(f"| {who} | {ttft * 1000:.0f} | {steps} |")
            for job in jobs:
                with contextlib.suppress(grpc.aio.AioRpcError):  # NOT_FOUND: it ended already
                    await a.cancel(job)
            while (info := await a.model_info()).running_jobs or info.queued_jobs:
                await asyncio.sleep(0.1)
    return rows


async def _behind_long(target: str, long: list[int], question: str) -> tuple[float, float, int]:
    """(A's long prompt's TTFT, B's TTFT when it arrives 1 s into A's prefill, B's iterations waited)."""
    async with AsyncClient(target, token=ALICE) as a, AsyncClient(target, token=BOB) as b:
        await _ttft(b, question)  # its template's pages cached, as in the idle rows
        task = asyncio.create_task(_ttft(a, long))
        await asyncio.sleep(1.0)
        ttft, steps = await _ttft(b, question)
        return (await task)[0], ttft, steps


def _long_prompts(messages: list[str], count: int) -> list[list[int]]:
    """`count` prompts of LONG_PROMPT token ids of W1's messages one after another, the k-th from the
    k-th message on (none shares a first page with another, so no round hits an earlier one's pages)."""
    from engine.model.tokenizer import HFTokenizer

    tokenizer = HFTokenizer(default_model_path())
    pieces: list[list[int]] = []
    for i, m in enumerate(itertools.cycle(messages)):  # until the last prompt has its tokens
        pieces.append(tokenizer.encode(f"{m} ({i})\n", add_special_tokens=False))
        if sum(len(p) for p in pieces[count - 1 :]) >= LONG_PROMPT:
            break
    prompts: list[list[int]] = []
    for k in range(count):
        ids: list[int] = []
        for piece in pieces[k:]:
            ids += piece
            if len(ids) >= LONG_PROMPT:
                break
        prompts.append(ids[:LONG_PROMPT])
    return prompts


# (--prompt-reserve, --prefill-alone-ms) of the long-prompt table: the defaults; a forward alone the
# whole --chunk-size; and arrival order with it (the scheduler before either).
BEHIND_LONG = (
    (defaults.PROMPT_RESERVE, defaults.PREFILL_ALONE_MS),
    (defaults.PROMPT_RESERVE, 0.0),
    (0.0, 0.0),
)


def _behind_long_table(tokens: Path, prompts: list[str]) -> list[str]:
    """Tenant A's long prompt and tenant B's chat request 1 s after it, two rounds per setting of
    BEHIND_LONG, each round with a long prompt of its own (no prefix hits)."""
    longs = iter(_long_prompts(prompts, 2 * len(BEHIND_LONG)))
    rows = []
    for reserve, alone_ms in BEHIND_LONG:
        port = free_port()
        server = _serve(
            port,
            "--auth-tokens-file",
            str(tokens),
            "--prompt-reserve",
            str(reserve),
            "--prefill-alone-ms",
            str(alone_ms),
        )
        try:
            wait_serving(f"127.0.0.1:{port}", server, 180)
            for _ in range(2):
                a, b, steps = asyncio.run(
                    _behind_long(f"127.0.0.1:{port}", next(longs), "What is the capital of France?")
                )
                rows.append(f"| {reserve} | {alone_ms:g} | {a:.2f} | {b * 1000:.0f} | {steps} |")
        finally:
            _stop(server)
    return [
        f"Tenant A sends one {LONG_PROMPT}-token prompt (8 new tokens); 1 s later tenant B one chat request:",
        "",
        "| --prompt-reserve | --prefill-alone-ms | A's TTFT s | B's TTFT ms | engine iterations B waited |",
        "| --- | ---: | ---: | ---: | ---: |",
        *rows,
    ]


def run(workloads: Path | None) -> str:
    w1 = load_workloads(workloads)["W1"]
    prompts = [str(m) for m in w1["user_messages"]]
    out = ["### Tenants: adapter loads beside running streams, and a flood beside a single request", ""]
    with tempfile.TemporaryDirectory(prefix="dyngen-tenants-") as tmp:
        root = Path(tmp)
        config = GGUFSource(default_model_path()).config
        for rank in (16, 64):
            write_adapter(root / f"rank{rank}", config, rank, EVERY, range(config.num_layers), rank)
        port = free_port()
        server = _serve(port, "--adapter-dir", str(root), "--max-adapter-bytes", str(256 << 20))
        try:
            wait_serving(f"127.0.0.1:{port}", server, 180)
            rows, notes = asyncio.run(_adapter_loads(f"127.0.0.1:{port}", prompts))
        finally:
            _stop(server)
        out += [
            f"{STREAMS} streams of W1 prompts (400 new tokens each), a LoadAdapter after 2 s of decoding:",
            "",
            "| window | gaps | inter-token p50 ms | p99 ms |",
            "| --- | ---: | ---: | ---: |",
            *rows,
            "",
            *notes,
            "",
        ]
        tokens = root / "tokens"
        tokens.write_text(f"alice {ALICE}\nbob {BOB}\n")
        port = free_port()
        server = _serve(port, "--auth-tokens-file", str(tokens))
        try:
            wait_serving(f"127.0.0.1:{port}", server, 180)
            flood = asyncio.run(_flood(f"127.0.0.1:{port}", prompts, "What is the capital of France?"))
        finally:
            _stop(server)
        out += [
            "Tenant A enqueues 200 W1 jobs (128 new tokens each); then one chat request's first token:",
            "",
            "| request | TTFT ms | engine iterations waited |",
            "| --- | ---: | ---: |",
            *flood,
            "",
        ]
        out += [*_behind_long_table(tokens, prompts), "", f"CPU: {cpu_features().summary()}"]
    return "\n".join(out)
