"""Throughput and prefix-cache hit rate of 1 and 2 replicas behind HAProxy (docs/SCALING.md).

    python -m benchmarks.served.scaleout [--new-tokens 32] [--concurrency 8]

The workload is W2-shaped: 4 different ~1k-token system prompts (W2's shared prefix, each with
its own opening line) x 16 questions, 64 requests, `--concurrency` streams at once, through
HAProxy (service/cluster.py). Runs: one replica; two with affinity (the clients' key); two
round robin (no key); two with affinity on an unbounded ring (hash-balance-factor 0; the
default is 150). This machine has 2 cores, so every replica runs 1 torch thread: two
replicas use the whole machine, one uses half of it.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass

from benchmarks.idle import wait_for_idle
from benchmarks.served.service_load import START_TIMEOUT, wait_serving
from benchmarks.workloads import load_workloads
from dyngen_client import AsyncClient, Chat, Request, Result, collect
from kernels.cpu_features import cpu_features
from service.cluster import Cluster
from service.haproxy_config import DEFAULT_BALANCE_FACTOR


@dataclass(frozen=True)
class Run:
    name: str
    seconds: float
    tokens: int
    hit_rate: float
    replicas: int

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def _requests(new_tokens: int) -> list[Request]:
    w2 = load_workloads()["W2"]
    shared = str(w2["system_message"])
    questions = [str(q) for q in w2["user_messages"]][:16]
    out = []
    for q in questions:
        for p in range(4):
            system = f"You answer for team {p} of 4.\n{shared}"
            out.append(
                Request(Chat((("system", system), ("user", q))), max_new_tokens=new_tokens, ignore_eos=True)
            )
    return out


async def _drive(
    target: str, requests: list[Request], concurrency: int, affinity: bool
) -> tuple[float, list[Result]]:
    gate = asyncio.Semaphore(concurrency)
    async with AsyncClient(target, affinity_chars=2048 if affinity else None) as client:

        async def one(r: Request) -> Result:
            async with gate:
                return collect([e async for e in client.generate(r, timeout=600)])

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(r) for r in requests))
        return time.perf_counter() - t0, list(results)


def measure(
    name: str,
    replicas: int,
    affinity: bool,
    new_tokens: int,
    concurrency: int,
    balance_factor: int = DEFAULT_BALANCE_FACTOR,
) -> Run:
    flags = ["--torch-threads", "1", "--quant", "auto", "--cache-tokens", "16384"]
    with Cluster(replicas, flags, balance_factor=balance_factor) as cluster:
        for i in range(replicas):
            wait_serving(cluster.replica_target(i), cluster.processes[i], START_TIMEOUT)
        wait_serving(cluster.target, None, 30)
        wait_for_idle(max_busy=0.2, timeout=9.0)
        seconds, results = asyncio.run(_drive(cluster.target, _requests(new_tokens), concurrency, affinity))
    cached = sum(r.finished.cached_tokens for r in results)
    prompt = sum(r.finished.prompt_tokens for r in results)
    used = len({r.finished.replica for r in results})
    return Run(name, seconds, sum(len(r.token_ids) for r in results), cached / prompt, used)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    runs = [
        measure("1 replica", 1, True, args.new_tokens, args.concurrency),
        measure("2 replicas, affinity (bounded load 150)", 2, True, args.new_tokens, args.concurrency),
        measure("2 replicas, affinity, unbounded", 2, True, args.new_tokens, args.concurrency, 0),
        measure("2 replicas, round robin", 2, False, args.new_tokens, args.concurrency),
    ]
    print(f"CPU: {cpu_features().summary()}")
    print("each replica: 1 torch thread, --quant auto, 16384 cache tokens; HAProxy on loopback")
    print()
    print("| run | wall s | tok/s | prefix hit rate | replicas used | tok/s vs 1 replica |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in runs:
        print(
            f"| {r.name} | {r.seconds:.1f} | {r.tok_s:.1f} | {r.hit_rate:.1%} | {r.replicas} "
            f"| {r.tok_s / runs[0].tok_s:.2f}x |"
        )


if __name__ == "__main__":
    main()
