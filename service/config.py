"""Service configuration: flags, each with an environment variable (DYNGEN_<FLAG>) as its default."""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from engine import defaults
from engine.device import check_device_flag
from engine.errors import DyngenError, InvalidRequestError
from engine.speculation.speculation_config import DrafterKind
from service.engine_config import (
    EngineConfig,
    EngineSettings,
    SpeculationFlags,
    engine_settings_from,
    speculation_flags_from,
    split_lora_flag,
    split_tenant_weight,
)

# `--speculate auto`: n-gram drafts where a token's logits are the same bits whatever shares its
# step (speculation then changes no token), none elsewhere.
SPECULATE_AUTO = "auto"
SPECULATE_KINDS = (SPECULATE_AUTO, *(k.value for k in DrafterKind))

# --dtype and --draft-dtype: engine.model.loader.WeightDtype's values, named here so that parsing
# flags imports no model code (and no torch); tests/test_frontend_imports.py checks they agree.
WEIGHT_DTYPES = ("auto", "float32", "bfloat16")


@dataclass(frozen=True)
class ServiceConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    model: str | None = None  # .gguf file or HF folder; None = the shipped model
    dtype: str = EngineSettings.dtype  # float32, bfloat16, or auto: by the CPU (WeightDtype.resolve)
    quant: str = EngineSettings.quant  # linear kinds: none, int8, int4 or auto (quantization.py)
    page_size: int = defaults.PAGE_SIZE
    cache_tokens: int = defaults.CACHE_TOKENS
    kv_cache: str = defaults.KV_CACHE
    max_batch_size: int = defaults.MAX_BATCH_SIZE
    max_queue: int = defaults.MAX_QUEUE
    max_queue_per_tenant: int | None = None  # None: a quarter of max_queue (defaults.tenant_queue_cap)
    priority_aging: float = defaults.PRIORITY_AGING
    tenant_weight: tuple[str, ...] = ()  # NAME=W, a tenant's weight in fair shares
    chunk_size: int = defaults.MAX_CHUNK_SIZE
    prefill_while_decoding: int = defaults.PREFILL_WHILE_DECODING
    prompt_reserve: float = defaults.PROMPT_RESERVE
    prefill_alone_ms: float = defaults.PREFILL_ALONE_MS
    sampling_threads: int = defaults.SAMPLING_THREADS
    sampler_mode: str = defaults.SAMPLER_MODE
    lora: tuple[str, ...] = ()  # NAME=PATH, loaded at start and shared by every tenant
    max_adapters: int = defaults.MAX_ADAPTERS
    adapter_dir: str | None = None  # run-time LoadAdapter reads only inside it; None: refused
    max_adapter_rank: int = defaults.MAX_ADAPTER_RANK
    max_adapter_bytes: int = defaults.MAX_ADAPTER_BYTES
    max_adapters_per_tenant: int = defaults.MAX_ADAPTERS_PER_TENANT
    device: str = defaults.DEVICE
    attention: str = defaults.ATTENTION
    torch_threads: int = EngineConfig.torch_threads
    omp_wait_policy: str = EngineConfig.omp_wait_policy
    omp_spin_count: int = EngineConfig.omp_spin_count
    metrics_port: int = 0  # 0 = no metrics endpoint
    metrics_host: str | None = None  # default: the same address as the gRPC port
    reflection: bool = True  # gRPC server reflection (grpcurl and ghz without .proto files)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None  # PEM CA bundle: require client certificates signed by it (mTLS)
    auth_tokens_file: str | None = None  # lines "<tenant> <token>": bearer tokens required
    max_message_bytes: int = 4 * 1024 * 1024
    max_prompt_chars: int = 1 << 20  # text or chat contents, checked before tokenizing
    max_streams: int = 1024  # Generate + Stream calls open at once; RESOURCE_EXHAUSTED past it
    # With authentication on: jobs of priority > 0 one tenant may have queued or running at once
    # (RESOURCE_EXHAUSTED past it), so no tenant starves the others with high-priority jobs.
    max_priority_jobs: int = 4
    max_pending_calls: int = 1024  # calls waiting for the engine's answer (bounds the pipe's outbox)
    keepalive_seconds: float = 30.0  # HTTP/2 pings to idle clients; dead peers are dropped
    max_connection_age_seconds: float = 0.0  # 0 = unlimited; else connections are recycled (balancers)
    stream_grace_seconds: float = 30.0  # an enqueued job not streamed by then is cancelled
    shutdown_grace_seconds: float = 30.0  # SIGTERM: running jobs get this long to finish
    # SIGTERM: health NOT_SERVING at once, but new jobs are still admitted this long, so a load
    # balancer's health checks take the replica out before it starts refusing (0: refuse at once).
    drain_delay_seconds: float = 0.0
    replica_id: str = ""  # named in JobFinished and ModelInfo; "" = "<hostname>:<port>"
    served_model_name: str = ""  # the model's name behind a gateway (the OpenAI `model`); "" = the file's
    watchdog_seconds: float = 3.0  # no engine heartbeat this long: health NOT_SERVING
    hang_seconds: float = 30.0  # no heartbeat this long: kill and restart
    # No engine loop pass this long (heartbeats still coming): a wedged loop, killed and restarted.
    # Long, because one iteration of a big prefill on a starved CPU measured over 30 s.
    loop_stall_seconds: float = 300.0
    engine_call_timeout_seconds: float = 300.0  # an engine request unanswered this long fails UNAVAILABLE
    restart_backoff_seconds: float = 0.5  # first wait before restarting a failed engine (then doubling)
    max_restart_failures: int = 5  # engines dying before they served a minute, in a row: give up, exit 1
    warmup: bool = EngineConfig.warmup
    fault_crash_marker: str = EngineConfig.fault_crash_marker
    # Keep a spare engine process with its imports done (about 230 MiB), so a dead engine is replaced
    # in about the model's load time rather than a whole start.
    spare_engine: bool = False
    speculate: str = SpeculationFlags.speculate
    num_draft_tokens: int = SpeculationFlags.num_draft_tokens
    step_draft_tokens: int = SpeculationFlags.step_draft_tokens
    max_ngram: int = SpeculationFlags.max_ngram
    speculate_max_batch: int = SpeculationFlags.speculate_max_batch
    draft_model: str | None = SpeculationFlags.draft_model
    draft_layers: int = SpeculationFlags.draft_layers
    draft_dtype: str = SpeculationFlags.draft_dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "lora", tuple(self.lora))  # flags and JSON give a list
        object.__setattr__(self, "tenant_weight", tuple(self.tenant_weight))

    @property
    def num_pages(self) -> int:
        return max(1, self.cache_tokens // self.page_size)

    @property
    def model_path(self) -> Path | None:
        return Path(self.model) if self.model else None

    def engine_config(self) -> EngineConfig:
        """The part of this configuration the engine process is started with."""
        return EngineConfig(
            settings=engine_settings_from(self),
            speculation=speculation_flags_from(self),
            warmup=self.warmup,
            torch_threads=self.torch_threads,
            omp_wait_policy=self.omp_wait_policy,
            omp_spin_count=self.omp_spin_count,
            fault_crash_marker=self.fault_crash_marker,
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> ServiceConfig:
        return ServiceConfig(**json.loads(text))


def _flag(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in allowed:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(allowed)}, got {text!r}")
        return text

    return parse


DEVICE_HELP = (
    "where the model runs: auto (the first CUDA device torch sees, else the CPU), cpu, cuda or cuda:N "
    "(refused at start where torch sees no such device)"
)
ATTENTION_HELP = (
    "attention kernels: auto (Triton on CUDA, native on the CPU), torch, triton (on the CPU only under "
    "TRITON_INTERPRET=1, the Triton interpreter: slow, for checks) or native (CPU)"
)


def device_flag(text: str) -> str:
    try:
        return check_device_flag(text)
    except DyngenError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _env(name: str, default: str | None) -> str | None:
    value = os.environ.get(f"DYNGEN_{name.upper()}")
    return default if value is None else _EnvText(value, f"DYNGEN_{name.upper()}")


class _EnvText(str):
    """A flag's value taken from its environment variable: a bad one is blamed on the variable."""

    variable: str

    def __new__(cls, text: str, variable: str) -> _EnvText:
        made = super().__new__(cls, text)
        made.variable = variable
        return made


def _checked(kind: Callable[[str], object]) -> Callable[[str], object]:
    """`kind` with every failure an argparse error (one line, exit 2) that names an environment
    variable the value came from. argparse parses a string default as it parses a flag's value,
    so a variable's value is checked only when its flag is not given, and never for --help."""

    def parse(text: str) -> object:
        try:
            return kind(text)
        except (ValueError, TypeError, OverflowError, argparse.ArgumentTypeError) as exc:
            why = str(exc) if isinstance(exc, argparse.ArgumentTypeError) else f"invalid value {text!r}"
            if isinstance(text, _EnvText):
                why = f"{why} (from {text.variable})"
            raise argparse.ArgumentTypeError(why) from None

    parse.__name__ = getattr(kind, "__name__", "value")
    return parse


def whole(low: int, high: int = 2**63 - 1) -> Callable[[str], int]:
    """A whole number in [low, high]."""

    def parse(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            bound = f">= {low}" if high == 2**63 - 1 else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"expected a whole number {bound}, got {text!r}")
        return value

    return parse


def seconds(zero_ok: bool) -> Callable[[str], float]:
    """A finite time in seconds, > 0 (or >= 0 where 0 means something)."""

    def parse(text: str) -> float:
        value = float(text)
        if not (math.isfinite(value) and (value > 0 or (zero_ok and value == 0))):
            raise argparse.ArgumentTypeError(f"expected seconds {'>= 0' if zero_ok else '> 0'}, got {text!r}")
        return value

    return parse


PORT = whole(0, 65535)
_positive = whole(1)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    d = ServiceConfig()

    def opt(name: str, kind: Callable[[str], object], default: object, help_: str) -> None:
        env = _env(name, None)
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=_checked(kind),
            default=default if env is None else env,
            help=f"{help_} [DYNGEN_{name.upper()}]",
        )

    opt("host", str, d.host, "address to listen on")
    opt("port", PORT, d.port, "gRPC port (0 = any free port)")
    opt("model", str, d.model, ".gguf file or Hugging Face folder (default: the shipped model)")
    opt("dtype", _choice(*WEIGHT_DTYPES), d.dtype, "auto (by the CPU), float32 or bfloat16")
    opt(
        "quant",
        _choice("none", "int8", "int4", "auto"),
        d.quant,
        "linear kinds (auto: the fastest that pass the quality gate, timed at load, cached; none: exact float)",
    )
    opt("page_size", _positive, d.page_size, "KV cache page size in tokens")
    opt(
        "cache_tokens",
        _positive,
        d.cache_tokens,
        "KV cache size in tokens, rounded down to whole pages (at least one)",
    )
    opt(
        "kv_cache",
        _choice(*defaults.KV_CACHE_KINDS),
        d.kv_cache,
        "KV cache storage: auto (for a float32 model with quantized linears int8 where the attention "
        "runs on AMX tiles, else float16; float otherwise), float (the model's dtype), float16 (half "
        "float32's bytes), bfloat16 (the same bytes, fewer mantissa bits) or int8 (~3.9x less memory than float32)",
    )
    opt("max_batch_size", int, d.max_batch_size, "jobs running at once")
    opt("max_queue", int, d.max_queue, "jobs waiting for admission before RESOURCE_EXHAUSTED")
    opt(
        "max_queue_per_tenant",
        _positive,
        d.max_queue_per_tenant,
        "with authentication on: jobs one tenant may have waiting, so one tenant's flood leaves room "
        "(default: a quarter of --max-queue)",
    )
    opt(
        "priority_aging",
        non_negative_flag,
        d.priority_aging,
        "priority levels a waiting job gains per second (priority p = a head start of p/rate seconds; "
        "0 = none)",
    )
    weight_env = _env("tenant_weight", None)
    parser.add_argument(
        "--tenant-weight",
        type=_tenant_weight_flag,
        action="append",
        default=[_EnvText(f, "DYNGEN_TENANT_WEIGHT") for f in weight_env.split(",") if f]
        if weight_env
        else [],
        metavar="NAME=W",
        help="a tenant's weight in fair shares (default 1: a tenant of weight 2 is served twice the "
        "tokens when both wait); repeatable [DYNGEN_TENANT_WEIGHT: comma-separated]",
    )
    opt(
        "chunk_size",
        _positive,
        d.chunk_size,
        "tokens per forward, counted from depth 0 (a deeper prompt token costs more)",
    )
    opt(
        "prefill_while_decoding",
        _positive,
        d.prefill_while_decoding,
        "prompt tokens per forward while other jobs decode in it, counted from depth 0: a deeper token "
        "costs more (its attention reads more keys); bounds their inter-token stall",
    )
    opt(
        "prompt_reserve",
        fraction_flag,
        d.prompt_reserve,
        "the share of a forward's prompt tokens that a prompt not finishing in it leaves to the prompts "
        "behind it, so a short request need not wait out a long prefill (0 = arrival order)",
    )
    opt(
        "prefill_alone_ms",
        non_negative_flag,
        d.prefill_alone_ms,
        "the prompt work of a forward no stream decodes in, in milliseconds by the warm-up's timing "
        "(within --prefill-while-decoding and --chunk-size tokens from depth 0): how long a request "
        "arriving beside a long prefill waits for the forward in flight (0 = --chunk-size)",
    )
    opt("sampling_threads", _positive, d.sampling_threads, "sampler thread pool size (threaded sampler mode)")
    opt(
        "sampler_mode",
        _choice(*defaults.SAMPLER_MODES),
        d.sampler_mode,
        "sampled rows: batched (one set of tensor ops for the batch) or threaded (one pool task per job)",
    )
    lora_env = _env("lora", None)
    parser.add_argument(
        "--lora",
        type=_lora_flag,
        action="append",
        default=[_EnvText(f, "DYNGEN_LORA") for f in lora_env.split(",") if f] if lora_env else [],
        metavar="NAME=PATH",
        help="load a LoRA adapter (a PEFT folder) at start under NAME, shared by every tenant; repeatable "
        "[DYNGEN_LORA: comma-separated]",
    )
    opt("max_adapters", _positive, d.max_adapters, "LoRA adapters loaded at once (--lora and LoadAdapter)")
    opt(
        "adapter_dir",
        _folder,
        d.adapter_dir,
        "the folder run-time LoadAdapter reads adapters from (a name or relative path inside it; "
        "symlinks out are refused); without it LoadAdapter is refused (FAILED_PRECONDITION)",
    )
    opt("max_adapter_rank", _positive, d.max_adapter_rank, "largest LoRA rank a loaded adapter may have")
    opt(
        "max_adapter_bytes",
        _positive,
        d.max_adapter_bytes,
        "largest adapter weights file, checked from its header before any tensor is read",
    )
    opt(
        "max_adapters_per_tenant",
        _positive,
        d.max_adapters_per_tenant,
        "with authentication on: run-time adapters one tenant holds at once (the --lora ones are shared)",
    )
    opt("device", device_flag, d.device, DEVICE_HELP)
    opt("attention", _choice(*defaults.ATTENTION_KINDS), d.attention, ATTENTION_HELP)
    opt("torch_threads", whole(0), d.torch_threads, "torch threads in the engine process (0 = one per core)")
    opt(
        "omp_wait_policy",
        _choice("active", "passive"),
        d.omp_wait_policy,
        "OpenMP waiting: active (own machine) or passive (shared CPU)",
    )
    opt(
        "omp_spin_count",
        whole(0),
        d.omp_spin_count,
        "with active waiting, spins before an idle OpenMP worker sleeps (GOMP_SPINCOUNT; 0 = forever)",
    )
    opt("metrics_port", PORT, d.metrics_port, "Prometheus metrics HTTP port (0 = off)")
    opt("metrics_host", str, d.metrics_host, "address of the metrics endpoint (default: --host)")
    opt("reflection", _flag, d.reflection, "serve gRPC reflection: true or false")
    opt("tls_cert", str, d.tls_cert, "PEM certificate chain (with --tls-key: serve TLS)")
    opt("tls_key", str, d.tls_key, "PEM private key")
    opt("tls_client_ca", str, d.tls_client_ca, "PEM CA bundle: require client certificates (mTLS)")
    opt("auth_tokens_file", str, d.auth_tokens_file, 'bearer tokens, one "<tenant> <token>" per line')
    opt(
        "max_message_bytes",
        whole(1024, 2**31 - 1),
        d.max_message_bytes,
        "largest gRPC message, both directions",
    )
    opt("max_prompt_chars", _positive, d.max_prompt_chars, "longest text or chat prompt, in characters")
    opt("max_streams", _positive, d.max_streams, "Generate/Stream calls open at once")
    opt(
        "max_priority_jobs",
        whole(0),
        d.max_priority_jobs,
        "with authentication on: jobs of priority > 0 one tenant may have queued or running at once "
        "(one more is RESOURCE_EXHAUSTED, so no tenant starves the others; no cap without authentication)",
    )
    opt("max_pending_calls", _positive, d.max_pending_calls, "engine calls waiting for an answer at once")
    opt("keepalive_seconds", seconds(zero_ok=False), d.keepalive_seconds, "HTTP/2 keepalive ping interval")
    opt(
        "max_connection_age_seconds",
        seconds(zero_ok=True),
        d.max_connection_age_seconds,
        "recycle connections (0 = never)",
    )
    opt(
        "stream_grace_seconds",
        seconds(zero_ok=False),
        d.stream_grace_seconds,
        "cancel an enqueued job not streamed by then",
    )
    opt(
        "shutdown_grace_seconds",
        seconds(zero_ok=True),
        d.shutdown_grace_seconds,
        "SIGTERM: time running jobs get to finish",
    )
    opt(
        "watchdog_seconds", seconds(zero_ok=False), d.watchdog_seconds, "engine silent this long: NOT_SERVING"
    )
    opt(
        "drain_delay_seconds",
        seconds(zero_ok=True),
        d.drain_delay_seconds,
        "SIGTERM: keep admitting this long while health says NOT_SERVING (for balancers' checks)",
    )
    opt("replica_id", str, d.replica_id, "this replica's name in results (default: <hostname>:<port>)")
    opt(
        "served_model_name",
        str,
        d.served_model_name,
        "the model's name in the gateway's worker contract, which OpenAI clients send as `model` "
        "(default: the model file's name)",
    )
    opt("hang_seconds", seconds(zero_ok=False), d.hang_seconds, "engine silent this long: restart it")
    opt(
        "loop_stall_seconds",
        seconds(zero_ok=False),
        d.loop_stall_seconds,
        "engine loop stuck this long: restart it",
    )
    opt(
        "engine_call_timeout_seconds",
        seconds(zero_ok=False),
        d.engine_call_timeout_seconds,
        "engine answer timeout",
    )
    opt(
        "restart_backoff_seconds",
        seconds(zero_ok=True),
        d.restart_backoff_seconds,
        "first engine restart delay",
    )
    opt(
        "max_restart_failures",
        whole(0),
        d.max_restart_failures,
        "engine restarts in a row that die before serving a minute (with nothing to resume) before exit 1",
    )
    opt(
        "spare_engine",
        _flag,
        d.spare_engine,
        "keep a spare engine process with its imports done (~230 MiB): a crashed or hung engine is "
        "replaced in about the model's load time, not a whole start",
    )
    opt(
        "fault_crash_marker",
        str,
        d.fault_crash_marker,
        "tests only: the engine kills itself after a step that ran a job with this request identifier "
        "(docs/ARCHITECTURE.md, crash resume; off by default)",
    )
    opt(
        "speculate",
        _choice(*SPECULATE_KINDS),
        d.speculate,
        "speculative decoding: auto, none, ngram or draft_model",
    )
    opt("num_draft_tokens", _positive, d.num_draft_tokens, "the most draft tokens a job verifies per step")
    opt(
        "step_draft_tokens",
        _positive,
        d.step_draft_tokens,
        "the most draft tokens a step verifies over its jobs",
    )
    opt("max_ngram", _positive, d.max_ngram, "longest suffix the n-gram drafter matches")
    opt(
        "speculate_max_batch",
        whole(0),
        d.speculate_max_batch,
        "no speculation with more running jobs than this",
    )
    opt("draft_model", str, d.draft_model, "draft model file (default: the target's own)")
    opt("draft_layers", whole(0), d.draft_layers, "keep only the draft's first N layers (0 = all)")
    opt("draft_dtype", _choice(*WEIGHT_DTYPES[1:]), d.draft_dtype, "draft model dtype: float32 or bfloat16")


def _folder(text: str) -> str:
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a folder")
    return text


def non_negative_flag(text: str) -> float:
    value = float(text)
    if not (0 <= value < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def fraction_flag(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}")
    return value


def _tenant_weight_flag(text: str) -> str:
    try:
        split_tenant_weight(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


def _lora_flag(text: str) -> str:
    try:
        name, path = split_lora_flag(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"--lora {name}: {path} is not a folder")
    return text


def config_from_args(args: argparse.Namespace) -> ServiceConfig:
    # The repeatable flags' values from their variables (comma-separated) are checked here: argparse
    # parses a string default, not a list of them.
    for name, check in (("lora", _lora_flag), ("tenant_weight", _tenant_weight_flag)):
        for text in getattr(args, name, []):
            try:
                check(text)
            except argparse.ArgumentTypeError as exc:
                where = text.variable if isinstance(text, _EnvText) else f"--{name.replace('_', '-')}"
                raise InvalidRequestError(f"{where}: {exc}") from None
    return ServiceConfig(
        **{k: getattr(args, k) for k in ServiceConfig.__dataclass_fields__ if hasattr(args, k)}
    )
