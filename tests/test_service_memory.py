"""500 streams that never read: the server's memory stays within a stated bound, and once the
calls are cancelled every job is gone and every page free or cached.

The callers are grpc.aio calls that are started and never iterated, on channels whose HTTP/2
stream window is kept small (no BDP probing, 1 KiB lookahead), so the server cannot push a
job's events into the client's buffers: it has to hold them itself. Each job asks for 64..256
tokens with the 20 most likely alternatives per token (the largest events a caller can ask
for), ignoring EOS, against `dyngen serve` with a tiny random-weight model on 127.0.0.1.

Stated bound. The slow-reader policy (service/frontend/event_buffer.py) drops nothing, so what the
front end holds grows with what the jobs generated and nobody read: at most 500 x 256 tokens
here. We measured about 2.2 KiB of front-end RSS per such token (a 20-alternative TokenLogprob
is ~215 bytes on the wire; held as protobuf objects), about 90 MiB after 40 s and at most
~280 MiB if every job finished. The bound asserted is 384 MiB of front-end growth, and 256 MiB
for the engine, whose queue holds the 500 jobs (its KV cache is allocated up front).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import psutil  # type: ignore[import-untyped, unused-ignore]
import pytest

from benchmarks.served.soak import engine_process
from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from dyngen_client.proto.dyngen.v1 import generator_pb2_grpc as pb_grpc
from tests.service_harness import ServerProcess, is_idle, log_count, start_tiny_server
from tests.tiny_service_model import write_servable_tiny_gguf

pytestmark = [pytest.mark.timeout(300)]

STREAMS = 500
CHANNELS = 5
HOLD_SECONDS = 60.0  # at most; less once the engine has run every job
FRONT_END_BOUND = 384 << 20
ENGINE_BOUND = 256 << 20
NO_READ_OPTIONS = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "ember")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = write_servable_tiny_gguf(tmp_path_factory.mktemp("memory") / "tiny.gguf")
    s = start_tiny_server(model)
    yield s
    assert s.stop() == 0


@dataclass(frozen=True)
class Rss:
    front_end: int
    engine: int


def rss(server: ServerProcess) -> Rss:
    engine = engine_process(server.process.pid)
    assert engine is not None, "no engine process"
    return Rss(int(psutil.Process(server.process.pid).memory_info().rss), int(engine.memory_info().rss))


def request(rng: random.Random) -> pb.GenerateRequest:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60)))
    return pb.GenerateRequest(
        text=words,
        max_new_tokens=rng.randint(64, 256),
        ignore_eos=True,
        return_logprobs=True,
        top_logprobs=20,
    )


async def hold_unread_streams(server: ServerProcess) -> tuple[Rss, Rss, Counter[str], pb.ModelInfo]:
    """Open the streams, hold them unread while sampling RSS, cancel them: (baseline, peak,
    final status of the calls, the pool after cancelling)."""
    channels = [grpc.aio.insecure_channel(server.target, options=NO_READ_OPTIONS) for _ in range(CHANNELS)]
    stubs = [pb_grpc.GeneratorStub(c) for c in channels]
    try:
        # Warm up the request path once (read normally), then take the baseline.
        async for _ in stubs[0].Generate(request(random.Random(-1)), timeout=60):
            pass
        base = rss(server)
        peak = base
        rng = random.Random(0)
        calls = [stubs[i % CHANNELS].Generate(request(rng), timeout=600) for i in range(STREAMS)]
        deadline = time.monotonic() + HOLD_SECONDS
        while time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            now = rss(server)
            peak = Rss(max(peak.front_end, now.front_end), max(peak.engine, now.engine))
            info = await stubs[0].GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            if info.running_jobs == 0 and info.queued_jobs == 0:
                break  # every job ran to its end and its events wait in the server
        for call in calls:
            call.cancel()
        codes = Counter([(await call.code()).name for call in calls])
        deadline = time.monotonic() + 30
        while True:
            info = await stubs[0].GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            if is_idle(info) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        return base, peak, codes, info
    finally:
        for c in channels:
            await c.close()


def test_500_streams_that_never_read_stay_within_the_memory_bound(server: ServerProcess) -> None:
    base, peak, codes, info = asyncio.run(hold_unread_streams(server))
    front, engine = peak.front_end - base.front_end, peak.engine - base.engine
    print(
        f"\n{STREAMS} unread streams: front end {base.front_end >> 20} -> peak {peak.front_end >> 20} MiB "
        f"(+{front >> 20}), engine {base.engine >> 20} -> peak {peak.engine >> 20} MiB (+{engine >> 20}); "
        f"calls {dict(codes)}; pool {info.running_jobs} running, {info.queued_jobs} queued, "
        f"{info.pages_used} pages used"
    )
    assert front <= FRONT_END_BOUND, f"front end grew {front >> 20} MiB > {FRONT_END_BOUND >> 20} MiB"
    assert engine <= ENGINE_BOUND, f"engine grew {engine >> 20} MiB > {ENGINE_BOUND >> 20} MiB"
    # Ours to cancel; RESOURCE_EXHAUSTED only if the server's stream limit refused some.
    assert set(codes) <= {"CANCELLED", "RESOURCE_EXHAUSTED"}, codes
    assert is_idle(info), f"pool not idle after cancelling: {info}"
    assert log_count(server, "engine_starting") == 1 and log_count(server, "engine_down") == 0
