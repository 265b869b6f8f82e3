"""The `dyngen` command line.

`dyngen generate` runs the model in-process: one prompt, or a JSON-lines file of
prompts run together in batches. Errors dyngen raises on purpose are printed as one
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

from engine.errors import DyngenError, InvalidRequestError

DEFAULT_PAGE_SIZE = 256
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
    gen.add_argument("--seed", type=int, default=None, help="seed for sampling (temperature > 0)")
    gen.add_argument(
        "--ignore-eos", action="store_true", help="do not stop at the model's end-of-sequence token"
    )
    gen.add_argument(
        "--model", type=Path, default=None, help=".gguf file or Hugging Face folder (default: shipped)"
    )
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    gen.add_argument(
        "--page-size", type=_positive, default=DEFAULT_PAGE_SIZE, help="KV cache page size in tokens"
    )
    gen.add_argument(
        "--cache-tokens", type=_positive, default=DEFAULT_CACHE_TOKENS, help="KV cache size in tokens"
    )
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    gen.add_argument("--quiet", action="store_true", help="no progress bar while loading")
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


def run_generate(args: argparse.Namespace) -> int:
    # Heavy imports after argument parsing, so `dyngen --help` and usage errors are instant.
    from engine.batch_generate import GenerationSettings, generate_batch
    from engine.model.loader import WeightDtype, load_model
    from engine.model.tokenizer import ChatMessage

    if (args.prompt is None) == (args.prompts_file is None):
        raise InvalidRequestError("give exactly one of PROMPT or --prompts-file")
    texts = (
        [args.prompt] if args.prompts_file is None else [p.text for p in read_prompts_file(args.prompts_file)]
    )
    settings = GenerationSettings(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    loaded = load_model(args.model, WeightDtype(args.dtype), progress=not args.quiet)
    tok = loaded.tokenizer
    prompts = [tok.encode_chat([ChatMessage("user", t)]) if args.chat else tok.encode(t) for t in texts]
    num_pages = max(1, args.cache_tokens // args.page_size)
    cache = loaded.model.new_cache(num_pages, args.page_size)
    completions = generate_batch(loaded.model, cache, prompts, settings)
    as_json = args.json or args.prompts_file is not None
    for c in completions:
        text = tok.decode(c.token_ids, skip_special_tokens=True)
        if as_json:
            record = {
                "text": text,
                "token_ids": list(c.token_ids),
                "stop_reason": c.stop_reason.value,
                "prompt_tokens": len(c.prompt_ids),
                "new_tokens": len(c.token_ids),
                "prefill_seconds": round(c.prefill_seconds, 4),
                "decode_seconds": round(c.decode_seconds, 4),
                "decode_tokens_per_second": round(c.decode_tokens_per_second, 2),
            }
            print(json.dumps(record, ensure_ascii=False))
        else:
            print(text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        return run_generate(args)
    except DyngenError as exc:
        print(f"dyngen: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
