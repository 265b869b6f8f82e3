"""The warm-up's timing of prompt slices by depth (engine/prompt_depth_cost.py), kept per machine.

A slice of SLICE prompt tokens is timed right after a DEPTH-token prefix (a prefix-cache hit, so
only the slice is computed) and alone at depth 0, ROUNDS times each, taking turns, best of each.
Their difference is the slice's attention over DEPTH more keys: parity = a / b from
t_flat = SLICE * a + b * SLICE^2 / 2 and t_deep - t_flat = b * SLICE * DEPTH; a depth-0 token's
seconds are t_flat / SLICE (the forward's fixed cost shared out: a slice alone is no cheaper). The jobs run under a
cache salt of their own, so their pages are never another request's hits, nor a router's KV
events. About 0.5 s on a 2-core Zen 4 at a first start; later starts read the result back
(engine/timing_key.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

from engine import defaults
from engine.ids import JobId
from engine.jobs import JobSpec
from engine.prompt_depth_cost import PromptDepthCost
from engine.timing_key import TimingKey

SLICE = (
    defaults.PREFILL_WHILE_DECODING
)  # tokens of the timed slice: what the default lets beside decode steps
DEPTH = 512  # keys before the deep slice (rounded up to whole pages)
ROUNDS = 3
MIN_PARITY = 64.0  # a floor against a timing a busy machine spoiled (a deep slice's time inflated)
METHOD = f"a {SLICE}-token slice at depth 0 and after a {DEPTH}-token prefix hit; best of {ROUNDS}"
PREFIX = "prompt-depth"
SALT = "dyngen-warmup-prompt-depth"


def _depth(page_size: int) -> int:
    """DEPTH rounded up to whole pages: the prefix the deep slices hit entirely."""
    return -(-DEPTH // page_size) * page_size


def can_time(page_size: int, max_seq_len: int, pool_tokens: int, max_chunk_size: int) -> bool:
    """Whether a generator of these sizes has room for the timing: the prefix and a slice in one
    sequence (and a page to spare in the pool), and a whole slice in one forward."""
    needed = _depth(page_size) + SLICE + 1
    return max_chunk_size >= SLICE and max_seq_len >= needed and pool_tokens >= needed + page_size


def parity_from(flat: float, deep: float, depth: int) -> PromptDepthCost:
    """The price from a SLICE-token slice's seconds at depth 0 and at `depth`."""
    seconds = flat / SLICE
    if not deep > flat:  # depth looked free
        return PromptDepthCost(token_seconds=seconds)
    per_key = (deep - flat) / (SLICE * depth)  # b: a prompt token's seconds per key
    per_token = max(flat - per_key * SLICE * SLICE / 2, 0.0) / SLICE  # a
    return PromptDepthCost(max(per_token / per_key, MIN_PARITY), seconds)


def time_prompt_depth(
    enqueue: Callable[[JobSpec], JobId],
    iterate: Callable[[], object],
    has_work: Callable[[], bool],
    vocab_size: int,
    page_size: int,
) -> PromptDepthCost:
    """Time the slices through the generator (idle, prefix cache on, and `can_time`: the caller
    checks)."""
    depth = _depth(page_size)
    span = vocab_size - 1

    def ids(start: int, n: int, shift: int = 0) -> tuple[int, ...]:
        # Ids spread over the vocabulary (1 and up): prompts like any other, not one repeated token.
        return tuple(1 + ((i * 7919 + shift) % span) for i in range(start, start + n))

    def run(spec: JobSpec) -> float:
        enqueue(spec)
        t0 = time.perf_counter()
        iterate()  # the whole slice and its one token
        seconds = time.perf_counter() - t0
        while has_work():
            iterate()
        return seconds

    prefix = ids(0, depth)
    run(JobSpec(prompt_ids=prefix, max_new_tokens=1, cache_salt=SALT))  # cached for the deep slices
    flat, deep = math.inf, math.inf
    for r in range(ROUNDS):
        # Each slice new to the cache: a deep slice extends the prefix with other tokens each round,
        # and flat ones have salts of their own.
        flat = min(
            flat, run(JobSpec(prompt_ids=ids(depth, SLICE, r), max_new_tokens=1, cache_salt=f"{SALT}-{r}"))
        )
        deep = min(
            deep,
            run(JobSpec(prompt_ids=prefix + ids(depth, SLICE, r + 1), max_new_tokens=1, cache_salt=SALT)),
        )
    return parity_from(flat, deep, depth)


def read_prompt_depth(key: TimingKey, folder: Path | None) -> PromptDepthCost | None:
    """A kept price; None where there is none, or it lacks a part (timed again then)."""
    data = key.read(folder, PREFIX)
    if data is None:
        return None
    parity, seconds = data.get("parity"), data.get("token_seconds")
    if not isinstance(seconds, float) or not 0 < seconds < math.inf:
        return None
    if parity == "inf":
        return PromptDepthCost(token_seconds=seconds)
    if not isinstance(parity, float | int) or not parity > 0:
        return None
    return PromptDepthCost(float(parity), seconds)


def write_prompt_depth(key: TimingKey, folder: Path | None, cost: PromptDepthCost) -> None:
    parity = "inf" if math.isinf(cost.parity) else cost.parity
    key.write(folder, PREFIX, {"parity": parity, "token_seconds": cost.token_seconds})
