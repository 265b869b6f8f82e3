"""`dyngen generate`: the model in-process through the dynamic generator, one prompt or a JSON-lines
file of prompts run concurrently; with --server it is the client package's `dyngen-client
generate` (same flags, no model loaded). It shares its request flags with that client, so this
command-line module (never the server) imports the client's command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dyngen_client import cli as client_cli
from dyngen_client.cli import CliError, guidance_flags, json_record, positive_int, prompt_texts
from engine import defaults
from engine.errors import DyngenError

# `dyngen generate` runs float linears unless asked: its output is the reference's, token for token
# (`serve` defaults to EngineSettings.quant, auto, for throughput).
GENERATE_QUANT = "none"

__all__ = ["CliError", "add_generate_arguments", "run_generate"]


class EngineFlag(argparse.Action):
    """Stores a flag's value and records that it was given (even at its default's value)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        namespace.engine_flags_given = (*namespace.engine_flags_given, option_string or self.dest)


def add_generate_arguments(gen: argparse.ArgumentParser) -> None:
    from service.config import (
        ATTENTION_HELP,
        DEVICE_HELP,
        WEIGHT_DTYPES,
        device_flag,
        fraction_flag,
        non_negative_flag,
    )
    from service.engine_config import EngineSettings
    from service.speculation_flags import add_speculation_arguments

    # The flags shared with `dyngen-client generate` (which this mode's --server runs).
    client_cli.add_request_arguments(gen)

    # The flags that set up the in-process engine: with --server the server's own settings apply,
    # so giving one there is refused rather than silently ignored.
    def local(*names: str, **options: Any) -> None:
        gen.add_argument(*names, action=EngineFlag, **options)

    local("--model", type=Path, default=None, help=".gguf file or Hugging Face folder (default: shipped)")
    local(
        "--dtype",
        choices=WEIGHT_DTYPES,
        default=EngineSettings.dtype,
        help="activations and float weights: auto = bfloat16 only on CPUs with native bfloat16 and float linears",
    )
    local(
        "--quant",
        choices=["auto", "none", "int8", "int4"],
        default=GENERATE_QUANT,
        help="linear kinds: none = float in --dtype; int8 = weight-only int8; int4 = the GGUF's own "
        "Q4_0/Q4_1 blocks (others re-quantized), int8 head; auto = the fastest kinds that pass the "
        "quality gate, timed at load per shape and cached (see engine/model/quantization.py)",
    )
    local("--page-size", type=positive_int, default=defaults.PAGE_SIZE, help="KV cache page size in tokens")
    local(
        "--cache-tokens",
        type=positive_int,
        default=defaults.CACHE_TOKENS,
        help="KV cache size in tokens, rounded down to whole pages (at least one)",
    )
    local(
        "--kv-cache",
        choices=defaults.KV_CACHE_KINDS,
        default=defaults.KV_CACHE,
        help="KV cache storage: auto = for a float32 model with quantized linears int8 where the attention "
        "runs on AMX tiles, else float16; float otherwise; "
        "float = the model's dtype; float16 = half float32's bytes; int8 = int8 "
        "K/V with a float16 scale per token and head (~3.9x less memory than float32, ~1.9x less than bfloat16)",
    )
    local("--max-batch-size", type=positive_int, default=defaults.MAX_BATCH_SIZE, help="jobs running at once")
    local("--chunk-size", type=positive_int, default=defaults.MAX_CHUNK_SIZE, help="tokens per forward")
    local(
        "--prefill-while-decoding",
        type=positive_int,
        default=defaults.PREFILL_WHILE_DECODING,
        help="prompt tokens per forward while other jobs decode in it",
    )
    local(
        "--prompt-reserve",
        type=fraction_flag,
        default=defaults.PROMPT_RESERVE,
        help="the share of a forward's prompt tokens that a prompt not finishing in it leaves to shorter "
        "prompts behind it (0 = arrival order)",
    )
    local(
        "--prefill-alone-ms",
        type=non_negative_flag,
        default=defaults.PREFILL_ALONE_MS,
        help="the prompt work of a forward no job decodes in, in ms by the warm-up's timing, when it "
        "runs (0 = --chunk-size tokens)",
    )
    local(
        "--sampler-mode",
        choices=defaults.SAMPLER_MODES,
        default=defaults.SAMPLER_MODE,
        help="sampled rows: batched (one set of tensor ops for the batch) or threaded (one pool task per job)",
    )
    local(
        "--sampling-threads",
        type=positive_int,
        default=defaults.SAMPLING_THREADS,
        help="sampler thread pool size (threaded sampler mode)",
    )
    local("--device", type=device_flag, default=defaults.DEVICE, help=DEVICE_HELP)
    local("--attention", choices=defaults.ATTENTION_KINDS, default=defaults.ATTENTION, help=ATTENTION_HELP)
    gen.add_argument("--quiet", action="store_true", help="no progress bar while loading")
    add_speculation_arguments(gen, EngineFlag)
    gen.set_defaults(engine_flags_given=())

    client_cli.add_connection_arguments(gen, None, "run through a dyngen server instead of in-process")


def run_generate(args: argparse.Namespace) -> int:
    if args.server is not None:
        given = list(dict.fromkeys(args.engine_flags_given))
        if given:
            raise CliError(
                f"{', '.join(given)}: the in-process engine's settings; with --server the server's own apply"
            )
        return client_cli.run_generate(args)
    remote = ("tls", "tls_ca", "tls_cert", "tls_key", "token_file")
    given = [f"--{d.replace('_', '-')}" for d in remote if getattr(args, d)]
    if given:
        raise CliError(f"{', '.join(given)}: only with --server (this run is in-process)")
    texts = prompt_texts(args)
    flags = guidance_flags(args)
    # Heavy imports after argument parsing, so `dyngen --help` and usage errors are instant.
    from engine.jobs import JobSpec, SamplingSettings
    from engine.model.tokenizer import ChatMessage
    from engine.output.loop_detector import LoopStop
    from engine.prompt.guidance import Guidance
    from engine.startup_objects import freeze_startup_objects
    from kernels.cache_dir import default_cache_dir
    from service.engine.build import build_engine
    from service.engine_config import engine_settings_from, split_lora_flag
    from service.speculation_flags import speculation_from_args

    sampling = SamplingSettings(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
    )
    settings = engine_settings_from(args)
    loaded, generator = build_engine(settings, speculation_from_args(args), progress=not args.quiet)
    if generator.speculation.wants_cost():
        # Adaptive draft lengths start from the step's measured cost, kept as `serve` keeps it.
        generator.warmup(step_costs=default_cache_dir())
    freeze_startup_objects()  # as `serve` does once started
    adapter: str | None = None
    if args.adapter:
        try:
            adapter, folder = split_lora_flag(args.adapter)
        except ValueError:
            raise CliError("in-process `dyngen generate` loads its adapter: --lora NAME=PATH") from None
        generator.load_adapter(adapter, folder)
    if not args.quiet:
        print(f"model: {loaded.model.describe()}", file=sys.stderr)
    tok = loaded.tokenizer
    if not args.quiet:
        print(f"kv cache: {generator.cache.describe()}", file=sys.stderr)

    def encode(text: str) -> tuple[int, ...]:
        return tuple(tok.encode_chat([ChatMessage("user", text)]) if args.chat else tok.encode(text))

    guidance = None if flags is None else Guidance(flags[0], encode(flags[1]))
    specs = [
        JobSpec(
            encode(t),
            max_new_tokens=args.max_new_tokens,
            ignore_eos=args.ignore_eos,
            stop_strings=tuple(args.stop),
            sampling=sampling,
            banned_strings=tuple(args.ban),
            token_healing=args.heal,
            adapter=adapter,
            stop_on_loop=None if args.stop_on_loop is None else LoopStop(*args.stop_on_loop),
            priority=args.priority,
            guidance=guidance,
        )
        for t in texts
    ]
    try:
        completions = generator.generate(specs)
    except DyngenError as exc:
        if len(specs) > 1 and exc.spec_index is not None:  # which line of a prompts file
            raise CliError(f"prompt {exc.spec_index + 1} of {len(specs)}: {exc}") from exc
        raise
    finally:
        generator.close()
    as_json = args.json or args.prompts_file is not None
    for c in completions:
        f = c.finished
        if as_json:
            t = f.timings
            print(
                json_record(
                    c.text,
                    c.token_ids,
                    f.stop_reason.value,
                    f.stop_string,
                    (f.prompt_tokens, f.new_tokens, f.cached_tokens),
                    (t.queued, t.prefill, t.decode),
                )
            )
        else:
            print(c.text)
    return 0
