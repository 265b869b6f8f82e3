"""Host cost per step: how much of a `DynamicGenerator.iterate()` is not the model's forward.

The shipped model in float32 runs four steps: a batch-1 decode, a batch-64 decode (greedy, and
sampled with seeds: every row draws), and a mixed step (63 decodes beside one 512-token prefill
chunk). `model.forward` is timed
around the call (torch CPU ops are synchronous, so its wall time is the model's); host
time is the rest of `iterate()`: scheduling, building the forward batch, sampling
bookkeeping, text streaming and events. Medians over the timed iterations; the machine is
shared, so `--repeat` runs several rounds and keeps each row's best round.

`--profile` adds cProfile's top host functions of the batch-64 decode (forward excluded).
"""

from __future__ import annotations

import contextlib
import cProfile
import dataclasses
import io
import pstats
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.workloads import load_workloads
from engine.cache.kv_cache import PagedKVCache
from engine.forward_batch import ForwardBatch
from engine.generator import DynamicGenerator, GeneratorConfig
from engine.jobs import JobSpec, SamplingSettings
from engine.model.llama import LlamaModel
from engine.model.loader import LoadedModel, WeightDtype, load_model
from engine.model.shipped_model import default_model_path
from engine.model.tokenizer import ChatMessage
from engine.scheduler import SchedulerConfig
from kernels.cpu_features import cpu_features

PAGE_SIZE = 64
MIXED_PROMPT = 512


@dataclass(frozen=True)
class StepCost:
    name: str
    total_ms: float
    forward_ms: float
    host_ms: float
    iterations: int

    @property
    def host_share(self) -> float:
        return self.host_ms / self.total_ms if self.total_ms > 0 else 0.0


class TimedForward:
    """Stands in for `model.forward` and adds up the seconds spent inside it."""

    def __init__(
        self,
        forward: Callable[[ForwardBatch, PagedKVCache], torch.Tensor],
        profile: cProfile.Profile | None = None,
    ) -> None:
        self._forward = forward
        self._profile = profile
        self.profiling = False
        self.seconds = 0.0

    def __call__(self, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        # The profile is of host work: it pauses while the model runs.
        if self.profiling and self._profile is not None:
            self._profile.disable()
        t0 = time.perf_counter()
        try:
            return self._forward(batch, cache)
        finally:
            self.seconds += time.perf_counter() - t0
            if self.profiling and self._profile is not None:
                self._profile.enable()


@contextlib.contextmanager
def timed_forward(model: LlamaModel, profile: cProfile.Profile | None = None) -> Iterator[TimedForward]:
    """`model.forward` timed (TimedForward) inside the block, itself again after it."""
    timer = TimedForward(model.forward, profile)
    model.forward = timer  # type: ignore[method-assign]
    try:
        yield timer
    finally:
        del model.forward


def _generator(loaded: LoadedModel, jobs: int) -> DynamicGenerator:
    return DynamicGenerator(
        loaded.model,
        loaded.tokenizer,
        GeneratorConfig(
            page_size=PAGE_SIZE,
            num_pages=jobs * 8 + 16,
            scheduler=SchedulerConfig(max_batch_size=64, max_chunk_size=2048),
        ),
    )


def _timed_steps(gen: DynamicGenerator, timer: TimedForward, steps: int) -> list[tuple[float, float]]:
    """(total, forward) seconds of each of `steps` iterations."""
    out = []
    for _ in range(steps):
        before = timer.seconds
        t0 = time.perf_counter()
        gen.iterate()
        total = time.perf_counter() - t0
        out.append((total, timer.seconds - before))
    return out


def _summarise(name: str, samples: list[tuple[float, float]]) -> StepCost:
    total = statistics.median(t for t, _ in samples)
    forward = statistics.median(f for _, f in samples)
    host = statistics.median(t - f for t, f in samples)
    return StepCost(name, total * 1e3, forward * 1e3, host * 1e3, len(samples))


# The sampled rows' settings: every row draws (the positioned uniforms, the inverse CDF).
SAMPLED = SamplingSettings(temperature=0.8, top_p=0.95)


def _decode_steps(
    loaded: LoadedModel,
    prompts: list[list[int]],
    steps: int,
    profile: cProfile.Profile | None,
    sampled: bool = False,
) -> list[tuple[float, float]]:
    with (
        contextlib.closing(_generator(loaded, len(prompts))) as gen,
        timed_forward(gen.model, profile) as timer,
    ):
        for i, p in enumerate(prompts):
            sampling = dataclasses.replace(SAMPLED, seed=i) if sampled else SamplingSettings()
            gen.enqueue(JobSpec(tuple(p), max_new_tokens=steps + 40, ignore_eos=True, sampling=sampling))
        # Prefill everything and take a few decode steps (one-time setup, warm caches).
        while not all(j.decoding for j in gen.jobs.values()) or gen.scheduler.queue:
            gen.iterate()
        _timed_steps(gen, timer, 3)
        if profile is not None:
            timer.profiling = True
            profile.enable()
        try:
            return _timed_steps(gen, timer, steps)
        finally:
            if profile is not None:
                profile.disable()
                timer.profiling = False


def _mixed_steps(loaded: LoadedModel, prompts: list[list[int]], steps: int) -> list[tuple[float, float]]:
    """63 decoding jobs; each timed step also prefills a new job's first 512 prompt tokens."""
    with contextlib.closing(_generator(loaded, 64 + steps)) as gen, timed_forward(gen.model) as timer:
        for p in prompts[:63]:
            gen.enqueue(JobSpec(tuple(p), max_new_tokens=steps + 40, ignore_eos=True))
        while not all(j.decoding for j in gen.jobs.values()) or gen.scheduler.queue:
            gen.iterate()
        out = []
        vocab = loaded.model.config.vocab_size
        for i in range(steps):
            # A distinct prompt each time: no prefix hit shortens the chunk.
            g = torch.Generator().manual_seed(i)
            prompt = tuple(int(t) for t in torch.randint(0, vocab, (MIXED_PROMPT + 1,), generator=g))
            job = gen.enqueue(JobSpec(prompt, max_new_tokens=4, ignore_eos=True))
            out.extend(_timed_steps(gen, timer, 1))
            gen.cancel(job)
            gen.iterate()  # the cancel's event, and one more decode step (untimed)
        return out


def _prompts(loaded: LoadedModel, workloads: Path | None, count: int) -> list[list[int]]:
    users = load_workloads(workloads)["W1"]["user_messages"]
    return [loaded.tokenizer.encode_chat([ChatMessage("user", users[i % len(users)])]) for i in range(count)]


def measure(
    loaded: LoadedModel, workloads: Path | None, steps: int, repeat: int, profile: bool
) -> tuple[list[StepCost], str]:
    prompts = _prompts(loaded, workloads, 64)
    best: dict[str, StepCost] = {}
    profiler = cProfile.Profile() if profile else None
    for r in range(max(1, repeat)):
        rounds = [
            _summarise("decode, batch 1", _decode_steps(loaded, prompts[:1], steps * 2, None)),
            _summarise(
                "decode, batch 64", _decode_steps(loaded, prompts, steps, profiler if r == 0 else None)
            ),
            _summarise(
                "decode, batch 64, sampled (T 0.8, top_p 0.95, seeded)",
                _decode_steps(loaded, prompts, steps, None, sampled=True),
            ),
            _summarise("63 decodes + 512-token prefill", _mixed_steps(loaded, prompts, max(3, steps // 4))),
        ]
        for cost in rounds:
            if cost.name not in best or cost.total_ms < best[cost.name].total_ms:
                best[cost.name] = cost
    report = ""
    if profiler is not None:
        buf = io.StringIO()
        stats = pstats.Stats(profiler, stream=buf)
        stats.sort_stats("tottime").print_stats(30)
        report = buf.getvalue()
    return list(best.values()), report


def render(costs: list[StepCost]) -> str:
    lines = [
        "### Host cost per iterate() (shipped model, float32)",
        "",
        f"CPU: {cpu_features().summary()}",
        "",
        "| step | iterations | total ms | forward ms | host ms | host % |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in costs:
        lines.append(
            f"| {c.name} | {c.iterations} | {c.total_ms:.2f} | {c.forward_ms:.2f} | {c.host_ms:.2f} "
            f"| {100 * c.host_share:.1f}% |"
        )
    lines.append("")
    lines.append(
        "Medians per iteration; best of the rounds (shared machine). Target: host < 10% at batch 64."
    )
    return "\n".join(lines)


def run(workloads: Path | None = None, steps: int = 20, repeat: int = 1, profile: bool = False) -> str:
    loaded = load_model(default_model_path(), WeightDtype.FLOAT32, progress=False)
    costs, report = measure(loaded, workloads, steps, repeat, profile)
    text = render(costs)
    if report:
        text += "\n\ncProfile of the batch-64 decode steps, host work only (paused inside model.forward):\n"
        text += report
    return text
