"""EngineLoad: how loaded the engine is, as a router weighs replicas (GetLoads, KV event batches).

Counted in the front end from what it already sees, so reading it costs the engine nothing: its job
table (a job is waiting from submission until the engine reports it started, then running until it
finishes), the tokens its streams carry (generation throughput over the last few seconds) and the
engine's periodic stats (pages used and cached, prefix hits).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from service.frontend.engine_client import EngineClient
from service.frontend.job_channel import JobChannel
from service.ipc import EngineStats

THROUGHPUT_WINDOW = 5.0  # seconds of generated tokens the throughput is averaged over


@dataclass(frozen=True)
class LoadSample:
    running: int  # jobs the engine has started and not finished
    waiting: int  # jobs submitted and not yet started
    waiting_prompt_tokens: int  # their prompt tokens (what they will prefill, less prefix hits)
    used_tokens: int  # KV cache tokens held by running jobs
    total_tokens: int  # the whole KV cache in tokens
    cached_tokens: int  # tokens of cached prefix pages no job holds (evictable)
    gen_throughput: float  # generated tokens per second over THROUGHPUT_WINDOW
    cache_hit_rate: float  # prompt tokens found in the prefix cache / prompt tokens looked up
    max_running: int  # the engine's batch (jobs it runs at once)

    @property
    def token_usage(self) -> float:
        """KV cache in use, cached pages included (they hold findable prefixes), in [0, 1]."""
        return (self.used_tokens + self.cached_tokens) / self.total_tokens if self.total_tokens else 0.0

    @property
    def active_token_usage(self) -> float:
        """KV cache that running jobs hold (not evictable), in [0, 1]."""
        return self.used_tokens / self.total_tokens if self.total_tokens else 0.0


class EngineLoadTracker:
    def __init__(self, engine: EngineClient, max_running: int) -> None:
        self.engine = engine
        self.max_running = max_running
        self._started: set[str] = set()
        self._generated: deque[tuple[float, int]] = deque()  # (monotonic second, tokens)
        self._stats: EngineStats | None = None
        self.on_change: list[Callable[[], None]] = []  # a job started or finished
        engine.on_event.append(self._on_event)
        engine.on_forget.append(self._started.discard)
        engine.on_stats.append(self._on_stats)

    def _on_event(self, job: JobChannel, event: pb.GenerateEvent) -> None:
        if event.HasField("started"):
            self._started.add(job.job_id)
            self._changed()
        elif event.HasField("finished"):
            self._changed()
        elif event.HasField("delta") and event.delta.token_ids:
            now = time.monotonic()
            second = float(int(now))
            if self._generated and self._generated[-1][0] == second:
                self._generated[-1] = (second, self._generated[-1][1] + len(event.delta.token_ids))
            else:
                self._generated.append((second, len(event.delta.token_ids)))

    def _changed(self) -> None:
        for listener in self.on_change:
            listener()

    def _on_stats(self, stats: EngineStats) -> None:
        self._stats = stats

    def sample(self) -> LoadSample:
        running = waiting = waiting_tokens = 0
        for job in self.engine.jobs.values():
            if job.finished:
                continue
            if job.job_id in self._started:
                running += 1
            else:
                waiting += 1
                waiting_tokens += job.prompt_tokens
        bounds = self.engine.bounds
        page = bounds.page_size if bounds is not None else 0
        s = self._stats
        return LoadSample(
            running=running,
            waiting=waiting,
            waiting_prompt_tokens=waiting_tokens,
            used_tokens=s.pages_used * page if s is not None else 0,
            total_tokens=bounds.cache_tokens if bounds is not None else 0,
            cached_tokens=s.pages_cached * page if s is not None else 0,
            gen_throughput=self._throughput(),
            cache_hit_rate=s.prefix_hit_tokens / s.prefix_query_tokens
            if s is not None and s.prefix_query_tokens
            else 0.0,
            max_running=self.max_running,
        )

    def _throughput(self) -> float:
        now = time.monotonic()
        while self._generated and self._generated[0][0] < now - THROUGHPUT_WINDOW:
            self._generated.popleft()
        return sum(n for _, n in self._generated) / THROUGHPUT_WINDOW
