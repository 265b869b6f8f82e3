"""A plain generation loop over the paged forward: many prompts, one batch per step.

Each step runs every decoding sequence's next token and as many prefill chunk
tokens as the budget leaves, in one forward. Pages are handed out up front per
wave of prompts that fit the cache. Serving, the CLI and the benchmarks run the one
generation loop, the dynamic generator (scheduler, page allocator, sampler); this one
lives with the tests as the simplest correct driver of the forward, the reference the
parity and kernel tests hold the model to.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine import defaults
from engine.cache.kv_cache import PagedKVCache
from engine.errors import InvalidRequestError, PromptTooLongError
from engine.forward_batch import SequenceInput
from engine.ids import PageId
from engine.jobs import StopReason
from engine.model.llama import LlamaModel
from engine.runner import ModelRunner


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    max_chunk_tokens: int = defaults.MAX_CHUNK_SIZE  # tokens per forward, prefill chunks and decode together

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.max_chunk_tokens < 1:
            raise InvalidRequestError(f"max_chunk_tokens must be at least 1, got {self.max_chunk_tokens}")


@dataclass(frozen=True)
class Completion:
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]  # generated ids, the stop token excluded
    stop_reason: StopReason
    stop_token: int | None
    step_logits: tuple[torch.Tensor, ...] = ()  # float32 [vocab] per generated token, when asked
    prefill_seconds: float = 0.0  # start of the wave -> first token sampled
    decode_seconds: float = 0.0  # first token -> last token

    @property
    def decode_tokens_per_second(self) -> float:
        # Tokens after the first, over the time they took: the steady-state decode rate.
        steps = len(self.token_ids) + (self.stop_token is not None) - 1
        return steps / self.decode_seconds if self.decode_seconds > 0 and steps > 0 else 0.0


@dataclass
class _Running:
    index: int
    prompt: list[int]
    pages: list[PageId]
    generator: torch.Generator | None
    computed: int = 0  # tokens whose K/V are in the cache
    generated: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    result: Completion | None = None
    first_token_at: float | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated


def _check_fits(
    prompt_len: int, settings: GenerationSettings, model: LlamaModel, cache: PagedKVCache
) -> None:
    need = prompt_len + settings.max_new_tokens
    context = model.config.max_position_embeddings
    if need > context:
        raise PromptTooLongError(
            f"prompt of {prompt_len} tokens + max_new_tokens {settings.max_new_tokens} = {need} tokens "
            f"exceeds the model's context of {context} tokens"
        )
    capacity = cache.num_pages * cache.page_size
    if need > capacity:
        raise PromptTooLongError(
            f"prompt of {prompt_len} tokens + max_new_tokens {settings.max_new_tokens} = {need} tokens "
            f"exceeds the KV cache of {capacity} tokens ({cache.num_pages} pages of {cache.page_size})"
        )


def generate_batch(
    model: LlamaModel,
    cache: PagedKVCache,
    prompts: Sequence[Sequence[int]],
    settings: GenerationSettings,
    page_tables: Sequence[Sequence[PageId]] | None = None,
    keep_logits: bool = False,
) -> list[Completion]:
    """Generate for every prompt; results in the prompts' order."""
    for p in prompts:
        if not p:
            raise InvalidRequestError("a prompt must hold at least one token")
        if max(p) >= model.config.vocab_size or min(p) < 0:
            raise InvalidRequestError(f"prompt token ids must be in [0, {model.config.vocab_size})")
        _check_fits(len(p), settings, model, cache)
    pages_per = [math.ceil((len(p) + settings.max_new_tokens) / cache.page_size) for p in prompts]
    if page_tables is not None:
        if len(page_tables) != len(prompts):
            raise InvalidRequestError("page_tables must have one table per prompt")
        for i, table in enumerate(page_tables):
            if len(table) < pages_per[i]:
                raise InvalidRequestError(f"page table {i} has {len(table)} pages, needs {pages_per[i]}")
        return _run_wave(
            model, cache, list(range(len(prompts))), prompts, list(page_tables), settings, keep_logits
        )

    results: list[Completion | None] = [None] * len(prompts)
    start = 0
    while start < len(prompts):
        wave: list[int] = []
        tables: list[Sequence[PageId]] = []
        used = 0
        while start < len(prompts) and used + pages_per[start] <= cache.num_pages:
            tables.append([PageId(p) for p in range(used, used + pages_per[start])])
            used += pages_per[start]
            wave.append(start)
            start += 1
        for i, r in zip(
            wave, _run_wave(model, cache, wave, prompts, tables, settings, keep_logits), strict=True
        ):
            results[i] = r
    return [r for r in results if r is not None]


def _run_wave(
    model: LlamaModel,
    cache: PagedKVCache,
    indices: Sequence[int],
    prompts: Sequence[Sequence[int]],
    tables: Sequence[Sequence[PageId]],
    settings: GenerationSettings,
    keep_logits: bool,
) -> list[Completion]:
    stops = set(settings.stop_token_ids)
    if not settings.ignore_eos:
        stops |= set(model.config.eos_token_ids)
    running = []
    for n, (i, table) in enumerate(zip(indices, tables, strict=True)):
        gen = None
        if settings.temperature > 0:
            gen = torch.Generator().manual_seed((settings.seed or 0) + n)
        running.append(_Running(i, list(prompts[i]), list(table), gen))
    active = list(running)
    runner = ModelRunner(model, cache)
    started = time.perf_counter()
    while active:
        budget = settings.max_chunk_tokens
        step: list[tuple[_Running, SequenceInput]] = []
        # Decode tokens first (they are cheap and keep latency flat), then prefill chunks.
        for r in active:
            if r.computed >= len(r.prompt):
                tokens = r.tokens
                step.append((r, SequenceInput(tokens[r.computed :], r.computed, r.pages)))
                budget -= 1
        for r in active:
            if r.computed < len(r.prompt) and budget > 0:
                take = min(budget, len(r.prompt) - r.computed)
                chunk = r.prompt[r.computed : r.computed + take]
                last = r.computed + take == len(r.prompt)
                step.append((r, SequenceInput(chunk, r.computed, r.pages, want_logits=last)))
                budget -= take
        result = runner.run([s for _, s in step])
        for i, (r, s) in enumerate(step):
            r.computed = s.end_pos
            if not s.want_logits:
                continue
            token_logits = result.logits[result.first_rows[i]]
            if keep_logits:
                r.logits.append(token_logits.clone())
            token = _sample(token_logits, settings.temperature, r.generator)
            now = time.perf_counter()
            if r.first_token_at is None:
                r.first_token_at = now
            if token in stops:
                reason = StopReason.EOS if token in model.config.eos_token_ids else StopReason.STOP_TOKEN
                r.result = _finish(r, reason, token, started, now)
            else:
                r.generated.append(token)
                if len(r.generated) >= settings.max_new_tokens:
                    r.result = _finish(r, StopReason.MAX_NEW_TOKENS, None, started, now)
        active = [r for r in active if r.result is None]
    return [r.result for r in running if r.result is not None]


def _finish(r: _Running, reason: StopReason, token: int | None, started: float, now: float) -> Completion:
    first = r.first_token_at if r.first_token_at is not None else now
    return Completion(
        tuple(r.prompt), tuple(r.generated), reason, token, tuple(r.logits), first - started, now - first
    )


def _sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    if temperature <= 0 or generator is None:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
