"""W1 (throughput) and W2 (shared prefix) from workloads.json: dyngen's generator vs transformers.

transformers runs static batches (left-padded, greedy) on the same GGUF weights in the
same dtype; for W1 the better of batch sizes 16 and 64 is its figure. Everything is
measured in this one process, one engine at a time.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.inprocess import roofline
from benchmarks.table import Row, render
from benchmarks.workloads import load_workloads
from engine import defaults
from engine.cache.kv_cache import KVCacheKind
from engine.generator import DynamicGenerator, GeneratorConfig
from engine.jobs import JobSpec, SamplingSettings
from engine.model.kv_cache_tune import resolve_kv_cache
from engine.model.loader import LoadedModel, WeightDtype, load_model
from engine.model.shipped_model import default_model_path
from engine.model.tokenizer import ChatMessage
from engine.prompt.guidance import Guidance
from engine.scheduler import SchedulerConfig
from engine.startup_objects import freeze_startup_objects


@dataclass(frozen=True)
class RunResult:
    seconds: float
    new_tokens: int
    ttft_mean: float
    ttft_p50: float
    texts: tuple[str, ...] = ()

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds


def served_kv_cache(loaded: LoadedModel) -> KVCacheKind:
    """The KV cache `dyngen serve` runs this model with by default."""
    return resolve_kv_cache(loaded.model, defaults.KV_CACHE, defaults.PAGE_SIZE)


class OneJob:
    """Generates n tokens for one prompt as a single job of the served generator (greedy, EOS
    ignored): what single-stream decode is timed on, the same loop a server runs."""

    def __init__(self, loaded: LoadedModel, prompt: Sequence[int], pages: int = 16) -> None:
        self.prompt = tuple(prompt)
        self.generator = DynamicGenerator(
            loaded.model,
            loaded.tokenizer,
            GeneratorConfig(num_pages=pages, kv_cache=served_kv_cache(loaded)),
        )

    def __call__(self, n: int) -> None:
        self.generator.generate([JobSpec(self.prompt, max_new_tokens=n, ignore_eos=True)])

    def close(self) -> None:
        self.generator.close()


def run_dyngen(
    loaded: LoadedModel,
    prompts: Sequence[tuple[int, ...]],
    new_tokens: int,
    ignore_eos: bool,
    adapters: Sequence[tuple[str, Path]] = (),
    guidance: Guidance | None = None,
    guided_every: int = 0,
    sampling: SamplingSettings | None = None,
    **config: Any,
) -> RunResult:
    """One generate() of every prompt; with `adapters` (name, PEFT folder), job i runs the
    (i mod len(adapters))-th; with `guidance`, every `guided_every`-th job is guided; with
    `sampling`, job i samples with it and seed i (greedy without)."""
    page_size = int(config.pop("page_size", GeneratorConfig().page_size))
    prefix_cache = bool(config.pop("prefix_cache", True))
    max_batch_size = int(config.pop("max_batch_size", 64))
    kv_cache = served_kv_cache(loaded)
    guided = [
        guidance is not None and guided_every > 0 and i % guided_every == 0 for i in range(len(prompts))
    ]
    need = sum(-(-(len(p) + new_tokens) // page_size) for p in prompts) + 8
    if guidance is not None:
        negative_pages = -(-(len(guidance.negative_prompt_ids) + new_tokens) // page_size)
        need += negative_pages * sum(guided)
    gen = DynamicGenerator(
        loaded.model,
        loaded.tokenizer,
        GeneratorConfig(
            page_size=page_size,
            num_pages=need,
            scheduler=SchedulerConfig(
                max_batch_size=max_batch_size, max_chunk_size=2048, prefix_cache=prefix_cache
            ),
            kv_cache=kv_cache,
        ),
    )
    gen.warmup()
    freeze_startup_objects()  # as the engine process does before it serves
    names = [gen.load_adapter(name, path).name for name, path in adapters]
    specs = [
        JobSpec(
            p,
            max_new_tokens=new_tokens,
            ignore_eos=ignore_eos,
            adapter=names[i % len(names)] if names else None,
            guidance=guidance if guided[i] else None,
            sampling=replace(sampling, seed=i) if sampling is not None else SamplingSettings(),
        )
        for i, p in enumerate(prompts)
    ]
    t0 = time.perf_counter()
    results = gen.generate(specs)
    seconds = time.perf_counter() - t0
    gen.close()
    ttfts = [r.finished.timings.queued + r.finished.timings.prefill for r in results]
    return RunResult(
        seconds,
        sum(len(r.token_ids) for r in results),
        statistics.mean(ttfts),
        statistics.median(ttfts),
        tuple(r.text for r in results),
    )


def run_transformers(
    path: Path,
    dtype: torch.dtype,
    prompts: Sequence[tuple[int, ...]],
    new_tokens: int,
    batch: int,
    ignore_eos: bool,
) -> RunResult:
    import transformers

    model: Any = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype
    )
    pad = 2
    total = 0
    first_tokens: list[float] = []
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch):
        group = prompts[start : start + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens if ignore_eos else 0,
                do_sample=False,
                pad_token_id=pad,
            )
        # Static batching: every job of a batch gets its first token after the batch's prefill;
        # approximate that by the batch's start plus its share of the batch's time.
        first_tokens.extend([time.perf_counter() - t0] * len(group))
        gen_part = out[:, width:]
        total += int((gen_part != pad).sum()) if not ignore_eos else gen_part.numel()
    seconds = time.perf_counter() - t0
    del model
    gc.collect()
    return RunResult(seconds, total, statistics.mean(first_tokens), statistics.median(first_tokens))


def w1(path: Path, dtypes: Sequence[WeightDtype], workloads: Path | None, repeats: int = 1) -> str:
    w = load_workloads(workloads)["W1"]
    rows: list[Row] = []
    for dtype in dtypes:
        loaded = load_model(path, dtype, progress=False)
        prompts = [tuple(loaded.tokenizer.encode_chat([ChatMessage("user", m)])) for m in w["user_messages"]]
        # Engines take turns, `repeats` rounds, and each keeps its best round: on a machine
        # shared with others, both then get the same chances of a quiet moment.
        ours: RunResult | None = None
        best: tuple[float, int] = (0.0, 0)
        for _ in range(repeats):
            run = run_dyngen(loaded, prompts, w["max_new_tokens"], w["ignore_eos"])
            ours = run if ours is None or run.seconds < ours.seconds else ours
            for batch in (16, 64):
                theirs = run_transformers(
                    path, dtype.torch, prompts, w["max_new_tokens"], batch, w["ignore_eos"]
                )
                best = max(best, (theirs.tokens_per_second, batch))
        assert ours is not None
        bound = roofline.measure(loaded.model.config, dtype.torch)
        del loaded
        gc.collect()
        rounds = f", best of {repeats}" if repeats > 1 else ""
        rows.append(
            Row(
                "dyngen",
                dtype.value,
                ours.tokens_per_second,
                "transformers",
                f"{ours.seconds:.1f} s wall{rounds}",
            )
        )
        rows.append(Row("transformers", dtype.value, best[0], "", f"static batch {best[1]}{rounds}"))
        rows.append(
            Row(
                "bound: decode matmuls at peak GEMM rate",
                dtype.value,
                bound.tokens_per_second,
                "transformers",
                f"{bound.gemm_gflops:.0f} GFLOP/s x {bound.gflop_per_token:.3f} GFLOP/token",
            )
        )
    return render("W1: 64 chat prompts x 128 new tokens (greedy, EOS ignored), all at once", "tok/s", rows)


def w2(path: Path, dtypes: Sequence[WeightDtype], workloads: Path | None, page_sizes: Sequence[int]) -> str:
    w = load_workloads(workloads)["W2"]
    lines = [
        "### W2: 32 requests sharing a ~1000-token system prompt, 32 new tokens each, all at once, cold cache",
        "",
        "| engine | dtype | page size | prefix cache | wall s | TTFT mean s | TTFT p50 s | speed-up |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for dtype in dtypes:
        loaded = load_model(path, dtype, progress=False)
        prompts = [
            tuple(
                loaded.tokenizer.encode_chat(
                    [ChatMessage("system", w["system_message"]), ChatMessage("user", q)]
                )
            )
            for q in w["user_messages"]
        ]
        off = run_dyngen(
            loaded, prompts, w["max_new_tokens"], w["ignore_eos"], prefix_cache=False, page_size=256
        )
        lines.append(
            f"| dyngen | {dtype.value} | 256 | off | {off.seconds:.2f} | {off.ttft_mean:.2f} | {off.ttft_p50:.2f} | 1.00x |"
        )
        for ps in page_sizes:
            on = run_dyngen(
                loaded, prompts, w["max_new_tokens"], w["ignore_eos"], prefix_cache=True, page_size=ps
            )
            same = "same text" if on.texts == off.texts else "TEXT DIFFERS"
            lines.append(
                f"| dyngen | {dtype.value} | {ps} | on | {on.seconds:.2f} | {on.ttft_mean:.2f} | {on.ttft_p50:.2f} "
                f"| {off.seconds / on.seconds:.2f}x ({same}) |"
            )
        del loaded
        gc.collect()
        theirs = run_transformers(path, dtype.torch, prompts, w["max_new_tokens"], 32, w["ignore_eos"])
        lines.append(
            f"| transformers (static batch 32) | {dtype.value} | - | - | {theirs.seconds:.2f} | "
            f"{theirs.ttft_mean:.2f} | {theirs.ttft_p50:.2f} | {off.seconds / theirs.seconds:.2f}x vs dyngen off |"
        )
    return "\n".join(lines)


def run(which: str, dtypes: Sequence[WeightDtype], workloads: Path | None, repeats: int = 1) -> str:
    path = default_model_path()
    parts = []
    if which in ("w1", "all"):
        parts.append(w1(path, dtypes, workloads, repeats))
    if which in ("w2", "all"):
        parts.append(w2(path, dtypes, workloads, page_sizes=(256, 64, 16)))
    header = f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    return header + "\n\n" + "\n\n".join(parts)
