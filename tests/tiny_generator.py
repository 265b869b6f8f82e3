"""The tiny random-weight model the generator tests share, loaded once per process (hypothesis's
state machine included), and their check that every page went back to the pool."""

from __future__ import annotations

from pathlib import Path

from engine.generator import DynamicGenerator, GeneratorConfig
from engine.model.loader import LoadedModel, load_model
from engine.scheduler import SchedulerConfig
from tests.tiny_llama import save_tiny_llama

_TINY: LoadedModel | None = None


def tiny_model(folder: Path) -> LoadedModel:
    """The shared tiny model, written to `folder` and loaded on the first call."""
    global _TINY  # noqa: PLW0603 - one tiny model for the whole process
    if _TINY is None:
        save_tiny_llama(folder, with_tokenizer=True, max_position_embeddings=1024)
        _TINY = load_model(folder, progress=False)
    return _TINY


def loaded_tiny_model() -> LoadedModel:
    """The shared tiny model, once a test's fixture has loaded it."""
    assert _TINY is not None, "load it first (the `tiny` fixture)"
    return _TINY


def scheduled_gen(tiny: LoadedModel, scheduler: SchedulerConfig, num_pages: int = 320) -> DynamicGenerator:
    """A generator of the tiny model with 16-token pages and these scheduler settings."""
    return DynamicGenerator(tiny.model, tiny.tokenizer, GeneratorConfig(16, num_pages, scheduler=scheduler))


def all_pages_idle(gen: DynamicGenerator) -> bool:
    s = gen.stats()
    return s.pages_used == 0 and s.pages_free + s.pages_cached == gen.pool.num_pages


def long_prompt(seed: int, n: int) -> tuple[int, ...]:
    """`n` prompt ids for the tiny model, a different sequence per seed (no prefix shared)."""
    return tuple(3 + (seed * 7 + i * 13) % 200 for i in range(n))


def finish(gen: DynamicGenerator) -> None:
    """Run what is left, check every page went back, and close the generator."""
    while gen.has_work():
        gen.iterate()
    assert all_pages_idle(gen)
    gen.close()
