"""Constrained decoding: a job's output held to a JSON schema, a regex or a Lark grammar.

The grammar engine is llguidance (Rust, GIL released while it works): per job a matcher
that, given the tokens so far, yields the set of tokens that keep the output inside the
grammar, as a bitmask of the vocabulary (bit t of word t // 32 set = token t allowed).
Chosen over xgrammar 0.2.8 by `python -m benchmarks.inprocess.grammar_engines` on this CPU (shipped
tokenizer, 49,152 tokens): llguidance compiles a JSON schema in about 1 ms, xgrammar in about
220 ms. Each request may bring a new schema, and compiling runs at enqueue. xgrammar's masks
are faster (mean 21-37 us per token against llguidance's 30-139 us), but a mask is a fraction
of a millisecond beside a forward of about 100 ms. llguidance also has no torch or compiler
dependency. Masks are computed on the worker thread: while the forward runs when a core is
free for it, just before the forward when not (MaskOverlap).

Compiled grammars are cached by content: a job takes a copy of the cached matcher (a
deep copy costs microseconds; compiling costs a millisecond or more).
"""

from __future__ import annotations

import enum
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

import llguidance
import torch
from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

from engine.errors import InvalidRequestError
from engine.grammar.response_format import GrammarKind, ResponseFormat

# GrammarKind and ResponseFormat live in engine/grammar/response_format.py (no llguidance, no torch);
# they are exported from here too, beside the compiler that takes them.
__all__ = [
    "Constraint",
    "GrammarCompiler",
    "GrammarKind",
    "MaskOverlap",
    "MaskWorker",
    "ResponseFormat",
    "TokenizerJson",
    "allowed_tokens",
    "mask_words",
    "token_bitmask",
]

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# JSON output on one line, ", " and ": " between items: free whitespace lets a sampled job
# spend its whole budget on newlines and never close the value.
_JSON_LAYOUT: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
_CACHED_GRAMMARS = 256


class TokenizerJson(Protocol):
    """What the grammar engine needs of a tokenizer: its tokenizers-library JSON and EOS ids."""

    def backend_json(self) -> str: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...


def mask_words(vocab_size: int) -> int:
    """int32 words of a vocabulary bitmask."""
    return (vocab_size + 31) // 32


class Constraint:
    """One job's grammar state: the allowed next tokens, and the tokens it has taken."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of a contiguous int32 [rows, words] bitmask.

        Straight into the tensor's memory. (Not through llguidance.torch: importing it runs a
        torch.compile decorator, which imports Triton before the tests can ask for its interpreter.)
        """
        if bitmask.dtype != torch.int32 or not bitmask.is_contiguous() or bitmask.device.type != "cpu":
            raise ValueError("a token bitmask is a contiguous int32 CPU tensor")
        target = bitmask[row]
        self._m.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())

    def accept(self, token: int) -> None:
        """Advance past a sampled token; a token the mask did not allow is an engine bug."""
        if not self._m.consume_token(token):
            raise RuntimeError(f"the grammar rejected token {token}: {self._m.get_error()}")

    def try_accept(self, token: int) -> bool:
        """Advance past `token` if the grammar allows it; False (and no change) if not."""
        return bool(self._m.try_consume_tokens([token]) == 1)

    def rollback(self, tokens: int) -> None:
        """Take back the last `tokens` accepted tokens (a banned string's rewind)."""
        if tokens and not self._m.rollback(tokens):
            raise RuntimeError(f"the grammar could not take back {tokens} tokens: {self._m.get_error()}")

    @property
    def complete(self) -> bool:
        """The output is a whole sentence of the grammar and nothing may follow."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str | None:
        return str(self._m.get_error()) if self._m.is_error() else None


class GrammarCompiler:
    """Compiles response formats for one tokenizer and vocabulary, caching them by content."""

    def __init__(self, tokenizer: TokenizerJson, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._ll: llguidance.LLTokenizer | None = None  # built on first use (~0.7 s)
        self._cache: OrderedDict[ResponseFormat, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()  # enqueue may run on several threads

    @property
    def cached(self) -> int:
        """Compiled grammars held."""
        return len(self._cache)

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll is None:
            eos = sorted(self._tokenizer.eos_token_ids)
            self._ll = llguidance.LLTokenizer(
                self._tokenizer.backend_json(), n_vocab=self.vocab_size, eos_token=eos if eos else None
            )
        return self._ll

    def compile(self, fmt: ResponseFormat) -> Constraint:
        """A fresh constraint for `fmt`; InvalidRequestError with the compiler's message if it is bad."""
        fmt.validate()
        with self._lock:
            template = self._cache.get(fmt)
            if template is not None:
                self._cache.move_to_end(fmt)
            else:
                template = self._build(fmt)
                self._cache[fmt] = template
                if len(self._cache) > _CACHED_GRAMMARS:
                    self._cache.popitem(last=False)
            return Constraint(template.deep_copy())

    def _build(self, fmt: ResponseFormat) -> llguidance.LLMatcher:
        tokenizer = self.ll_tokenizer()
        try:
            match fmt.kind:
                case GrammarKind.JSON_SCHEMA:
                    grammar = llguidance.LLMatcher.grammar_from_json_schema(
                        _schema_object(fmt.source), defaults=_JSON_LAYOUT
                    )
                case GrammarKind.REGEX:
                    grammar = llguidance.LLMatcher.grammar_from_regex(fmt.source)
                case GrammarKind.LARK:
                    grammar = llguidance.LLMatcher.grammar_from_lark(fmt.source)
                case GrammarKind.GBNF:
                    grammar = llguidance.LLMatcher.grammar_from_lark(_gbnf_as_lark(fmt.source))
        except (ValueError, TypeError, GbnfToLarkError) as exc:
            raise InvalidRequestError(
                f"response_format: invalid {fmt.kind.value}: {exc}", "response_format"
            ) from exc
        problem = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if problem:
            raise InvalidRequestError(
                f"response_format: invalid {fmt.kind.value}: {problem}", "response_format"
            )
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(
                f"response_format: invalid {fmt.kind.value}: {matcher.get_error()}", "response_format"
            )
        return matcher


def _schema_object(source: str) -> str:
    """The schema as the compiler takes it: an object. JSON Schema also allows the booleans
    (`true` admits every value, `false` none), which the compiler does not take."""
    schema = json.loads(source)  # a clear message for text that is not JSON at all
    if schema is True:
        return "{}"
    if schema is False:
        raise ValueError("the schema `false` admits no value")
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema is an object or a boolean, not {type(schema).__name__}")
    return source


def _gbnf_as_lark(source: str) -> str:
    """GBNF rewritten as Lark. The converter reports some faults (a rule used but never defined, no
    `root` rule) as bare Exceptions: they are the grammar's faults all the same."""
    try:
        return gbnf_to_lark(source)
    except GbnfToLarkError:
        raise
    except Exception as exc:  # a bare Exception: see above
        raise ValueError(str(exc)) from exc


class MaskOverlap(enum.Enum):
    """Whether the mask worker runs beside the forward or just before it.

    Beside it is free only with a core to spare: on a CPU whose cores all run the forward's
    threads, the worker's thread takes turns with them and stalls the forward at its next
    barrier. Measured on 2 cores with 2 torch threads (W1, 32 of 64 jobs constrained): masks
    beside the forward cost it 3 ms per step, the same masks before it cost 0.6 ms.
    """

    AUTO = "auto"  # beside the forward if a core is left over for the worker, else before it
    BESIDE = "beside"
    BEFORE = "before"

    def resolve(self) -> MaskOverlap:
        if self is not MaskOverlap.AUTO:
            return self
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return MaskOverlap.BESIDE if cores > torch.get_num_threads() else MaskOverlap.BEFORE


class MaskWorker:
    """Computes constrained jobs' token masks on a worker thread while the forward runs."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dyngen-masks")

    def start(self, constraints: Sequence[Constraint]) -> Future[torch.Tensor]:
        """An int32 [len(constraints), words] bitmask, row i for constraints[i], computed in the background."""
        return self._pool.submit(self._fill, list(constraints))

    def _fill(self, constraints: list[Constraint]) -> torch.Tensor:
        return token_bitmask(constraints, self.vocab_size)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def token_bitmask(constraints: Sequence[Constraint], vocab_size: int) -> torch.Tensor:
    """int32 [len(constraints), words]: row i holds the next tokens constraints[i] allows now."""
    bitmask = torch.zeros((len(constraints), mask_words(vocab_size)), dtype=torch.int32)
    for i, c in enumerate(constraints):
        c.fill(bitmask, i)
    return bitmask


def allowed_tokens(bitmask_row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [vocab_size] from one int32 bitmask row."""
    bits = (bitmask_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1)[:vocab_size].bool()
