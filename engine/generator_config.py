"""The dynamic generator's configuration and the stats it reports (plain values)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine import defaults
from engine.adapters.lora_adapter import AdapterLimits
from engine.cache.kv_cache import KVCacheKind
from engine.errors import InvalidRequestError
from engine.grammar.constraints import MaskOverlap
from engine.sampling.sampler import DEFAULT_SAMPLER_MODE, SamplerMode
from engine.scheduler import SchedulerConfig
from engine.speculation.speculative import SpeculationConfig


@dataclass(frozen=True)
class GeneratorConfig:
    page_size: int = defaults.PAGE_SIZE
    num_pages: int = 128
    max_seq_len: int | None = None  # default: the model's context length
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    sampling_threads: int = defaults.SAMPLING_THREADS
    sampler_mode: SamplerMode = DEFAULT_SAMPLER_MODE
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    # INT8: K/V stored as int8 with a float16 scale per token and head (the draft model's cache stays float).
    kv_cache: KVCacheKind = KVCacheKind.FLOAT
    # Constrained jobs' masks: beside the forward with a core to spare, else just before it.
    mask_overlap: MaskOverlap = MaskOverlap.AUTO
    max_adapters: int = defaults.MAX_ADAPTERS  # LoRA adapters loaded at once
    adapter_limits: AdapterLimits = field(default_factory=AdapterLimits)  # rank and bytes of one adapter
    adapter_dir: Path | None = None  # where run-time loads may read; None: none may

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.num_pages < 1:
            raise InvalidRequestError(
                f"page_size and num_pages must be >= 1, got {self.page_size}, {self.num_pages}"
            )


@dataclass(frozen=True)
class GeneratorStats:
    queued: int
    running: int
    pages_free: int
    pages_cached: int
    pages_used: int
    forwarded_tokens: int  # tokens run through the model since start
    iterations: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    accepted_draft_tokens: int
    rejected_draft_tokens: int
    failed_jobs: int  # jobs finished with StopReason.ERROR since start
    preemptions: int  # running jobs sent back to the queue since start
