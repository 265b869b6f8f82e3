"""Size limits checked at the door, before anything is tokenized or sent to the engine.

Each limit bounds what one request can cost the server (memory, front-end CPU, engine
time per step); a request past one gets INVALID_ARGUMENT naming the field and the limit.
The engine's own checks (token ids within the vocabulary, prompt + max_new_tokens within
the context and the cache, sampling ranges) still apply after these.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from dyngen_client.errors import ErrorReason
from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from engine.errors import InvalidRequestError, PromptTooLongError
from engine.grammar.response_format import MAX_GRAMMAR_CHARS
from engine.jobs import MAX_PRIORITY, JobSpec, SpecLimits, check_fit
from engine.output.loop_detector import LoopStop
from engine.prompt.guidance import MAX_GUIDANCE_SCALE
from engine.prompt.prompt_embeddings import (
    FLOAT32_BYTES,
    MAX_EMBEDDING_ROWS,
    MAX_PROMPT_EMBEDDINGS,
    check_embeddings,
    place_embeddings,
)
from service.embeddings import embedding_placements

_JOB_ID = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class Limits:
    max_prompt_chars: int = 1 << 20  # text, or the chat's contents added up, before tokenizing
    max_prompt_tokens: int = 1 << 20  # token_ids prompts (the context is the tighter bound)
    max_chat_messages: int = 1024
    max_role_chars: int = 64
    max_identifier_chars: int = 256
    max_cache_salt_chars: int = 256
    max_response_format_chars: int = MAX_GRAMMAR_CHARS  # a schema, regex or grammar (the engine's bound)
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 256
    max_banned_strings: int = 64
    max_banned_string_chars: int = 256
    max_logit_bias: int = 1024
    max_banned_token_ids: int = 4096


class RequestError(Exception):
    """A request breaks a limit or is malformed; the message names the field (INVALID_ARGUMENT).

    `field` is the request path to blame (a BadRequest field violation), `reason` the ErrorInfo
    reason: LIMIT_EXCEEDED past a limit, INVALID_ARGUMENT for a value that can never be right.
    """

    def __init__(
        self, message: str, field: str | None = None, reason: ErrorReason = ErrorReason.INVALID_ARGUMENT
    ) -> None:
        super().__init__(message)
        self.field = field
        self.reason = reason


def _limit(count: int, most: int, field: str, what: str) -> None:
    if count > most:
        raise RequestError(
            f"{field} {what}: {count} exceeds the limit of {most}", field, ErrorReason.LIMIT_EXCEEDED
        )


def check_job_id(job_id: str) -> None:
    """Job ids are 32 lowercase hex characters; anything else can never name a job."""
    if not _JOB_ID.fullmatch(job_id):
        shown = job_id[:40] + ("..." if len(job_id) > 40 else "")
        raise RequestError(f"job_id must be 32 lowercase hex characters, got {shown!r}", "job_id")


# A LoRA adapter's name as callers give it (the engine's own names may add a tenant scope, "~...").
ADAPTER_NAME = re.compile(r"[0-9A-Za-z_.-]{1,48}")


def check_adapter_name(name: str, field: str) -> None:
    if not ADAPTER_NAME.fullmatch(name):
        raise RequestError(f"{field}: an adapter name is 1 to 48 characters of [0-9A-Za-z_.-]", field)


def check_request(req: pb.GenerateRequest, limits: Limits) -> None:
    """Raise RequestError for the first limit `req` breaks."""
    _limit(len(req.identifier), limits.max_identifier_chars, "identifier", "length")
    if req.adapter:
        check_adapter_name(req.adapter, "adapter")
    if req.HasField("stop_on_loop"):
        loop = req.stop_on_loop
        problem = LoopStop(loop.window, loop.min_repetitions).problem()
        if problem is not None:
            field = "stop_on_loop.window" if "window" in problem else "stop_on_loop.min_repetitions"
            raise RequestError(problem, field)
    if not -MAX_PRIORITY <= req.priority <= MAX_PRIORITY:
        raise RequestError(
            f"priority must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {req.priority}", "priority"
        )
    if req.HasField("guidance"):
        check_guidance(req.guidance, limits)
    if req.embeddings:
        check_embedding_spans(req)
    _limit(len(req.cache_salt), limits.max_cache_salt_chars, "cache_salt", "length")
    if req.HasField("response_format"):
        which = req.response_format.WhichOneof("format")
        if which is None:
            raise RequestError(
                "response_format: set one of json_schema, regex, lark_grammar or gbnf_grammar",
                "response_format",
            )
        source = getattr(req.response_format, which)
        _limit(len(source), limits.max_response_format_chars, f"response_format.{which}", "length")
    _limit(len(req.stop_strings), limits.max_stop_strings, "stop_strings", "count")
    for i, stop in enumerate(req.stop_strings):
        _limit(len(stop), limits.max_stop_string_chars, f"stop_strings[{i}]", "length")
    _limit(len(req.banned_strings), limits.max_banned_strings, "banned_strings", "count")
    for i, ban in enumerate(req.banned_strings):
        _limit(len(ban), limits.max_banned_string_chars, f"banned_strings[{i}]", "length")
    _limit(len(req.stop_token_ids), limits.max_stop_token_ids, "stop_token_ids", "count")
    _limit(len(req.sampling.logit_bias), limits.max_logit_bias, "sampling.logit_bias", "count")
    _limit(
        len(req.sampling.banned_token_ids), limits.max_banned_token_ids, "sampling.banned_token_ids", "count"
    )
    _check_prompt_size(req, req.WhichOneof("prompt"), "prompt", limits)


def _check_prompt_size(
    source: pb.GenerateRequest | pb.Guidance, which: str | None, field: str, limits: Limits, prefix: str = ""
) -> None:
    """A prompt oneof's size limits (text, chat or token_ids, `which` being the set one); `field`
    names the oneof, `prefix` where `source` sits in the request."""
    match which:
        case "text":
            _limit(len(source.text), limits.max_prompt_chars, prefix + "text", "length")
        case "chat":
            check_chat(source.chat, limits, prefix)
        case "token_ids":
            _limit(len(source.token_ids.ids), limits.max_prompt_tokens, prefix + "token_ids.ids", "count")
        case _:
            raise RequestError(f"{field}: set one of text, chat or token_ids", field)


NEGATIVE_PROMPT = "guidance.negative_prompt"  # the field to blame for a missing or empty negative prompt


def check_guidance(guidance: pb.Guidance, limits: Limits) -> None:
    """The guidance settings' limits before tokenizing: the scale's range, the negative prompt's
    size as the prompt's (its token count against the context: `check_negative_prompt_ids`)."""
    if not guidance.HasField("scale"):
        raise RequestError("guidance.scale must be set (1 = no effect; 1.5 to 3 is usual)", "guidance.scale")
    if not (math.isfinite(guidance.scale) and 0.0 <= guidance.scale <= MAX_GUIDANCE_SCALE):
        raise RequestError(
            f"guidance.scale must be finite and in [0, {MAX_GUIDANCE_SCALE:g}], got {guidance.scale:g}",
            "guidance.scale",
        )
    which = guidance.WhichOneof("negative_prompt")
    if which == "text" and not guidance.text:
        raise RequestError(f"{NEGATIVE_PROMPT} must not be empty", NEGATIVE_PROMPT)
    if which == "token_ids" and not guidance.token_ids.ids:
        raise RequestError(f"{NEGATIVE_PROMPT} must hold at least one token", NEGATIVE_PROMPT)
    _check_prompt_size(guidance, which, NEGATIVE_PROMPT, limits, "guidance.")


@dataclass(frozen=True)
class ModelBounds:
    """What the engine said of its model when it became ready, for the checks made after tokenizing."""

    vocab_size: int  # token ids are below this
    context_length: int  # prompt + max_new_tokens of one sequence, in tokens
    cache_tokens: int  # the whole KV cache, in tokens
    hidden_size: int  # a prompt embedding row holds this many float32 values
    page_size: int = 1  # the cache's page size in tokens (a job's fit is counted in pages)

    @property
    def request_tokens(self) -> int:
        """The most one request may hold, prompt and output: the context, or the cache if smaller."""
        return min(self.context_length, self.cache_tokens)

    @property
    def limits(self) -> SpecLimits:
        """The engine's own limits: the one rule a job is checked by, on both sides of the pipe."""
        return SpecLimits(
            self.vocab_size,
            self.hidden_size,
            self.context_length,
            self.cache_tokens // self.page_size,
            self.page_size,
        )


def check_negative_prompt_ids(ids: Sequence[int], max_new_tokens: int, bounds: ModelBounds) -> None:
    """The tokenized negative prompt, as the engine checks the prompt: at least one token, every id
    in the vocabulary, and with max_new_tokens within the context and the cache (PROMPT_TOO_LONG)."""
    if not ids:
        raise RequestError(f"{NEGATIVE_PROMPT} must make at least one token", NEGATIVE_PROMPT)
    bad = next((t for t in ids if not 0 <= t < bounds.vocab_size), None)
    if bad is not None:
        raise RequestError(
            f"guidance.token_ids.ids: token id {bad} is not below the vocabulary size {bounds.vocab_size}",
            "guidance.token_ids.ids",
        )
    try:  # on its own, by the one rule (with the prompt, the job's check_spec decides)
        check_fit(JobSpec(tuple(ids), max_new_tokens), bounds.limits)
    except PromptTooLongError as exc:
        raise RequestError(f"{NEGATIVE_PROMPT}: {exc}", NEGATIVE_PROMPT, ErrorReason.PROMPT_TOO_LONG) from exc


def check_embedding_spans(req: pb.GenerateRequest) -> None:
    """The prompt embeddings' limits before tokenizing: how many spans and rows, each span's rows
    and placement, one way of placing them all, and no token healing with them."""
    _limit(len(req.embeddings), MAX_PROMPT_EMBEDDINGS, "embeddings", "count")
    ways: set[str] = set()
    for i, e in enumerate(req.embeddings):
        if e.rows < 1:
            raise RequestError(f"embeddings[{i}].rows must be >= 1, got {e.rows}", f"embeddings[{i}].rows")
        which = e.WhichOneof("placement")
        if which is None:
            raise RequestError(
                f"embeddings[{i}]: set one of position and placeholder_token_id", f"embeddings[{i}].placement"
            )
        ways.add(which)
    _limit(sum(e.rows for e in req.embeddings), MAX_EMBEDDING_ROWS, "embeddings", "rows in all")
    if len(ways) > 1:
        raise RequestError(
            "embeddings: place every span by position or every span by placeholder_token_id, not both",
            "embeddings",
        )
    if req.token_healing:
        raise RequestError(
            "token_healing cannot be combined with embeddings (it takes back the prompt's last tokens)",
            "token_healing",
        )


def check_prompt_embeddings(
    req: pb.GenerateRequest, ids: Sequence[int], max_new_tokens: int, bounds: ModelBounds
) -> None:
    """The prompt embeddings against the tokenized prompt, as the engine places them: each span's
    data exactly rows x hidden_size float32 values, inside the prompt, no overlaps, a placeholder
    occurrence for every span, and the prompt they expand within the context and the cache with
    max_new_tokens (PROMPT_TOO_LONG; a prompt too long before expanding is left to the engine)."""
    for i, e in enumerate(req.embeddings):
        want = e.rows * bounds.hidden_size * FLOAT32_BYTES
        if len(e.data) != want:
            raise RequestError(
                f"embeddings[{i}].data: {len(e.data)} bytes, but rows {e.rows} x the model's hidden size "
                f"{bounds.hidden_size} x 4 bytes (float32) = {want} bytes",
                f"embeddings[{i}].data",
            )
    try:
        expanded, spans = place_embeddings(ids, embedding_placements(req))
        check_embeddings(spans, len(expanded), bounds.hidden_size)
    except InvalidRequestError as exc:
        raise RequestError(str(exc), exc.field or "embeddings") from exc
    try:  # the one rule, on the prompt before and after its expansion
        check_fit(JobSpec(tuple(ids), max_new_tokens), bounds.limits)
    except PromptTooLongError:
        return  # too long before expanding: the job's own check says so
    try:
        check_fit(JobSpec(tuple(expanded), max_new_tokens), bounds.limits)
    except PromptTooLongError as exc:
        raise RequestError(
            f"embeddings: the prompt of {len(ids)} tokens expands to {len(expanded)} at its placeholders; {exc}",
            "embeddings",
            ErrorReason.PROMPT_TOO_LONG,
        ) from exc


def request_field(field: str | None, request: pb.GenerateRequest | None) -> str | None:
    """The request path a BadRequest names for the JobSpec field an InvalidRequestError (or the
    engine's Rejection) blames: the prompt's ids are whichever prompt the request sent, a
    response_format its one format; every other path is the request's own."""
    if field is None or request is None:
        return field
    if field == "prompt_ids":
        return request.WhichOneof("prompt") or "prompt"
    if field == "response_format":
        which = request.response_format.WhichOneof("format")
        return f"response_format.{which}" if which else field
    return field


def check_spec(spec: JobSpec, bounds: ModelBounds, request: pb.GenerateRequest | None = None) -> None:
    """The job the front end built, by the engine's own rule (JobSpec.check: values, embeddings,
    the fit of every sequence in the context and of all their pages in the cache): the engine then
    checks only what needs the engine (the adapter is loaded, the queue has room)."""
    try:
        spec.check(bounds.limits)
    except PromptTooLongError as exc:
        raise RequestError(str(exc), None, ErrorReason.PROMPT_TOO_LONG) from exc
    except InvalidRequestError as exc:
        raise RequestError(str(exc), request_field(exc.field, request)) from exc


def check_chat(chat: pb.ChatPrompt, limits: Limits, prefix: str = "") -> None:
    """A chat prompt's limits; `prefix` is where it sits in the request ("guidance." for a negative one)."""
    field = f"{prefix}chat.messages"
    if not chat.messages:
        raise RequestError(f"{field} must hold at least one message", field)
    _limit(len(chat.messages), limits.max_chat_messages, field, "count")
    total = 0
    for i, m in enumerate(chat.messages):
        _limit(len(m.role), limits.max_role_chars, f"{field}[{i}].role", "length")
        total += len(m.content)
    _limit(total, limits.max_prompt_chars, field, "contents length")


def check_tokenize_request(req: pb.TokenizeRequest, limits: Limits) -> None:
    match req.WhichOneof("prompt"):
        case "text":
            _limit(len(req.text), limits.max_prompt_chars, "text", "length")
        case "chat":
            check_chat(req.chat, limits)
        case _:
            raise RequestError("prompt: set one of text or chat", "prompt")
