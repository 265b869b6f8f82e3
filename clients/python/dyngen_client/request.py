"""What a caller asks for, as typed values: `Request` (a prompt, sampling, stops) -> GenerateRequest."""

from __future__ import annotations

import json
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from dyngen_client.ranges import check_fields, check_integers


@dataclass(frozen=True)
class Chat:
    """A prompt as chat messages (role, content), rendered with the model's template."""

    messages: tuple[tuple[str, str], ...]

    @staticmethod
    def user(text: str) -> Chat:
        return Chat((("user", text),))


Prompt = str | Chat | Sequence[int]  # plain text, chat messages, or token ids


@dataclass(frozen=True)
class Sampling:
    """Sampling settings; None leaves a setting to the server's default (greedy, filters off)."""

    temperature: float | None = None  # 0 = greedy
    top_k: int | None = None  # 0 = off
    top_p: float | None = None  # 1 = off
    min_p: float | None = None  # 0 = off
    typical: float | None = None  # 1 = off
    repetition_penalty: float | None = None  # 1 = off
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    banned_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_fields(self, pb.SamplingSettings.DESCRIPTOR, "sampling.")
        for i, (token, _) in enumerate(self.logit_bias):
            check_integers({"token_id": token}, pb.LogitBias.DESCRIPTOR, f"sampling.logit_bias[{i}].")

    def to_proto(self) -> pb.SamplingSettings:
        s = pb.SamplingSettings(
            logit_bias=[pb.LogitBias(token_id=t, bias=b) for t, b in self.logit_bias],
            banned_token_ids=self.banned_token_ids,
        )
        # Only the settings given are set: proto3 `optional` keeps "unset" apart from 0.
        if self.temperature is not None:
            s.temperature = self.temperature
        if self.top_k is not None:
            s.top_k = self.top_k
        if self.top_p is not None:
            s.top_p = self.top_p
        if self.min_p is not None:
            s.min_p = self.min_p
        if self.typical is not None:
            s.typical = self.typical
        if self.repetition_penalty is not None:
            s.repetition_penalty = self.repetition_penalty
        if self.frequency_penalty is not None:
            s.frequency_penalty = self.frequency_penalty
        if self.presence_penalty is not None:
            s.presence_penalty = self.presence_penalty
        if self.seed is not None:
            s.seed = self.seed
        return s


@dataclass(frozen=True)
class JsonSchema:
    """Structured output: the text is one JSON value of this schema (a dict, or its JSON text)."""

    schema: Mapping[str, object] | str


@dataclass(frozen=True)
class Regex:
    """Structured output: the whole text matches this regular expression."""

    pattern: str


@dataclass(frozen=True)
class LarkGrammar:
    """Structured output: the text is a sentence of this Lark grammar (`start` is the root rule)."""

    grammar: str


@dataclass(frozen=True)
class GbnfGrammar:
    """Structured output: the text is a sentence of this GBNF grammar (`root` is the root rule)."""

    grammar: str


ResponseFormat = JsonSchema | Regex | LarkGrammar | GbnfGrammar

DEFAULT_GUIDANCE_SCALE = 1.5  # both CLIs' --guidance-scale (the wire has none: scale is required)


@dataclass(frozen=True)
class Guidance:
    """Classifier-free guidance: the job is pushed away from `negative_prompt` (text, chat messages
    or token ids, tokenized by the server like the prompt). `scale` is finite, in [0, 100]: 1 = no
    effect, 0 = the negative prompt alone, above 1 = further from it."""

    scale: float
    negative_prompt: Prompt

    def to_proto(self) -> pb.Guidance:
        g = pb.Guidance(scale=self.scale)
        match self.negative_prompt:
            case str():
                g.text = self.negative_prompt
            case Chat():
                g.chat.CopyFrom(chat_proto(self.negative_prompt))
            case _:
                g.token_ids.ids.extend(self.negative_prompt)
        return g


@dataclass(frozen=True)
class PromptEmbedding:
    """Vectors the model reads instead of the token embeddings of a span of the prompt (an image
    encoder's outputs, say). Each row holds the model's hidden size (ModelInfo.hidden_size) of
    float32 values. `vectors` is a sequence of rows of floats, or the rows already packed as float32,
    little-endian, row-major bytes (`array.astype("<f4").tobytes()`), with `rows` saying how many.

    Exactly one placement: `position`, the first prompt token (0-based, in the prompt as tokenized)
    whose embeddings the rows replace; or `placeholder_token_id`, a token of the prompt that is
    expanded to the rows (each span takes that token's next occurrence no earlier span took). All
    spans of one request are placed the same way.
    """

    vectors: Sequence[Sequence[float]] | bytes = field(repr=False)
    position: int | None = None
    placeholder_token_id: int | None = None
    rows: int | None = None  # how many rows `vectors` holds: required with bytes, checked with floats

    def __post_init__(self) -> None:
        check_integers(
            {"position": self.position, "placeholder_token_id": self.placeholder_token_id, "rows": self.rows},
            pb.PromptEmbedding.DESCRIPTOR,
            "PromptEmbedding.",
        )
        if (self.position is None) == (self.placeholder_token_id is None):
            raise ValueError("PromptEmbedding: give exactly one of position and placeholder_token_id")
        if isinstance(self.vectors, bytes):
            if self.rows is None:
                raise ValueError(
                    "PromptEmbedding: packed float32 vectors need rows (how many rows they hold)"
                )
        elif self.rows is not None and self.rows != len(self.vectors):
            raise ValueError(f"PromptEmbedding: rows={self.rows}, but vectors has {len(self.vectors)} rows")

    def data(self) -> bytes:
        """The rows as the wire carries them: float32, little-endian, row-major."""
        if isinstance(self.vectors, bytes):
            return self.vectors
        widths = {len(row) for row in self.vectors}
        if len(widths) > 1:
            raise ValueError(f"PromptEmbedding: rows of different widths {sorted(widths)}")
        packed = array("f", (float(x) for row in self.vectors for x in row))
        if sys.byteorder == "big":
            packed.byteswap()
        return packed.tobytes()

    def to_proto(self) -> pb.PromptEmbedding:
        rows = self.rows if self.rows is not None else len(self.vectors)
        e = pb.PromptEmbedding(data=self.data(), rows=rows)
        if self.position is not None:
            e.position = self.position
        if self.placeholder_token_id is not None:
            e.placeholder_token_id = self.placeholder_token_id
        return e


@dataclass(frozen=True)
class Request:
    prompt: Prompt
    max_new_tokens: int | None = None  # None: the server's default (256)
    sampling: Sampling = field(default_factory=Sampling)
    min_new_tokens: int = 0
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    decode_special_tokens: bool = False
    return_logprobs: bool = False
    top_logprobs: int = 0
    identifier: str = ""  # echoed in every event
    cache_salt: str = ""  # prefix-cache isolation: share cached prompt pages only within one salt
    response_format: ResponseFormat | None = None  # None: free text
    banned_strings: tuple[str, ...] = ()  # never in the text: generation rewinds past them
    token_healing: bool = False  # a prompt cut mid-word continues the word (not with response_format)
    adapter: str = ""  # a loaded LoRA adapter's name (ListAdapters); "" = the base model
    # (window, min_repetitions): stop (STOP_REASON_LOOP) once the output ends with a pattern of up
    # to `window` tokens repeated `min_repetitions` times; None = never.
    stop_on_loop: tuple[int, int] | None = None
    # Scheduling priority in [-1000, 1000], higher first; a waiting job preempts running jobs of
    # lower priority when the engine is full. With authentication on, the server caps a tenant's
    # jobs above 0 (--max-priority-jobs).
    priority: int = 0
    guidance: Guidance | None = None  # classifier-free guidance against a negative prompt; None = off
    # Vectors fed instead of the token embeddings of spans of the prompt; () = none.
    embeddings: tuple[PromptEmbedding, ...] = ()

    def __post_init__(self) -> None:
        check_fields(self, pb.GenerateRequest.DESCRIPTOR)
        if not isinstance(self.prompt, str | Chat):
            check_integers({"ids": tuple(self.prompt)}, pb.TokenIds.DESCRIPTOR, "token_ids.")
        if self.stop_on_loop is not None:
            window, repetitions = self.stop_on_loop
            check_integers(
                {"window": window, "min_repetitions": repetitions}, pb.LoopStop.DESCRIPTOR, "stop_on_loop."
            )

    def to_proto(self) -> pb.GenerateRequest:
        req = pb.GenerateRequest(
            sampling=self.sampling.to_proto(),
            min_new_tokens=self.min_new_tokens,
            stop_strings=self.stop_strings,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            decode_special_tokens=self.decode_special_tokens,
            return_logprobs=self.return_logprobs,
            top_logprobs=self.top_logprobs,
            identifier=self.identifier,
            cache_salt=self.cache_salt,
            banned_strings=self.banned_strings,
            token_healing=self.token_healing,
            adapter=self.adapter,
            priority=self.priority,
            embeddings=[e.to_proto() for e in self.embeddings],
        )
        if self.guidance is not None:
            req.guidance.CopyFrom(self.guidance.to_proto())
        if self.max_new_tokens is not None:
            req.max_new_tokens = self.max_new_tokens
        if self.stop_on_loop is not None:
            req.stop_on_loop.window, req.stop_on_loop.min_repetitions = self.stop_on_loop
        match self.response_format:
            case JsonSchema(schema=str() as text):
                req.response_format.json_schema = text
            case JsonSchema(schema=schema):
                req.response_format.json_schema = json.dumps(schema)
            case Regex(pattern=pattern):
                req.response_format.regex = pattern
            case LarkGrammar(grammar=grammar):
                req.response_format.lark_grammar = grammar
            case GbnfGrammar(grammar=grammar):
                req.response_format.gbnf_grammar = grammar
            case None:
                pass
        match self.prompt:
            case str():
                req.text = self.prompt
            case Chat():
                req.chat.CopyFrom(chat_proto(self.prompt))
            case _:
                req.token_ids.ids.extend(self.prompt)
        return req


def chat_proto(chat: Chat) -> pb.ChatPrompt:
    return pb.ChatPrompt(messages=[pb.ChatMessage(role=r, content=c) for r, c in chat.messages])


def tokenize_request(prompt: str | Chat) -> pb.TokenizeRequest:
    if isinstance(prompt, str):
        return pb.TokenizeRequest(text=prompt)
    return pb.TokenizeRequest(chat=chat_proto(prompt))
