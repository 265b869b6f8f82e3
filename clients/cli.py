"""The `dyngen` command line.

`dyngen generate` runs the model in-process through the dynamic generator: one
prompt, or a JSON-lines file of prompts run concurrently. Errors dyngen raises on purpose are printed as one
line on stderr with exit status 2; nothing is printed as a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.errors import DyngenError, InvalidRequestError

if TYPE_CHECKING:
    import grpc

DEFAULT_PAGE_SIZE = 64  # engine.generator.GeneratorConfig's default (see there why)
DEFAULT_CACHE_TOKENS = 16384


@dataclass(frozen=True)
class PromptLine:
    text: str


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _non_negative_float(value: str) -> float:
    x = float(value)
    if not x >= 0.0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return x


def build_parser() -> argparse.ArgumentParser:
    from service.speculation_flags import add_speculation_arguments

    parser = argparse.ArgumentParser(prog="dyngen", description="Serve and run language models with dyngen.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="run the model in-process and print the completion")
    gen.add_argument("prompt", nargs="?", help="the prompt text (omit with --prompts-file)")
    gen.add_argument(
        "--prompts-file", type=Path, help='JSON lines of {"prompt": ...}; one JSON line out each'
    )
    gen.add_argument(
        "--chat", action="store_true", help="wrap the prompt as one user message in the chat template"
    )
    gen.add_argument("--max-new-tokens", type=_positive, default=256)
    gen.add_argument("--temperature", type=_non_negative_float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    gen.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    gen.add_argument("--seed", type=int, default=None, help="seed for sampling (temperature > 0)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument(
        "--ignore-eos", action="store_true", help="do not stop at the model's end-of-sequence token"
    )
    gen.add_argument(
        "--model", type=Path, default=None, help=".gguf file or Hugging Face folder (default: shipped)"
    )
    gen.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="activations and float weights: auto = bfloat16 only on CPUs with native bfloat16 and float linears",
    )
    gen.add_argument(
        "--quant",
        choices=["auto", "none", "int8", "int4"],
        default="none",
        help="linear kinds: none = float in --dtype; int8 = weight-only int8; int4 = the GGUF's own "
        "Q4_0/Q4_1 blocks (others re-quantized), int8 head; auto = the fastest kinds that pass the "
        "quality gate, timed at load per shape and cached (see engine/model/quantization.py)",
    )
    gen.add_argument(
        "--page-size", type=_positive, default=DEFAULT_PAGE_SIZE, help="KV cache page size in tokens"
    )
    gen.add_argument(
        "--cache-tokens", type=_positive, default=DEFAULT_CACHE_TOKENS, help="KV cache size in tokens"
    )
    gen.add_argument(
        "--kv-cache",
        choices=["float", "int8"],
        default="float",
        help="KV cache storage: float = the model's dtype; int8 = int8 K/V with a float16 scale per "
        "token and head (~3.9x less memory than float32, ~1.9x less than bfloat16)",
    )
    gen.add_argument("--max-batch-size", type=_positive, default=64, help="jobs running at once")
    gen.add_argument("--chunk-size", type=_positive, default=2048, help="tokens per forward")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    gen.add_argument("--quiet", action="store_true", help="no progress bar while loading")
    add_speculation_arguments(gen)
    gen.add_argument(
        "--server",
        metavar="HOST:PORT",
        default=None,
        help="run through a dyngen server instead of in-process",
    )
    gen.add_argument("--tls", action="store_true", help="with --server: TLS (system roots unless --tls-ca)")
    gen.add_argument(
        "--tls-ca", default=None, help="with --server: PEM CA that signed the server (implies --tls)"
    )
    gen.add_argument("--tls-cert", default=None, help="with --server: client certificate (mTLS)")
    gen.add_argument("--tls-key", default=None, help="with --server: client private key (mTLS)")
    gen.add_argument(
        "--token-file",
        default=None,
        help="with --server: file holding a bearer token (default: $DYNGEN_TOKEN, if set)",
    )
    from service.config import add_serve_arguments

    serve = sub.add_parser("serve", help="serve the model over gRPC (health, reflection, metrics)")
    add_serve_arguments(serve)
    return parser


def read_prompts_file(path: Path) -> list[PromptLine]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise InvalidRequestError(f"cannot read prompts file {path}: {exc.strerror}") from exc
    prompts: list[PromptLine] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{path}:{number}: not valid JSON: {exc.msg}") from exc
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise InvalidRequestError(f'{path}:{number}: expected an object with a string "prompt"')
        prompts.append(PromptLine(obj["prompt"]))
    if not prompts:
        raise InvalidRequestError(f"{path}: no prompts")
    return prompts


def _record(
    text: str,
    token_ids: Sequence[int],
    stop_reason: str,
    stop_string: str | None,
    counts: tuple[int, int, int],
    timings: tuple[float, float, float],
) -> str:
    record = {
        "text": text,
        "token_ids": list(token_ids),
        "stop_reason": stop_reason,
        "stop_string": stop_string,
        "prompt_tokens": counts[0],
        "new_tokens": counts[1],
        "cached_tokens": counts[2],
        "queued_seconds": round(timings[0], 4),
        "prefill_seconds": round(timings[1], 4),
        "decode_seconds": round(timings[2], 4),
    }
    return json.dumps(record, ensure_ascii=False)


def run_generate_remote(args: argparse.Namespace, texts: list[str]) -> int:
    """Send every prompt to a server at once (one thread per stream) and print in order."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from clients.client import Chat, Client, Request, Result, Sampling, collect

    sampling = Sampling(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
    )
    with Client(args.server, credentials=_channel_credentials(args), token=_token(args)) as client:

        def one(text: str) -> Result:
            prompt: str | Chat = Chat.user(text) if args.chat else text
            request = Request(
                prompt,
                max_new_tokens=args.max_new_tokens,
                sampling=sampling,
                stop_strings=tuple(args.stop),
                ignore_eos=args.ignore_eos,
            )
            return collect(list(client.generate(request)))

        try:
            with ThreadPoolExecutor(max_workers=min(64, len(texts))) as pool:
                results = list(pool.map(one, texts))
        except grpc.RpcError as exc:
            raise ServerError(f"{exc.code().name}: {exc.details()}") from None
    as_json = args.json or args.prompts_file is not None
    for r in results:
        f = r.finished
        if as_json:
            reason = pb_stop_reason_name(f.stop_reason)
            t = f.timings
            print(
                _record(
                    r.text,
                    r.token_ids,
                    reason,
                    f.stop_string if f.HasField("stop_string") else None,
                    (f.prompt_tokens, f.new_tokens, f.cached_tokens),
                    (t.queued_seconds, t.prefill_seconds, t.decode_seconds),
                )
            )
        else:
            print(r.text)
    return 0


def _channel_credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    from clients.client import tls_credentials

    if not (args.tls or args.tls_ca or args.tls_cert or args.tls_key):
        return None
    if (args.tls_cert is None) != (args.tls_key is None):
        raise InvalidRequestError("--tls-cert and --tls-key go together")
    try:
        return tls_credentials(args.tls_ca, args.tls_cert, args.tls_key)
    except OSError as exc:
        raise InvalidRequestError(f"cannot read {exc.filename}: {exc.strerror}") from exc


def _token(args: argparse.Namespace) -> str | None:
    if args.token_file is None:
        return os.environ.get("DYNGEN_TOKEN") or None
    try:
        return Path(args.token_file).read_text().strip() or None
    except OSError as exc:
        raise InvalidRequestError(f"cannot read the token file {args.token_file}: {exc.strerror}") from exc


def pb_stop_reason_name(value: int) -> str:
    from service.proto.dyngen.v1 import generator_pb2 as pb

    return pb.StopReason.Name(value).removeprefix("STOP_REASON_").lower()  # type: ignore[arg-type]


class ServerError(DyngenError):
    """The server answered with an error status."""


def run_generate(args: argparse.Namespace) -> int:
    if (args.prompt is None) == (args.prompts_file is None):
        raise InvalidRequestError("give exactly one of PROMPT or --prompts-file")
    if args.server is not None:
        texts = (
            [args.prompt]
            if args.prompts_file is None
            else [p.text for p in read_prompts_file(args.prompts_file)]
        )
        return run_generate_remote(args, texts)
    # Heavy imports after argument parsing, so `dyngen --help` and usage errors are instant.
    from engine.generator import DynamicGenerator, GeneratorConfig
    from engine.jobs import JobSpec, SamplingSettings
    from engine.kv_cache import KVCacheKind
    from engine.model.loader import WeightDtype, load_model
    from engine.model.tokenizer import ChatMessage
    from engine.scheduler import SchedulerConfig

    texts = (
        [args.prompt] if args.prompts_file is None else [p.text for p in read_prompts_file(args.prompts_file)]
    )
    sampling = SamplingSettings(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
    )
    from engine.model.quantization import QuantMode

    loaded = load_model(
        args.model, WeightDtype(args.dtype), progress=not args.quiet, quant=QuantMode(args.quant)
    )
    if not args.quiet:
        print(f"model: {loaded.model.describe()}", file=sys.stderr)
    tok = loaded.tokenizer
    from service.speculation_flags import speculation_from_args

    speculation = speculation_from_args(args)
    config = GeneratorConfig(
        page_size=args.page_size,
        num_pages=max(1, args.cache_tokens // args.page_size),
        scheduler=SchedulerConfig(max_batch_size=args.max_batch_size, max_chunk_size=args.chunk_size),
        speculation=speculation.config,
        kv_cache=KVCacheKind(args.kv_cache),
    )
    generator = DynamicGenerator(
        loaded.model, tok, config, speculation.load_draft(args.model, progress=not args.quiet)
    )
    if not args.quiet:
        print(f"kv cache: {generator.cache.describe()}", file=sys.stderr)
    specs = [
        JobSpec(
            tuple(tok.encode_chat([ChatMessage("user", t)]) if args.chat else tok.encode(t)),
            max_new_tokens=args.max_new_tokens,
            ignore_eos=args.ignore_eos,
            stop_strings=tuple(args.stop),
            sampling=sampling,
        )
        for t in texts
    ]
    try:
        completions = generator.generate(specs)
    finally:
        generator.close()
    as_json = args.json or args.prompts_file is not None
    for c in completions:
        f = c.finished
        if as_json:
            t = f.timings
            print(
                _record(
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        if args.command == "serve":
            from service.config import config_from_args
            from service.server import main as serve_main

            return serve_main(config_from_args(args))
        return run_generate(args)
    except DyngenError as exc:
        print(f"dyngen: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
