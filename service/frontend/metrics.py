"""Prometheus metrics: engine gauges from its periodic stats, latencies from event arrival times."""

from __future__ import annotations

import contextlib
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from service.frontend.job_channel import JobChannel
from service.frontend.job_resume import Recovery
from service.ipc import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.queued = Gauge("dyngen_queued_jobs", "jobs waiting for admission", registry=r)
        self.running = Gauge("dyngen_running_jobs", "jobs in the running batch", registry=r)
        self.pages = Gauge("dyngen_pages", "KV cache pages by state", ["state"], registry=r)
        self.prefix_hit_rate = Gauge(
            "dyngen_prefix_hit_rate", "prompt tokens found in the prefix cache", registry=r
        )
        self.tokens_per_second = Gauge("dyngen_tokens_per_second", "tokens forwarded per second", registry=r)
        self.engine_up = Gauge("dyngen_engine_up", "1 when the engine process is serving", registry=r)
        self.engine_restarts = Counter(
            "dyngen_engine_restarts", "engine processes restarted after a crash or hang", registry=r
        )
        self.resumed = Counter(
            "dyngen_jobs_resumed", "open jobs submitted again to a restarted engine", registry=r
        )
        self.poisoned = Counter(
            "dyngen_jobs_poisoned", "jobs ended after two engine crashes in a row as a suspect", registry=r
        )
        self.outage = Histogram(
            "dyngen_engine_outage_seconds",
            "an engine restart with open jobs: from the old engine's end to their resubmission",
            buckets=(0.5, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 20.0, 40.0),
            registry=r,
        )
        self.generated = Counter("dyngen_generated_tokens", "tokens streamed to callers", registry=r)
        self.preemptions = Counter(
            "dyngen_preemptions",
            "running jobs sent back to the queue (the page pool ran dry, or a job that outranks them came)",
            registry=r,
        )
        self._preemptions_seen = 0  # the engine's own count at its last stats (it restarts at 0)
        # A stop reason, or how a job's stream ended before it finished (deadline_exceeded,
        # caller_gone, stream_failed, not_streamed): every accepted job is counted once.
        self.jobs = Counter("dyngen_jobs_finished", "finished jobs by stop reason", ["reason"], registry=r)
        # The engine's adapter name (a tenant's adapters are scoped apart): a label is removed when
        # its adapter leaves the engine, so there are at most --max-adapters at once.
        self.adapter_jobs = Counter(
            "dyngen_adapter_jobs_finished",
            "finished jobs by the LoRA adapter they ran with",
            ["adapter"],
            registry=r,
        )
        self.ttft = Histogram(
            "dyngen_ttft_seconds", "submit to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "dyngen_inter_token_seconds", "time between a job's tokens", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.draft_accepted = Counter(
            "dyngen_draft_accepted_tokens", "speculative tokens accepted", registry=r
        )
        self.draft_rejected = Counter(
            "dyngen_draft_rejected_tokens", "speculative tokens rejected", registry=r
        )
        self._last: tuple[float, int] | None = None
        self._last_token: dict[str, float] = {}

    def serve(self, host: str, port: int) -> None:
        start_http_server(port, addr=host, registry=self.registry)

    def engine_state(self, up: bool) -> None:
        self.engine_up.set(1 if up else 0)

    def on_stats(self, s: EngineStats) -> None:
        self.queued.set(s.queued)
        self.running.set(s.running)
        self.pages.labels("free").set(s.pages_free)
        self.pages.labels("used").set(s.pages_used)
        self.pages.labels("cached").set(s.pages_cached)
        if s.prefix_query_tokens:
            self.prefix_hit_rate.set(s.prefix_hit_tokens / s.prefix_query_tokens)
        now = time.monotonic()
        if self._last is not None and now > self._last[0]:
            self.tokens_per_second.set(max(0, s.forwarded_tokens - self._last[1]) / (now - self._last[0]))
        self._last = (now, s.forwarded_tokens)
        self.preemptions.inc(max(0, s.preemptions - self._preemptions_seen))
        self._preemptions_seen = s.preemptions

    def engine_restarted(self) -> None:
        self.engine_restarts.inc()
        self._preemptions_seen = 0  # the new engine counts from 0

    def recovered(self, r: Recovery) -> None:
        self.resumed.inc(r.resumed)
        self.poisoned.inc(r.poisoned)
        self.outage.observe(r.outage_seconds)

    def adapter_gone(self, name: str) -> None:
        """An adapter was unloaded (or lost in a restart): its label goes, so labels stay bounded."""
        with contextlib.suppress(KeyError):  # no job of it finished
            self.adapter_jobs.remove(name)

    def dropped(self, why: str) -> None:
        self.jobs.labels(why).inc()

    def forget(self, job_id: str) -> None:
        self._last_token.pop(job_id, None)

    def on_event(self, job: JobChannel, event: pb.GenerateEvent) -> None:
        if event.HasField("delta"):
            now = time.perf_counter()
            self.generated.inc(len(event.delta.token_ids))
            last = self._last_token.get(job.job_id)
            if last is None:
                self.ttft.observe(now - job.submitted_at)
            else:
                self.itl.observe(now - last)
            self._last_token[job.job_id] = now
        elif event.HasField("finished"):
            f = event.finished
            self._last_token.pop(job.job_id, None)
            self.jobs.labels(pb.StopReason.Name(f.stop_reason).removeprefix("STOP_REASON_").lower()).inc()
            if f.adapter:
                self.adapter_jobs.labels(f.adapter).inc()
            self.draft_accepted.inc(f.accepted_draft_tokens)
            self.draft_rejected.inc(f.rejected_draft_tokens)
