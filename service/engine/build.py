"""The one place a model and its generator are built from the service's settings, for the
engine process (`dyngen serve`) and for `dyngen generate` alike."""

from __future__ import annotations

from pathlib import Path

from engine.adapters.lora_adapter import AdapterLimits
from engine.device import resolve_device
from engine.generator import DynamicGenerator, GeneratorConfig
from engine.model.kv_cache_tune import resolve_kv_cache
from engine.model.loader import LoadedModel, WeightDtype, load_model
from engine.model.quantization import QuantMode
from engine.sampling.sampler import SamplerMode
from engine.scheduler import SchedulerConfig
from kernels.attention.backend import AttentionKind
from service.engine_config import EngineSettings
from service.speculation_flags import SpeculationOptions


def build_engine(
    settings: EngineSettings, speculation: SpeculationOptions, progress: bool
) -> tuple[LoadedModel, DynamicGenerator]:
    """Load the model (and a draft model where speculation asks for one) and build the generator."""
    device = resolve_device(settings.device)
    loaded = load_model(
        settings.model,
        WeightDtype(settings.dtype),
        progress=progress,
        attention=AttentionKind(settings.attention),
        quant=QuantMode(settings.quant),
        device=device,
    )
    kv_cache = resolve_kv_cache(loaded.model, settings.kv_cache, settings.page_size)
    speculation = speculation.resolved(loaded.model.row_invariant(kv_cache, settings.page_size))
    config = GeneratorConfig(
        page_size=settings.page_size,
        num_pages=settings.num_pages,
        sampling_threads=settings.sampling_threads,
        sampler_mode=SamplerMode(settings.sampler_mode),
        scheduler=SchedulerConfig(
            max_batch_size=settings.max_batch_size,
            max_chunk_size=settings.chunk_size,
            prefill_while_decoding=settings.prefill_while_decoding,
            prompt_reserve=settings.prompt_reserve,
            prefill_alone_ms=settings.prefill_alone_ms,
            max_q_size=settings.max_queue,
            max_q_per_tenant=settings.max_queue_per_tenant,
            priority_aging=settings.priority_aging,
            tenant_weights=settings.tenant_weights(),
        ),
        speculation=speculation.config,
        kv_cache=kv_cache,
        max_adapters=settings.max_adapters,
        adapter_limits=AdapterLimits(settings.max_adapter_rank, settings.max_adapter_bytes),
        adapter_dir=Path(settings.adapter_dir) if settings.adapter_dir else None,
    )
    draft = speculation.load_draft(settings.model, progress=progress, device=device)
    generator = DynamicGenerator(loaded.model, loaded.tokenizer, config, draft_model=draft)
    for name, path in settings.lora_pairs():
        generator.load_adapter(name, path)
    return loaded, generator
