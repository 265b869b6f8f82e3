"""`--kv-cache auto` between a float16 and a bfloat16 cache, by timing both once per machine.

Both store 2 bytes a value. Where the CPU multiplies bfloat16 pairs (AVX512_BF16), the native
attention scores and sums a bfloat16 cache with half the instructions of a float16 one (no
conversion of K, two products a lane), at 8 mantissa bits against 11 (`python -m benchmarks
quality` under `--quant auto`: KL divergence 0.0041 -> 0.0044 on a Zen 5, 0.0034 -> 0.0035 on a Zen 4). Whether that pays depends on the
core, not the flag: on a 2-core Zen 5 a whole step did not move, while on a 2-core Zen 4, whose
512-bit float32 products issue at half rate, a 17-row verification at 800 keys took 12% less and a
33-row one 16% less. So the steps whose attention differs are timed on the model itself under
each cache, and bfloat16 is taken only where it saves at least `MARGIN` of them. The choice is
cached as JSON, keyed by the CPU, torch, the model and the native kernels' source, so a later
start times nothing.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.cache.kv_cache import KVCacheKind, PagedKVCache, choose_kv_cache
from engine.forward_batch import ForwardBatch, SequenceInput
from engine.ids import PageId
from engine.model.llama import LlamaModel
from kernels.attention.native_attention import NativePagedAttention
from kernels.cache_dir import keyed_file, read_keyed, write_json
from kernels.cpu_features import CpuFeatures, cpu_features
from kernels.native.native_library import source_digest

# bfloat16 rounds coarser, so it must save at least this share of the timed steps (their mean
# ratio): the timings move +-3% between rounds here, and a tie keeps float16's precision.
MARGIN = 0.05
CONTEXT = 800  # keys each timed step reads: an editing request's prompt and some output
# (rows, logits wanted): one decode row, a verification of 16 drafts, a prefill chunk beside decoding.
STEPS = ((1, 1), (17, 17), (128, 1))
ROUNDS = 3  # timed rounds, the kinds taking turns in each; the best of each (kind, step) counts
# How the timings are made and read: a change invalidates the choices made the old way.
METHOD = f"{CONTEXT} random keys; steps {STEPS}; best of {ROUNDS}; mean ratio; margin {MARGIN}"


@dataclass(frozen=True)
class CacheTuneKey:
    """What the timings depend on."""

    cpu: str
    torch_version: str
    model: str
    page_size: int
    native_source: str
    method: str = METHOD

    def path(self, folder: Path | None) -> Path:
        return keyed_file(folder, "kv-cache-tune", asdict(self))


def eligible(model: LlamaModel, cpu: CpuFeatures) -> bool:
    """Whether the choice is worth timing: the native attention runs the cache, and the CPU has the
    bfloat16 pair products (elsewhere bfloat16 widens to float32 and takes float16's arithmetic,
    so it cannot be faster, only coarser)."""
    return (
        model.device.type == "cpu" and isinstance(model.attention, NativePagedAttention) and cpu.avx512_bf16
    )


def pick(times: dict[KVCacheKind, list[float]]) -> KVCacheKind:
    """bfloat16 where its steps take at most 1 - MARGIN of float16's, on the mean of their ratios
    (each step counts alike, however long it runs)."""
    half, brain = times[KVCacheKind.FLOAT16], times[KVCacheKind.BFLOAT16]
    mean = sum(b / h for b, h in zip(brain, half, strict=True)) / len(half)
    return KVCacheKind.BFLOAT16 if mean <= 1 - MARGIN else KVCacheKind.FLOAT16


def time_steps(model: LlamaModel, page_size: int) -> dict[KVCacheKind, list[float]]:
    """The best seconds of each of `STEPS` at `CONTEXT` keys (fewer where the model's positions end
    sooner) under each 2-byte cache."""
    kinds = (KVCacheKind.FLOAT16, KVCacheKind.BFLOAT16)
    longest = max(rows for rows, _ in STEPS)
    context = max(1, min(CONTEXT, model.config.max_position_embeddings - longest))
    pages = -(-(context + longest) // page_size)
    table = [PageId(i) for i in range(pages)]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (longest,), generator=gen).tolist()
    caches: dict[KVCacheKind, PagedKVCache] = {k: model.new_cache(pages, page_size, k) for k in kinds}
    batches = [
        ForwardBatch.build(
            [SequenceInput(tokens[:rows], context, table, logit_positions=logits)], page_size, model.device
        )
        for rows, logits in STEPS
    ]
    best = {k: [float("inf")] * len(STEPS) for k in kinds}
    with torch.inference_mode():
        # The keys' values do not change the attention's work, so random ones stand in for a
        # prefill (written, not left as the OS's zero page, which every read would find in cache).
        for name in ("k", "v"):
            values = torch.randn(getattr(caches[kinds[0]], name).shape, generator=gen)
            for cache in caches.values():
                getattr(cache, name).copy_(values)
        for cache in caches.values():
            for batch in batches:  # first calls allocate their scratch
                model.forward(batch, cache)
        for _ in range(ROUNDS):
            for kind in kinds:
                for i, batch in enumerate(batches):
                    t0 = time.perf_counter()
                    model.forward(batch, caches[kind])
                    best[kind][i] = min(best[kind][i], time.perf_counter() - t0)
    return best


def resolve_kv_cache(
    model: LlamaModel, setting: str, page_size: int, folder: Path | None = None
) -> KVCacheKind:
    """`--kv-cache`'s value as the kind this model runs: `choose_kv_cache`'s rule, and where that
    gives float16 under auto on a CPU with bfloat16 pair products, the faster of float16 and
    bfloat16 on this machine (timed at the first start, ~1 s, then read back)."""
    kind = choose_kv_cache(setting, model.dtype, model.plan.quantized, tiles=model.tile_attention(page_size))
    cpu = cpu_features()
    if setting != "auto" or kind is not KVCacheKind.FLOAT16 or not eligible(model, cpu):
        return kind
    key = CacheTuneKey(
        cpu.identity,
        torch.__version__,
        model.timing_key,
        page_size,
        source_digest(),
    )
    path = key.path(folder)
    data = read_keyed(path, asdict(key))
    with contextlib.suppress(KeyError, ValueError, TypeError):  # else unreadable: time again
        if data is not None:
            return KVCacheKind(data["kind"])
    times = time_steps(model, page_size)
    kind = pick(times)
    write_json(
        path, {"key": asdict(key), "kind": kind.value, "seconds": {k.value: v for k, v in times.items()}}
    )
    return kind
