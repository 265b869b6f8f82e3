"""`dyngen-client`: the command line of a caller that has only this package (no torch, no model).

`generate` sends prompts to a server and prints the completions (text, or one JSON line each);
`info` prints the server's GetModelInfo; `tokenize` its token ids for a prompt. The server
package's `dyngen generate --server` runs the same code with the same flags. Errors are one
line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from google.protobuf import json_format

from dyngen_client.client import Client, tls_credentials
from dyngen_client.errors import error_details
from dyngen_client.request import DEFAULT_GUIDANCE_SCALE, Chat, Guidance, Request, Sampling
from dyngen_client.result import Result, collect, stop_reason_name

MAX_PARALLEL_STREAMS = 64  # prompts of a --prompts-file in flight at once


class CliError(Exception):
    """A usage or server error, printed as one line (`PROG: error: ...`) with exit status 2."""


def positive_int(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def non_negative_float(value: str) -> float:
    x = float(value)
    if not x >= 0.0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return x


def _loop_stop(text: str) -> tuple[int, int]:
    window, sep, reps = text.partition(",")
    try:
        if not sep:
            raise ValueError
        return int(window), int(reps)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WINDOW,REPS (two integers), got {text!r}") from None


def add_request_arguments(parser: argparse.ArgumentParser) -> None:
    """The prompt, sampling and output flags that `generate` takes in either mode."""
    parser.add_argument("prompt", nargs="?", help="the prompt text (omit with --prompts-file)")
    parser.add_argument(
        "--prompts-file", type=Path, help='JSON lines of {"prompt": ...}; one JSON line out each'
    )
    parser.add_argument(
        "--chat", action="store_true", help="wrap the prompt as one user message in the chat template"
    )
    parser.add_argument("--max-new-tokens", type=positive_int, default=256)
    parser.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    parser.add_argument("--seed", type=int, default=None, help="seed for sampling (temperature > 0)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument(
        "--ban", action="append", default=[], help="banned string, never in the output (repeatable)"
    )
    parser.add_argument(
        "--heal", action="store_true", help="token healing: a prompt cut mid-word continues the word"
    )
    parser.add_argument(
        "--stop-on-loop",
        type=_loop_stop,
        default=None,
        metavar="WINDOW,REPS",
        help="stop once the output ends with a pattern of up to WINDOW tokens repeated REPS times",
    )
    parser.add_argument(
        "--priority",
        type=int,
        default=0,
        help="scheduling priority in [-1000, 1000], higher first (default 0); a waiting job preempts "
        "running jobs of lower priority when the engine is full",
    )
    parser.add_argument(
        "--negative-prompt",
        default=None,
        metavar="TEXT",
        help="classifier-free guidance: push the output away from this prompt (tokenized like the "
        "prompt, a user message with --chat)",
    )
    parser.add_argument(
        "--guidance-scale",
        type=float,
        default=None,
        metavar="S",
        help=f"with --negative-prompt: how far from it, in [0, 100]; 1 = no effect (default {DEFAULT_GUIDANCE_SCALE:g})",
    )
    parser.add_argument(
        "--lora",
        dest="adapter",
        default="",
        metavar="NAME",
        help="run with the server's LoRA adapter NAME (ListAdapters); in-process `dyngen generate`: "
        "NAME=PATH loads a PEFT folder first",
    )
    parser.add_argument(
        "--ignore-eos", action="store_true", help="do not stop at the model's end-of-sequence token"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")


def add_connection_arguments(
    parser: argparse.ArgumentParser, server_default: str | None, server_help: str
) -> None:
    """--server and how to reach it (TLS, mTLS, bearer token)."""
    parser.add_argument("--server", metavar="HOST:PORT", default=server_default, help=server_help)
    parser.add_argument(
        "--tls", action="store_true", help="with --server: TLS (system roots unless --tls-ca)"
    )
    parser.add_argument(
        "--tls-ca", default=None, help="with --server: PEM CA that signed the server (implies --tls)"
    )
    parser.add_argument("--tls-cert", default=None, help="with --server: client certificate (mTLS)")
    parser.add_argument("--tls-key", default=None, help="with --server: client private key (mTLS)")
    parser.add_argument(
        "--token-file",
        default=None,
        help="with --server: file holding a bearer token (default: $DYNGEN_TOKEN, if set)",
    )


def read_prompts_file(path: Path) -> list[str]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise CliError(f"cannot read prompts file {path}: {exc.strerror}") from exc
    prompts: list[str] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CliError(f"{path}:{number}: not valid JSON: {exc.msg}") from exc
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise CliError(f'{path}:{number}: expected an object with a string "prompt"')
        prompts.append(obj["prompt"])
    if not prompts:
        raise CliError(f"{path}: no prompts")
    return prompts


def guidance_flags(args: argparse.Namespace) -> tuple[float, str] | None:
    """(scale, negative prompt text) of --guidance-scale / --negative-prompt; None: no guidance."""
    if args.negative_prompt is None:
        if args.guidance_scale is not None:
            raise CliError("--guidance-scale needs --negative-prompt")
        return None
    scale = DEFAULT_GUIDANCE_SCALE if args.guidance_scale is None else args.guidance_scale
    return scale, args.negative_prompt


def prompt_texts(args: argparse.Namespace) -> list[str]:
    if (args.prompt is None) == (args.prompts_file is None):
        raise CliError("give exactly one of PROMPT or --prompts-file")
    return [args.prompt] if args.prompts_file is None else read_prompts_file(args.prompts_file)


def json_record(
    text: str,
    token_ids: Sequence[int],
    stop_reason: str,
    stop_string: str | None,
    counts: tuple[int, int, int],
    timings: tuple[float, float, float],
) -> str:
    """One completion as the JSON line `generate --json` prints (the same in both modes)."""
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


def _credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    if not (args.tls or args.tls_ca or args.tls_cert or args.tls_key):
        return None
    if (args.tls_cert is None) != (args.tls_key is None):
        raise CliError("--tls-cert and --tls-key go together")
    try:
        return tls_credentials(args.tls_ca, args.tls_cert, args.tls_key)
    except OSError as exc:
        raise CliError(f"cannot read {exc.filename}: {exc.strerror}") from exc


def _token(args: argparse.Namespace) -> str | None:
    if args.token_file is None:
        return os.environ.get("DYNGEN_TOKEN") or None
    try:
        return Path(args.token_file).read_text().strip() or None
    except OSError as exc:
        raise CliError(f"cannot read the token file {args.token_file}: {exc.strerror}") from exc


def connect(args: argparse.Namespace) -> Client:
    if not args.server:
        raise CliError("give --server HOST:PORT (or set DYNGEN_SERVER)")
    return Client(args.server, credentials=_credentials(args), token=_token(args))


def server_error(exc: grpc.RpcError) -> CliError:
    d = error_details(exc)
    retry = f" (retry in {d.retry_delay_seconds:g} s)" if d.retry_delay_seconds is not None else ""
    return CliError(f"{d.code.name}: {d.message}{retry}")


def run_generate(args: argparse.Namespace) -> int:
    """Send every prompt to the server at once (a thread per stream) and print them in order."""
    texts = prompt_texts(args)
    flags = guidance_flags(args)
    guidance = None if flags is None else Guidance(flags[0], Chat.user(flags[1]) if args.chat else flags[1])
    sampling = Sampling(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
    )
    with connect(args) as client:

        def one(text: str) -> Result:
            prompt: str | Chat = Chat.user(text) if args.chat else text
            request = Request(
                prompt,
                max_new_tokens=args.max_new_tokens,
                sampling=sampling,
                stop_strings=tuple(args.stop),
                ignore_eos=args.ignore_eos,
                banned_strings=tuple(args.ban),
                token_healing=args.heal,
                adapter=args.adapter,
                stop_on_loop=args.stop_on_loop,
                priority=args.priority,
                guidance=guidance,
            )
            return collect(client.generate(request))

        try:
            with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL_STREAMS, len(texts))) as pool:
                results = list(pool.map(one, texts))
        except grpc.RpcError as exc:
            raise server_error(exc) from None
    as_json = args.json or args.prompts_file is not None
    for r in results:
        f = r.finished
        if as_json:
            t = f.timings
            print(
                json_record(
                    r.text,
                    r.token_ids,
                    stop_reason_name(f.stop_reason),
                    f.stop_string if f.HasField("stop_string") else None,
                    (f.prompt_tokens, f.new_tokens, f.cached_tokens),
                    (t.queued_seconds, t.prefill_seconds, t.decode_seconds),
                )
            )
        else:
            print(r.text)
    return 0


def run_info(args: argparse.Namespace) -> int:
    with connect(args) as client:
        try:
            info = client.model_info(timeout=30)
        except grpc.RpcError as exc:
            raise server_error(exc) from None
    print(
        json.dumps(
            json_format.MessageToDict(
                info, always_print_fields_with_no_presence=True, preserving_proto_field_name=True
            ),
            indent=2,
        )
    )
    return 0


def run_tokenize(args: argparse.Namespace) -> int:
    with connect(args) as client:
        try:
            ids = client.tokenize(Chat.user(args.prompt) if args.chat else args.prompt, timeout=30)
        except grpc.RpcError as exc:
            raise server_error(exc) from None
    print(json.dumps(ids))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dyngen-client", description="Call a dyngen server (dyngen.v1.Generator) over gRPC."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    server = os.environ.get("DYNGEN_SERVER")
    server_help = "the server to call (default: $DYNGEN_SERVER)"
    gen = sub.add_parser("generate", help="send prompts to the server and print the completions")
    add_request_arguments(gen)
    add_connection_arguments(gen, server, server_help)
    info = sub.add_parser("info", help="print the server's model and engine state (GetModelInfo) as JSON")
    add_connection_arguments(info, server, server_help)
    tok = sub.add_parser("tokenize", help="print the token ids the server makes of a prompt")
    tok.add_argument("prompt")
    tok.add_argument("--chat", action="store_true", help="as one user message in the chat template")
    add_connection_arguments(tok, server, server_help)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        match args.command:
            case "generate":
                return run_generate(args)
            case "info":
                return run_info(args)
            case _:
                return run_tokenize(args)
    except CliError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
