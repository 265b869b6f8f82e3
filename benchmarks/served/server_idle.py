"""What an idle `dyngen serve` costs the machine, and what bounding OpenMP's spin costs a busy one.

    python -m benchmarks.served.server_idle [--spin-counts 0 1000000] [--idle-seconds 10]

For each `--omp-spin-count` (0 = unbounded active waiting, libgomp's own default under
OMP_WAIT_POLICY=ACTIVE): start the server, run one single-stream job and then W1 through gRPC,
then sit idle and read the server's CPU time (front end and engine process) from /proc. The
CPU is shown with the table: the spin that costs nothing on one CPU may on another.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.idle import wait_for_idle
from benchmarks.served.service_load import START_TIMEOUT, drive, wait_serving
from benchmarks.workloads import load_workloads
from dyngen_client import Chat, Request
from kernels.cpu_features import cpu_features
from service.cluster import free_port

_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Row:
    spin_count: int
    single_tok_s: float
    w1_tok_s: float
    idle_cpu: float  # CPU seconds per second of idleness, server and engine processes together


def _tree(pid: int) -> list[int]:
    """pid and its descendants."""
    out = [pid]
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        out.extend(_tree(int(child)))
    return out


def _cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / _TICKS


def measure(spin_count: int, idle_seconds: float) -> Row:
    port = free_port()
    target = f"127.0.0.1:{port}"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("GOMP_SPINCOUNT", None)
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "service.cli", "serve", "--port", str(port)),
            *("--omp-spin-count", str(spin_count), "--cache-tokens", "32768"),
        ],
        env=env,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_serving(target, process, START_TIMEOUT)
        w = load_workloads()["W1"]
        new = int(w["max_new_tokens"])
        one = [Request(Chat.user(w["user_messages"][0]), max_new_tokens=new, ignore_eos=True)]
        asyncio.run(drive(target, one, 1))  # warm
        wait_for_idle(max_busy=0.6, timeout=9.0)  # the server itself is one busy process of two cores
        single = asyncio.run(drive(target, one, 1))
        w1 = [Request(Chat.user(m), max_new_tokens=new, ignore_eos=True) for m in w["user_messages"]]
        batch = asyncio.run(drive(target, w1, len(w1)))
        time.sleep(1.0)  # past any spin after the last step
        pids = _tree(process.pid)
        c0 = _cpu_seconds(pids)
        time.sleep(idle_seconds)
        idle = (_cpu_seconds(pids) - c0) / idle_seconds
        return Row(spin_count, single.tokens / single.seconds, batch.tokens / batch.seconds, idle)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spin-counts", type=int, nargs="+", default=[0, 1_000_000])
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    args = parser.parse_args()
    rows = [measure(s, args.idle_seconds) for s in args.spin_counts]
    print(f"CPU: {cpu_features().summary()}")
    print()
    print("| --omp-spin-count | single stream tok/s | W1 tok/s (64 streams) | idle server CPU (cores) |")
    print("| --- | ---: | ---: | ---: |")
    for r in rows:
        name = "0 (unbounded)" if r.spin_count == 0 else f"{r.spin_count:,}"
        print(f"| {name} | {r.single_tok_s:.1f} | {r.w1_tok_s:.1f} | {r.idle_cpu:.2f} |")


if __name__ == "__main__":
    main()
