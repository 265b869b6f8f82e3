"""The one place a model and its generator are built from the service's settings, for the
engine process (`dyngen serve`) and for `dyngen generate` alike."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine import defaults
from engine.generator import DynamicGenerator, GeneratorConfig
from engine.kv_cache import choose_kv_cache
from engine.model.loader import LoadedModel, WeightDtype, load_model
from engine.model.quantization import QuantMode
from engine.scheduler import SchedulerConfig
from service.speculation_flags import SpeculationOptions


@dataclass(frozen=True)
class EngineSettings:
    """What `serve` and `generate` both choose (their flags' values, as strings where they are)."""

    model: Path | None  # None: the shipped model
    dtype: str = "auto"
    quant: str = "auto"
    page_size: int = defaults.PAGE_SIZE
    cache_tokens: int = defaults.CACHE_TOKENS
    kv_cache: str = defaults.KV_CACHE
    max_batch_size: int = defaults.MAX_BATCH_SIZE
    chunk_size: int = defaults.MAX_CHUNK_SIZE
    max_queue: int = defaults.MAX_QUEUE
    sampling_threads: int = defaults.SAMPLING_THREADS

    @property
    def num_pages(self) -> int:
        return max(1, self.cache_tokens // self.page_size)


def build_engine(
    settings: EngineSettings, speculation: SpeculationOptions, progress: bool
) -> tuple[LoadedModel, DynamicGenerator]:
    """Load the model (and a draft model where speculation asks for one) and build the generator."""
    loaded = load_model(
        settings.model, WeightDtype(settings.dtype), progress=progress, quant=QuantMode(settings.quant)
    )
    config = GeneratorConfig(
        page_size=settings.page_size,
        num_pages=settings.num_pages,
        sampling_threads=settings.sampling_threads,
        scheduler=SchedulerConfig(
            max_batch_size=settings.max_batch_size,
            max_chunk_size=settings.chunk_size,
            max_q_size=settings.max_queue,
        ),
        speculation=speculation.config,
        kv_cache=choose_kv_cache(settings.kv_cache, loaded.model.dtype, loaded.model.plan.quantized),
    )
    draft = speculation.load_draft(settings.model, progress=progress)
    return loaded, DynamicGenerator(loaded.model, loaded.tokenizer, config, draft_model=draft)
