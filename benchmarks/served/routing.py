"""Routing two replicas: the SMG gateway (cache_aware, round_robin) against HAProxy affinity.

    python -m benchmarks.served.routing [--requests 96] [--rate 1.5] [--new-tokens 16]

One pair of `dyngen serve` replicas (the shipped model, 1 torch thread each: two replicas are this
2-core machine), HAProxy in front with the clients' affinity key (service/cluster.py), and two SMG
gateways in front of the same replicas, one per policy (service/smg_gateway.py). Each run flushes
both replicas' prefix caches first (the worker contract's FlushCache) and sends the same
multi-tenant workload: `--tenants` (6), each its own ~1.1k-token system prompt (W2's shared prefix
after a tenant line) x W2's questions, in a random order, at Poisson arrival times of `--rate`
requests/s. Each replica's KV cache holds about 3.5 of those prompts (`--cache-tokens` 4096), so
where a tenant's requests land decides whether its prompt stays cached: a router that spreads
every tenant over both replicas makes each hold all six, and they evict each other.
The gateway runs speak the OpenAI API (streamed, the official client); HAProxy's speak dyngen.v1.

Reported per run: prefix hit rate (cached / prompt tokens, from each reply's usage), time to first
token p50/p99, output tokens/s over the run; and per front end the latency it adds to a request:
the median of 20 one-token requests through it less the same directly to a replica.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass

import grpc
import openai
from openai.types.chat import ChatCompletionMessageParam
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from benchmarks.idle import wait_for_idle
from benchmarks.served.service_load import START_TIMEOUT, wait_serving
from benchmarks.workloads import load_workloads
from dyngen_client import AsyncClient, Chat, Request, collect
from kernels.cpu_features import cpu_features
from service.cluster import Cluster, free_port
from service.smg_gateway import SmgGateway

MODEL = "smollm2"
PROBES = 20  # one-token requests per front end for its added latency


@dataclass(frozen=True)
class Reply:
    ttft: float  # seconds from the request's arrival time to its first token
    tokens: int
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Run:
    name: str
    replies: list[Reply]
    seconds: float

    @property
    def hit_rate(self) -> float:
        return sum(r.cached_tokens for r in self.replies) / max(1, sum(r.prompt_tokens for r in self.replies))

    def ttft(self, q: float) -> float:
        values = sorted(r.ttft for r in self.replies)
        return values[min(len(values) - 1, round(q * (len(values) - 1)))]

    @property
    def tok_s(self) -> float:
        return sum(r.tokens for r in self.replies) / self.seconds


Conversation = tuple[tuple[str, str], ...]


def _workload(requests: int, seed: int, tenants: int) -> list[Conversation]:
    w2 = load_workloads()["W2"]
    shared = str(w2["system_message"])
    questions = [str(q) for q in w2["user_messages"]]
    rng = random.Random(seed)
    return [
        (
            ("system", f"You answer for tenant {rng.randrange(tenants)} of {tenants}.\n{shared}"),
            ("user", rng.choice(questions)),
        )
        for _ in range(requests)
    ]


def _messages(conv: Conversation) -> list[ChatCompletionMessageParam]:
    (_, system), (_, user) = conv
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


async def _paced(
    convs: list[Conversation],
    rate: float,
    seed: int,
    one: Callable[[Conversation, float], Coroutine[object, object, Reply]],
) -> tuple[list[Reply], float]:
    """Each conversation sent at its Poisson arrival time; the replies and the run's length."""
    rng = random.Random(seed + 1)
    t0 = time.perf_counter()
    at = 0.0
    tasks: list[asyncio.Task[Reply]] = []
    for conv in convs:
        at += rng.expovariate(rate)
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(conv, time.perf_counter())))
    replies = await asyncio.gather(*tasks)
    return list(replies), time.perf_counter() - t0


async def _through_gateway(
    url: str, convs: list[Conversation], rate: float, seed: int, new_tokens: int
) -> Run:
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", timeout=600, max_retries=0)

    async def one(conv: Conversation, sent: float) -> Reply:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=_messages(conv),
            max_tokens=new_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        first: float | None = None
        prompt = cached = tokens = 0
        async for chunk in stream:
            if first is None and any(c.delta.content for c in chunk.choices):
                first = time.perf_counter()
            if chunk.usage is not None:
                prompt, tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
                details = chunk.usage.prompt_tokens_details
                cached = (details.cached_tokens or 0) if details is not None else 0
        return Reply((first or time.perf_counter()) - sent, tokens, prompt, cached)

    replies, seconds = await _paced(convs, rate, seed, one)
    await client.close()
    return Run("", replies, seconds)


async def _through_haproxy(
    target: str, convs: list[Conversation], rate: float, seed: int, new_tokens: int
) -> Run:
    async with AsyncClient(target, affinity_chars=2048) as client:

        async def one(conv: Conversation, sent: float) -> Reply:
            first: float | None = None
            events = []
            request = Request(Chat(conv), max_new_tokens=new_tokens, ignore_eos=True)
            async for event in client.generate(request, timeout=600):
                if first is None and event.HasField("delta"):
                    first = time.perf_counter()
                events.append(event)
            f = collect(events).finished
            return Reply(
                (first or time.perf_counter()) - sent, f.new_tokens, f.prompt_tokens, f.cached_tokens
            )

        replies, seconds = await _paced(convs, rate, seed, one)
    return Run("", replies, seconds)


async def _flush(targets: list[str]) -> None:
    for target in targets:
        async with grpc.aio.insecure_channel(target) as channel:
            flush = channel.unary_unary(
                "/vllm.grpc.engine.VllmEngine/FlushCache",
                request_serializer=cpb.FlushCacheRequest.SerializeToString,
                response_deserializer=cpb.FlushCacheResponse.FromString,
            )
            await flush(cpb.FlushCacheRequest(), timeout=30)


async def _probe_direct(target: str) -> float:
    """Median latency of one-token requests straight to a replica (the worker contract)."""
    async with grpc.aio.insecure_channel(target) as channel:
        generate = channel.unary_stream(
            "/vllm.grpc.engine.VllmEngine/Generate",
            request_serializer=vpb.GenerateRequest.SerializeToString,
            response_deserializer=vpb.GenerateResponse.FromString,
        )
        times = []
        for i in range(PROBES):
            req = vpb.GenerateRequest(
                request_id=f"probe-{i}",
                text="Hi",
                sampling_params=vpb.SamplingParams(temperature=0, max_tokens=1),
            )
            t0 = time.perf_counter()
            async for _ in generate(req, timeout=30):
                pass
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def _probe_gateway(url: str) -> float:
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", timeout=30, max_retries=0)
    times = []
    for _ in range(PROBES):
        t0 = time.perf_counter()
        await client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, temperature=0)
        times.append(time.perf_counter() - t0)
    await client.close()
    return statistics.median(times)


async def _probe_dyngen(target: str) -> float:
    async with AsyncClient(target) as client:
        times = []
        for _ in range(PROBES):
            t0 = time.perf_counter()
            async for _ in client.generate(Request("Hi", max_new_tokens=1), timeout=30):
                pass
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--rate", type=float, default=1.5, help="mean arrivals per second (Poisson)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tenants", type=int, default=6, help="distinct system prompts")
    parser.add_argument(
        "--cache-tokens",
        type=int,
        default=4096,
        help="each replica's KV cache (4096: about 3.5 system prompts)",
    )
    args = parser.parse_args()
    flags = ["--torch-threads", "1", "--quant", "auto", "--served-model-name", MODEL]
    flags += ["--cache-tokens", str(args.cache_tokens)]
    convs = _workload(args.requests, args.seed, args.tenants)
    with Cluster(2, flags) as cluster:
        replicas = [cluster.replica_target(i) for i in range(2)]
        for i, target in enumerate(replicas):
            wait_serving(target, cluster.processes[i], START_TIMEOUT)
        wait_serving(cluster.target, None, 30)
        gateways = {
            p: SmgGateway(replicas, free_port(), free_port(), p) for p in ("cache_aware", "round_robin")
        }
        for g in gateways.values():
            g.start()
        try:
            for g in gateways.values():
                g.wait_ready(timeout=60)
            added = {
                "direct (worker contract)": asyncio.run(_probe_direct(replicas[0])),
                "SMG": asyncio.run(_probe_gateway(gateways["cache_aware"].url)),
                "direct (dyngen.v1)": asyncio.run(_probe_dyngen(replicas[0])),
                "HAProxy": asyncio.run(_probe_dyngen(cluster.target)),
            }
            runs = []
            for name, policy in (
                ("SMG cache_aware", "cache_aware"),
                ("SMG round_robin", "round_robin"),
                ("HAProxy affinity", None),
            ):
                asyncio.run(_flush(replicas))
                wait_for_idle(max_busy=0.2, timeout=9.0)
                if policy is None:
                    run = asyncio.run(
                        _through_haproxy(cluster.target, convs, args.rate, args.seed, args.new_tokens)
                    )
                else:
                    url = gateways[policy].url
                    run = asyncio.run(_through_gateway(url, convs, args.rate, args.seed, args.new_tokens))
                runs.append(Run(name, run.replies, run.seconds))
        finally:
            for g in gateways.values():
                g.stop()
    print(f"CPU: {cpu_features().summary()}")
    print(
        f"2 replicas (1 torch thread each, --quant auto, {args.cache_tokens} cache tokens); {args.requests} "
        f"requests, {args.tenants} tenants' system prompts, Poisson {args.rate}/s, {args.new_tokens} new tokens each"
    )
    print()
    print("| front end | prefix hit rate | TTFT p50 ms | TTFT p99 ms | output tok/s | wall s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in runs:
        print(
            f"| {r.name} | {r.hit_rate:.1%} | {r.ttft(0.5) * 1000:.0f} | {r.ttft(0.99) * 1000:.0f} "
            f"| {r.tok_s:.1f} | {r.seconds:.1f} |"
        )
    print()
    print(f"Added latency per request (median of {PROBES} one-token requests, sequential):")
    print()
    print("| path | median ms | added ms |")
    print("| --- | ---: | ---: |")
    base_worker, base_dyngen = added["direct (worker contract)"], added["direct (dyngen.v1)"]
    for name, seconds in added.items():
        base = base_worker if name in ("direct (worker contract)", "SMG") else base_dyngen
        print(f"| {name} | {seconds * 1000:.1f} | {(seconds - base) * 1000:+.1f} |")


if __name__ == "__main__":
    main()
