"""How long `dyngen serve` takes to serve, first and warm, and how long a killed engine's streams pause.

    python -m benchmarks start [--repeat N] [--isa native|avx2|both] [--serve-args "..."]

Per instruction set (the CPU's own, and the AVX2-only parts' paths under `DYNGEN_CPU_ISA=avx2`
with torch's, oneDNN's and MKL's dispatch capped the same, kernels/isa.py): a first start in an
empty cache folder (`DYNGEN_CACHE_DIR`: native build, linear autotune, KV cache tune, model index,
tokenizer conversion), then `--repeat` warm starts from that folder. A start is timed from the
spawn of `dyngen serve` to health SERVING; the engine's own parts come from its `engine_ready` log
line. On the last warm server one greedy stream runs and its engine is SIGKILLed three times:
from the kill to the stream's next token (the pause a caller sees), and to SERVING again.

The operating system's file cache is left as it is: a first start here has torch's files cached,
as it would on a machine that ran anything with torch before.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from grpc_health.v1 import health_pb2

from benchmarks.peers.process import stop as stop_process
from benchmarks.served.service_load import START_TIMEOUT, wait_serving
from benchmarks.served.soak import cpu_line, engine_process
from dyngen_client import Chat, Client, Request
from kernels.isa import BEYOND, Isa, isa_environment
from service.cluster import free_port
from service.health_probe import health_status

KILLS = 3
STREAM_TOKENS = 4000  # longer than three restarts take at a single stream's rate
PART_NAMES = ("imports", "model", "warmup", "tokenizer")
SERVING = health_pb2.HealthCheckResponse.SERVING
CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class StartRun:
    isa: Isa
    first: bool  # an empty cache folder
    to_serving: float  # spawn of `dyngen serve` -> health SERVING
    engine_start: float  # the front end's `start_seconds`: engine spawn -> READY handled
    parts: dict[str, float]  # the engine's own: imports, model, warmup, tokenizer
    kv_cache: str


@dataclass(frozen=True)
class Restart:
    to_token: float  # SIGKILL -> the stream's next token
    to_serving: float  # SIGKILL -> health SERVING


def engine_ready(log: Path) -> dict[str, object]:
    """The last `engine_ready` record of a server's JSON log."""
    found: dict[str, object] | None = None
    for line in log.read_text(errors="replace").splitlines():
        if '"engine_ready"' not in line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("event") == "engine_ready":
            found = record
    if found is None:
        raise SystemExit(f"no engine_ready line in {log}")
    return found


def start_run(record: dict[str, object], isa: Isa, first: bool, to_serving: float) -> StartRun:
    parts = record.get("start_parts")
    engine = record.get("start_seconds")
    return StartRun(
        isa,
        first,
        to_serving,
        float(engine) if isinstance(engine, int | float) else float("nan"),
        {str(k): float(v) for k, v in parts.items()} if isinstance(parts, dict) else {},
        str(record.get("kv_cache", "")).split(":")[0],
    )


class _Server:
    """One `dyngen serve` on 127.0.0.1 and a free port, its log in a file."""

    def __init__(self, env: dict[str, str], flags: Sequence[str], log: Path) -> None:
        self.port = free_port()
        self.log = log
        command = [
            sys.executable,
            "-m",
            "service.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        self.started = time.monotonic()
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                [*command, *flags], env=env, stdout=subprocess.DEVNULL, stderr=out
            )

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_serving(self) -> float:
        wait_serving(self.target, self.process, START_TIMEOUT)
        return time.monotonic() - self.started

    def stop(self) -> None:
        stop_process(self.process, 60.0)


def restarts(server: _Server, kills: int) -> list[Restart]:
    """One greedy stream; its engine SIGKILLed `kills` times once tokens flow again."""
    arrivals: list[float] = []
    done = threading.Event()

    def read() -> None:
        with Client(server.target) as client:
            request = Request(Chat.user("Tell a long story."), max_new_tokens=STREAM_TOKENS, ignore_eos=True)
            for event in client.generate(request, timeout=600):
                if event.HasField("delta"):
                    arrivals.append(time.monotonic())
        done.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    out: list[Restart] = []
    for _ in range(kills):
        seen = len(arrivals)
        while len(arrivals) < seen + 20 and not done.is_set():  # tokens flowing on this engine
            time.sleep(0.01)
        engine = engine_process(server.process.pid)
        if done.is_set() or engine is None:
            break
        killed = time.monotonic()
        os.kill(engine.pid, signal.SIGKILL)
        # Health says SERVING until the front end has seen the engine go (its pipe's end); tokens
        # the engine sent before it died may still arrive until then.
        deadline = killed + 10.0
        while health_status(server.target) == SERVING and time.monotonic() < deadline:
            time.sleep(0.002)
        count = len(arrivals)
        server.wait_serving()
        serving = time.monotonic() - killed
        while len(arrivals) == count and not done.is_set():
            time.sleep(0.002)
        if len(arrivals) > count:
            out.append(Restart(arrivals[count] - killed, serving))
    return out


def measure(
    isa: Isa, repeat: int, flags: Sequence[str], folder: Path
) -> tuple[list[StartRun], list[Restart]]:
    cache = folder / f"cache-{isa.value}"
    cache.mkdir()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", DYNGEN_CACHE_DIR=str(cache))
    env.update(isa_environment(isa))
    runs: list[StartRun] = []
    kills: list[Restart] = []
    for i in range(1 + repeat):
        server = _Server(env, flags, folder / f"{isa.value}-{i}.log")
        try:
            to_serving = server.wait_serving()
            runs.append(start_run(engine_ready(server.log), isa, i == 0, to_serving))
            if i == repeat:
                kills = restarts(server, KILLS)
        finally:
            server.stop()
    return runs, kills


def _f(x: float) -> str:
    return f"{x:.2f}"


def render(runs: Sequence[StartRun], kills: dict[Isa, list[Restart]]) -> str:
    lines = [
        "### dyngen serve: start to SERVING, seconds",
        "",
        cpu_line(),
        "",
        "| instruction set | start | to SERVING | engine | " + " | ".join(PART_NAMES) + " | kv cache |",
        "| --- | --- | ---: | ---: | " + " | ".join("---:" for _ in PART_NAMES) + " | --- |",
    ]
    for r in runs:
        parts = " | ".join(_f(r.parts[p]) if p in r.parts else "n/a" for p in PART_NAMES)
        lines.append(
            f"| {r.isa.value} | {'first' if r.first else 'warm'} | {_f(r.to_serving)} | {_f(r.engine_start)} "
            f"| {parts} | {r.kv_cache} |"
        )
    lines += ["", "warm start, median to SERVING:"]
    for isa in dict.fromkeys(r.isa for r in runs):
        warm = [r.to_serving for r in runs if r.isa is isa and not r.first]
        if warm:
            lines.append(
                f"- {isa.value}: {_f(statistics.median(warm))} s (max {_f(max(warm))}, {len(warm)} starts)"
            )
    lines += ["", f"### An engine SIGKILLed under one stream ({KILLS} kills): seconds from the kill", ""]
    lines += ["| instruction set | to the next token | to SERVING |", "| --- | --- | --- |"]
    for isa, restarted in kills.items():
        token = ", ".join(_f(k.to_token) for k in restarted) or "n/a"
        serving = ", ".join(_f(k.to_serving) for k in restarted) or "n/a"
        lines.append(f"| {isa.value} | {token} | {serving} |")
    return "\n".join(lines)


def isas_for(choice: str) -> list[Isa]:
    """`both`: the CPU's own set and, where it has more than AVX2, the AVX2-only parts' paths too."""
    if choice != "both":
        return [Isa(choice)]
    lines = CPUINFO.read_text().splitlines()
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    beyond = any(f.startswith(BEYOND[Isa.AVX2]) for f in flags)
    return [Isa.NATIVE, Isa.AVX2] if beyond else [Isa.NATIVE]


def run(repeat: int, isa: str, flags: Sequence[str]) -> str:
    runs: list[StartRun] = []
    kills: dict[Isa, list[Restart]] = {}
    with tempfile.TemporaryDirectory(prefix="dyngen-start-") as tmp:
        for i in isas_for(isa):
            measured, kills[i] = measure(i, repeat, flags, Path(tmp))
            runs += measured
    return render(runs, kills)
