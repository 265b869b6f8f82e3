"""llguidance against xgrammar on this CPU: the numbers behind engine/grammar/constraints.py's choice.

    python -m benchmarks.inprocess.grammar_engines

For each engine, on the shipped model's tokenizer: the one-time tokenizer set-up, the time
to compile each schema, and the time to compute a token mask, walking a valid instance of
each schema token by token (the masks a constrained job needs, one per token). xgrammar is
not a dependency; where it is not importable only llguidance is measured. To measure both,
install it beside the project (it needs apache-tvm-ffi; --no-deps keeps torch as it is):

    pip install --no-deps xgrammar apache-tvm-ffi
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass

import llguidance
import torch

from engine.grammar.constraints import _JSON_LAYOUT, mask_words
from engine.model.shipped_model import default_model_path
from engine.model.tokenizer import HFTokenizer
from kernels.cpu_features import cpu_features

_TEXT = {"type": "string", "maxLength": 40}
# (schema, a valid instance): flat, nested with arrays and enums, and a long-string one.
CASES: dict[str, tuple[dict[str, object], object]] = {
    "flat": (
        {
            "type": "object",
            "properties": {"name": _TEXT, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "age": 36},
    ),
    "nested": (
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "customer": {
                    "type": "object",
                    "properties": {"name": _TEXT, "email": _TEXT, "tier": {"enum": ["free", "pro", "team"]}},
                    "required": ["name", "tier"],
                    "additionalProperties": False,
                },
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"sku": _TEXT, "qty": {"type": "integer", "minimum": 1}},
                        "required": ["sku", "qty"],
                        "additionalProperties": False,
                    },
                    "maxItems": 5,
                },
                "paid": {"type": "boolean"},
            },
            "required": ["id", "customer", "items", "paid"],
            "additionalProperties": False,
        },
        {
            "id": 1042,
            "customer": {"name": "Grace Hopper", "email": "grace@example.com", "tier": "pro"},
            "items": [{"sku": "A-100", "qty": 2}, {"sku": "B-7", "qty": 1}],
            "paid": True,
        },
    ),
    "long string": (
        {
            "type": "object",
            "properties": {"story": {"type": "string"}},
            "required": ["story"],
            "additionalProperties": False,
        },
        {"story": "Once upon a time, " * 12 + "the end."},
    ),
}


@dataclass(frozen=True)
class Measure:
    setup_s: float
    compile_ms: dict[str, float]
    mask_us: dict[str, tuple[float, float, float]]  # per token: median, mean, 95th percentile


def _stats_us(times: list[float]) -> tuple[float, float, float]:
    ordered = sorted(times)
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    return statistics.median(times) * 1e6, statistics.fmean(times) * 1e6, p95 * 1e6


def _instance_tokens(tok: HFTokenizer, instance: object) -> list[int]:
    return tok.encode(json.dumps(instance, separators=(", ", ": ")), add_special_tokens=False)


def measure_llguidance(tok: HFTokenizer, vocab: int) -> Measure:
    t0 = time.perf_counter()
    ll = llguidance.LLTokenizer(tok.backend_json(), n_vocab=vocab, eos_token=sorted(tok.eos_token_ids))
    setup = time.perf_counter() - t0
    compile_ms: dict[str, float] = {}
    mask_us: dict[str, tuple[float, float, float]] = {}
    bitmask = torch.zeros((1, mask_words(vocab)), dtype=torch.int32)
    for name, (schema, instance) in CASES.items():
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_LAYOUT)
        matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
        compile_ms[name] = (time.perf_counter() - t0) * 1e3
        times = []
        for token in _instance_tokens(tok, instance):
            t0 = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)
            times.append(time.perf_counter() - t0)
            if not matcher.consume_token(token):
                raise RuntimeError(f"llguidance refused the {name} instance: {matcher.get_error()}")
        mask_us[name] = _stats_us(times)
    return Measure(setup, compile_ms, mask_us)


def measure_xgrammar(tok: HFTokenizer, vocab: int) -> Measure | None:
    try:
        import tokenizers
        import transformers
        import xgrammar  # type: ignore[import-not-found]
    except ImportError:
        return None
    xgr = xgrammar
    fast = transformers.PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tokenizers.Tokenizer.from_str(tok.backend_json())
    )
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(
        fast, vocab_size=vocab, stop_token_ids=sorted(tok.eos_token_ids)
    )
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - t0
    compile_ms: dict[str, float] = {}
    mask_us: dict[str, tuple[float, float, float]] = {}
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    for name, (schema, instance) in CASES.items():
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(", ", ": ")
        )
        matcher = xgr.GrammarMatcher(compiled)
        compile_ms[name] = (time.perf_counter() - t0) * 1e3
        times = []
        for token in _instance_tokens(tok, instance):
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            times.append(time.perf_counter() - t0)
            if not matcher.accept_token(token):
                raise RuntimeError(f"xgrammar refused the {name} instance")
        mask_us[name] = _stats_us(times)
    return Measure(setup, compile_ms, mask_us)


def main() -> None:
    path = default_model_path()
    tok = HFTokenizer(path)
    vocab = tok.vocab_size
    ll = measure_llguidance(tok, vocab)
    xg = measure_xgrammar(tok, vocab)
    print(f"CPU: {cpu_features().summary()}")
    print(f"tokenizer: {path.name}, {vocab} tokens; one mask is computed per constrained token")
    print()
    print("| | llguidance | xgrammar |")
    print("| --- | ---: | ---: |")
    print(f"| tokenizer set-up s | {ll.setup_s:.2f} | {f'{xg.setup_s:.2f}' if xg else 'not installed'} |")
    for name in CASES:
        x_c = f"{xg.compile_ms[name]:.1f}" if xg else "-"
        print(f"| {name}: compile ms | {ll.compile_ms[name]:.1f} | {x_c} |")
        x_m = "{:.0f} / {:.0f} / {:.0f}".format(*xg.mask_us[name]) if xg else "-"
        print(
            f"| {name}: mask us/token, median / mean / p95 | {'{:.0f} / {:.0f} / {:.0f}'.format(*ll.mask_us[name])} | {x_m} |"
        )


if __name__ == "__main__":
    main()
