"""What the engine process is started with: the one part of `dyngen serve`'s configuration that
crosses the pipe (as JSON). The front end's own settings (addresses, TLS, auth, limits,
timeouts, restarts) stay in ServiceConfig. Plain values, no torch: the front end builds it.

EngineSettings is also what `dyngen generate` builds its in-process engine from
(service/engine/build.py)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from engine import defaults
from engine.speculation.speculation_config import SpeculationConfig

_SPECULATION = SpeculationConfig()  # the speculation flags' defaults are the engine's own


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
    prefill_while_decoding: int = defaults.PREFILL_WHILE_DECODING
    prompt_reserve: float = defaults.PROMPT_RESERVE  # the share a long prompt leaves to those behind
    prefill_alone_ms: float = defaults.PREFILL_ALONE_MS  # prompt work of a forward no stream decodes in
    max_queue: int = defaults.MAX_QUEUE
    max_queue_per_tenant: int | None = None  # None: a quarter of max_queue
    priority_aging: float = defaults.PRIORITY_AGING
    tenant_weight: tuple[str, ...] = ()  # NAME=W: a tenant's weight in fair shares (--tenant-weight)
    sampling_threads: int = defaults.SAMPLING_THREADS
    sampler_mode: str = defaults.SAMPLER_MODE
    lora: tuple[str, ...] = ()  # NAME=PATH: LoRA adapters loaded at start (--lora, repeatable)
    max_adapters: int = defaults.MAX_ADAPTERS
    adapter_dir: str | None = None  # the folder run-time LoadAdapter reads inside; None: refused
    max_adapter_rank: int = defaults.MAX_ADAPTER_RANK
    max_adapter_bytes: int = defaults.MAX_ADAPTER_BYTES
    device: str = defaults.DEVICE  # auto, cpu, cuda or cuda:N (engine/device.py)
    attention: str = defaults.ATTENTION  # auto, torch, triton or native (kernels/attention/backend.py)

    def __post_init__(self) -> None:
        # Flags and JSON give a list; the settings are frozen and hashable.
        object.__setattr__(self, "lora", tuple(self.lora))
        object.__setattr__(self, "tenant_weight", tuple(self.tenant_weight))

    @property
    def num_pages(self) -> int:
        return max(1, self.cache_tokens // self.page_size)

    def tenant_weights(self) -> tuple[tuple[str, float], ...]:
        """(tenant, weight) of each --tenant-weight NAME=W."""
        return tuple(split_tenant_weight(flag) for flag in self.tenant_weight)

    def lora_pairs(self) -> list[tuple[str, Path]]:
        """(name, folder) of each --lora NAME=PATH."""
        return [split_lora_flag(flag) for flag in self.lora]


def split_lora_flag(flag: str) -> tuple[str, Path]:
    """NAME=PATH -> (NAME, PATH); ValueError for anything else."""
    name, sep, path = flag.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora takes NAME=PATH, got {flag!r}")
    return name, Path(path)


def split_tenant_weight(flag: str) -> tuple[str, float]:
    """NAME=W -> (NAME, W) with W a finite number > 0; ValueError for anything else."""
    name, sep, value = flag.rpartition("=")
    try:
        weight = float(value)
    except ValueError:
        weight = 0.0
    if not sep or not name or not (0 < weight < float("inf")):
        raise ValueError(f"--tenant-weight takes NAME=W with W a number > 0, got {flag!r}")
    return name, weight


@dataclass(frozen=True)
class SpeculationFlags:
    """The speculation flags' raw values (validated in the engine by speculation_flags.speculation_options)."""

    # auto, none, ngram or draft_model. auto (service/speculation_flags.py) drafts n-grams where
    # speculation changes no token: served at low load they halved the chat trace's time per
    # output token (3-4 against 6-7 ms) and the editing trace's (2-3 against 6-7 ms), and the
    # policy's limits (speculate_max_batch, prompts first) keep them out of the steps near
    # saturation. The engine library's SpeculationConfig stays off unless asked: its adaptive
    # lengths need the warm-up's cost table.
    speculate: str = "auto"
    num_draft_tokens: int = _SPECULATION.num_draft_tokens  # the most; adaptive lengths below it
    step_draft_tokens: int = _SPECULATION.step_draft_tokens  # the most over one step's jobs
    max_ngram: int = _SPECULATION.max_ngram
    speculate_max_batch: int = _SPECULATION.max_batch_size  # no speculation with more running jobs than this
    draft_model: str | None = None  # default: the target's own file
    draft_layers: int = 0  # keep only the draft's first N layers (0 = all)
    draft_dtype: str = "float32"


def engine_settings_from(flags: object) -> EngineSettings:
    """EngineSettings from whatever carries its fields as attributes (a ServiceConfig, `dyngen
    generate`'s parsed flags); a field the source lacks keeps its default. The one place the two
    commands' flags become engine settings."""
    values = {f.name: getattr(flags, f.name) for f in fields(EngineSettings) if hasattr(flags, f.name)}
    model = values.pop("model", None)
    return EngineSettings(model=Path(model) if model else None, **values)


def speculation_flags_from(flags: object) -> SpeculationFlags:
    """SpeculationFlags from whatever carries its fields as attributes (as engine_settings_from)."""
    values = {f.name: getattr(flags, f.name) for f in fields(SpeculationFlags) if hasattr(flags, f.name)}
    return SpeculationFlags(**values)


@dataclass(frozen=True)
class EngineConfig:
    settings: EngineSettings
    speculation: SpeculationFlags = field(default_factory=SpeculationFlags)
    warmup: bool = True
    torch_threads: int = 0  # 0 = one per core
    omp_wait_policy: str = "active"  # active (dedicated machine) or passive (CPU shared with others)
    # With active waiting: how long an OpenMP worker spins after a parallel region before it sleeps
    # (GOMP_SPINCOUNT). Unbounded, an idle server kept a core at 100%; 1e6 spins are ~25 ms here,
    # far longer than any gap between a step's parallel regions.
    omp_spin_count: int = 1_000_000
    # Tests only (--fault-crash-marker): the engine process kills itself (SIGKILL) after any step that
    # ran a job whose request identifier is this; "" (the default) turns the hook off.
    fault_crash_marker: str = ""

    def to_json(self) -> str:
        out = asdict(self)
        model = self.settings.model
        out["settings"]["model"] = None if model is None else str(model)
        return json.dumps(out)

    @staticmethod
    def from_json(text: str) -> EngineConfig:
        d = json.loads(text)
        settings = d.pop("settings")
        model = settings.pop("model")
        return EngineConfig(
            settings=EngineSettings(model=None if model is None else Path(model), **settings),
            speculation=SpeculationFlags(**d.pop("speculation")),
            **d,
        )
