"""What a job asks for (JobSpec), what it reports (JobEvent), and why it stopped.

Plain frozen dataclasses: they cross thread and process boundaries as values and
know nothing of gRPC or tensors.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from engine.errors import ErrorKind, InvalidRequestError, PromptTooLongError
from engine.grammar.response_format import ResponseFormat
from engine.ids import JobId, new_job_id
from engine.output.loop_detector import LoopStop
from engine.prompt.guidance import Guidance
from engine.prompt.prompt_embeddings import PromptEmbedding, check_embeddings

# JobId and new_job_id live in engine/ids.py (the front end needs them without the engine);
# they are exported from here too, beside the events that carry them.
__all__ = [
    "MAX_CACHE_SALT_CHARS",
    "MAX_PRIORITY",
    "JobError",
    "JobEvent",
    "JobFinished",
    "JobId",
    "JobSpec",
    "JobStage",
    "JobStarted",
    "JobTimings",
    "PrefillProgress",
    "SamplingSettings",
    "StopReason",
    "TokenLogprob",
    "TokensGenerated",
    "new_job_id",
]

MAX_CACHE_SALT_CHARS = 256
MAX_TENANT_CHARS = 256  # a tenant's name, from the server's tokens file
MAX_PRIORITY = 1000  # |priority| limit: enough levels for any policy, small enough to log


class StopReason(enum.Enum):
    EOS = "eos"  # the model emitted one of its end-of-sequence tokens
    STOP_TOKEN = "stop_token"  # one of the job's stop token ids
    STOP_STRING = "stop_string"  # one of the job's stop strings appeared in the text
    MAX_NEW_TOKENS = "max_new_tokens"
    CANCELLED = "cancelled"
    ERROR = "error"  # the engine failed this job (JobFinished.error says why); other jobs went on
    GRAMMAR = "grammar"  # the output is complete under the job's response_format (no token may follow)
    LOOP = "loop"  # the output ends with one pattern repeated (JobSpec.stop_on_loop)


class JobStage(enum.Enum):
    QUEUED = "queued"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


def _strings(value: object) -> bool:
    """A sequence of strings, and not one string (which is a sequence of its characters)."""
    return isinstance(value, tuple | list) and all(isinstance(s, str) for s in value)


def _check(ok: bool, message: str, field: str | None) -> None:
    if not ok:
        raise InvalidRequestError(message, field)


@dataclass(frozen=True)
class SamplingSettings:
    """Per-job sampling. temperature 0 is greedy: penalties, bias and bans still apply, while
    top_k / top_p / typical / min_p only shape sampled (temperature > 0) rows."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    typical: float = 1.0  # 1 = off
    repetition_penalty: float = 1.0  # 1 = off; >1 discourages tokens already in prompt or output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    presence_penalty: float = 0.0  # subtracted once if present in the output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    banned_token_ids: frozenset[int] = frozenset()
    # Draws keyed by (seed, output position): the same tokens beside any batch where the model's
    # steps are row-invariant (LlamaModel.row_invariant: quantized linears on the CPU).
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequestError naming the field and its limit."""
        _check(
            math.isfinite(self.temperature) and self.temperature >= 0,
            "temperature must be finite and >= 0",
            "sampling.temperature",
        )
        _check(self.top_k >= 0, "top_k must be >= 0 (0 = off)", "sampling.top_k")
        _check(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]", "sampling.top_p")
        _check(0.0 <= self.min_p < 1.0, "min_p must be in [0, 1)", "sampling.min_p")
        _check(0.0 < self.typical <= 1.0, "typical must be in (0, 1]", "sampling.typical")
        _check(
            math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty must be finite and > 0",
            "sampling.repetition_penalty",
        )
        _check(
            math.isfinite(self.frequency_penalty),
            "frequency_penalty must be finite",
            "sampling.frequency_penalty",
        )
        _check(
            math.isfinite(self.presence_penalty),
            "presence_penalty must be finite",
            "sampling.presence_penalty",
        )
        biased: set[int] = set()
        for i, (token, bias) in enumerate(self.logit_bias):
            _check(
                0 <= token < vocab_size,
                f"logit_bias token id {token} is outside [0, {vocab_size})",
                f"sampling.logit_bias[{i}].token_id",
            )
            _check(
                token not in biased,
                f"logit_bias has token {token} twice; give each token one bias",
                f"sampling.logit_bias[{i}].token_id",
            )
            biased.add(token)
            _check(
                -100.0 <= bias <= 100.0,
                f"logit_bias for token {token} must be in [-100, 100], got {bias}",
                f"sampling.logit_bias[{i}].bias",
            )
        for token in self.banned_token_ids:
            _check(
                0 <= token < vocab_size,
                f"banned token id {token} is outside [0, {vocab_size})",
                "sampling.banned_token_ids",
            )
        _check(
            len(self.banned_token_ids) < vocab_size,
            "banned_token_ids cannot ban the whole vocabulary",
            "sampling.banned_token_ids",
        )


@dataclass(frozen=True)
class SpecLimits:
    """What every job must fit, the same in both processes: the engine knows it from its model and
    cache; the front end learns it from the engine's READY."""

    vocab_size: int
    hidden_size: int
    context_length: int  # most prompt + new tokens of one sequence
    num_pages: int
    page_size: int


@dataclass(frozen=True)
class JobSpec:
    prompt_ids: tuple[int, ...]
    max_new_tokens: int = 256
    min_new_tokens: int = 0  # stop tokens and EOS are suppressed until this many tokens exist
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    decode_special_tokens: bool = False  # include special tokens' text in the streamed text
    return_logprobs: bool = False
    top_logprobs: int = 0  # alternatives per token, with return_logprobs
    identifier: str | None = None  # the caller's own tag, echoed back in every event
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    # Prefix-cache isolation: jobs share cached prompt pages only with jobs of the same salt
    # (e.g. one salt per tenant); "" shares with every other unsalted job.
    cache_salt: str = ""
    # Constrained decoding: the output must be a JSON value of this schema, match this regex, or
    # be a sentence of this grammar (engine/grammar/constraints.py). Its drafts are checked against it.
    response_format: ResponseFormat | None = None
    # Strings that must never appear in the output: text that may become one is held back, and if
    # one completes, generation rewinds to the token it started in and bans that token there.
    banned_strings: tuple[str, ...] = ()
    # Take the prompt's last token back and regenerate it among the tokens whose text starts with
    # its text, so a prompt that ends mid-word continues the word; the output starts after that text.
    token_healing: bool = False
    # The LoRA adapter to run with (a name the engine has loaded); None: the base model.
    adapter: str | None = None
    # Stop (StopReason.LOOP) once the output ends with a pattern repeated (engine/output/loop_detector.py).
    stop_on_loop: LoopStop | None = None
    # Admission order (higher first, with aging, then arrival); a waiting job preempts running jobs of
    # lower priority when the batch or the page pool is full (engine/scheduler.py, engine/fair_queue.py).
    priority: int = 0
    # Whose job it is, for fair shares between tenants ("": the one anonymous tenant, authentication off).
    tenant: str = ""
    # Classifier-free guidance against a negative prompt (engine/prompt/guidance.py); None: off.
    guidance: Guidance | None = None
    # Vectors fed instead of the token embeddings of spans of the prompt (engine/prompt/prompt_embeddings.py);
    # their rows must be of the model's hidden size (checked at enqueue).
    embeddings: tuple[PromptEmbedding, ...] = ()
    # Output tokens an earlier engine already delivered for this job (it stopped mid-job): the job
    # continues after them, as if it had sampled them itself, and streams none of them again. They
    # count toward max_new_tokens, min_new_tokens and the penalties; seeded draws go on from their
    # positions (engine/sampling/positioned_uniform.py).
    resume_output: tuple[int, ...] = ()

    def validate(self, vocab_size: int, hidden_size: int | None = None) -> None:
        """InvalidRequestError naming the field and its limit; `hidden_size`: prompt embeddings' rows
        must be that wide (None: unchecked)."""
        # Types first: an in-process caller's float or string would otherwise pass a range check, or
        # fail deep in the forward as the engine's error rather than the caller's.
        _check(
            not isinstance(self.prompt_ids, str | bytes),
            "prompt_ids must be token ids (ints), not text",
            "prompt_ids",
        )
        _check(len(self.prompt_ids) > 0, "prompt must hold at least one token", "prompt_ids")
        _check(
            all(type(t) is int and 0 <= t < vocab_size for t in self.prompt_ids),
            f"prompt token ids must be ints in [0, {vocab_size})",
            "prompt_ids",
        )
        for name in ("max_new_tokens", "min_new_tokens", "top_logprobs", "priority"):
            value = getattr(self, name)
            _check(type(value) is int, f"{name} must be an int, got {value!r}", name)
        _check(
            self.max_new_tokens >= 1,
            f"max_new_tokens must be >= 1, got {self.max_new_tokens}",
            "max_new_tokens",
        )
        _check(
            0 <= self.min_new_tokens <= self.max_new_tokens,
            f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}",
            "min_new_tokens",
        )
        _check(
            0 <= self.top_logprobs <= 20,
            f"top_logprobs must be in [0, 20], got {self.top_logprobs}",
            "top_logprobs",
        )
        for name, strings in (("stop_strings", self.stop_strings), ("banned_strings", self.banned_strings)):
            _check(_strings(strings), f"{name} must be a sequence of strings", name)
            for i, text in enumerate(strings):
                _check(bool(text), f"{name}[{i}] must not be empty", f"{name}[{i}]")
        _check(
            not (self.token_healing and self.response_format is not None),
            "token_healing cannot be combined with response_format (the healed text is the prompt's, "
            "not the output's)",
            "token_healing",
        )
        if self.stop_on_loop is not None:
            problem = self.stop_on_loop.problem()
            _check(problem is None, problem or "", "stop_on_loop")
        _check(
            -MAX_PRIORITY <= self.priority <= MAX_PRIORITY,
            f"priority must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {self.priority}",
            "priority",
        )
        if self.guidance is not None:
            problem = self.guidance.problem(vocab_size)
            _check(problem is None, problem or "", "guidance")
        if self.embeddings:
            check_embeddings(self.embeddings, len(self.prompt_ids), hidden_size)
            _check(
                not self.token_healing,
                "token_healing cannot be combined with embeddings (it takes back the prompt's last tokens)",
                "token_healing",
            )
        for token in self.stop_token_ids:
            _check(
                0 <= token < vocab_size,
                f"stop token id {token} is outside [0, {vocab_size})",
                "stop_token_ids",
            )
        _check(
            len(self.resume_output) < self.max_new_tokens,
            f"resume_output holds {len(self.resume_output)} tokens: max_new_tokens {self.max_new_tokens} "
            "leaves none to generate",
            "resume_output",
        )
        _check(
            all(0 <= t < vocab_size for t in self.resume_output),
            f"resume_output token ids must be in [0, {vocab_size})",
            "resume_output",
        )
        _check(
            len(self.tenant) <= MAX_TENANT_CHARS,
            f"tenant must be at most {MAX_TENANT_CHARS} characters",
            "tenant",
        )
        _check(
            len(self.cache_salt) <= MAX_CACHE_SALT_CHARS,
            f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters, got {len(self.cache_salt)}",
            "cache_salt",
        )
        self.sampling.validate(vocab_size)
        if self.response_format is not None:
            self.response_format.validate()

    def check(self, limits: SpecLimits) -> None:
        """The one rule a job is admitted by, in the front end and in the engine alike: its values
        and its prompt embeddings' width (`validate`), and `check_fit`. InvalidRequestError or
        PromptTooLongError naming what is wrong."""
        self.validate(limits.vocab_size, limits.hidden_size)
        check_fit(self, limits)


def check_fit(spec: JobSpec, limits: SpecLimits) -> None:
    """PromptTooLongError unless the job (with its negative prompt, if guided) fits the context and,
    at its longest, the whole cache: each sequence's prompt + max_new_tokens within the context, and
    all its sequences' pages together within the cache's pages. Of the two, the tighter bound is
    checked first, so the message names the one that decides."""
    if limits.num_pages * limits.page_size < limits.context_length:
        _check_pages(spec, limits)
        _check_context(spec, limits)
    else:
        _check_context(spec, limits)
        _check_pages(spec, limits)


def _sequences(spec: JobSpec) -> list[tuple[str, int]]:
    prompts = [("prompt", len(spec.prompt_ids))]
    if spec.guidance is not None:
        prompts.append(("negative prompt", len(spec.guidance.negative_prompt_ids)))
    return prompts


def _check_context(spec: JobSpec, limits: SpecLimits) -> None:
    new = spec.max_new_tokens
    for what, n in _sequences(spec):
        if n + new > limits.context_length:
            raise PromptTooLongError(
                f"{what} of {n} tokens + max_new_tokens {new} = {n + new} tokens exceeds max_seq_len "
                f"{limits.context_length} (the context of {limits.context_length} tokens)"
            )


def _check_pages(spec: JobSpec, limits: SpecLimits) -> None:
    ps, new = limits.page_size, spec.max_new_tokens
    prompts = _sequences(spec)
    pages = sum(-(-(n + new) // ps) for _, n in prompts)
    if pages <= limits.num_pages:
        return
    if spec.guidance is None:
        n = len(spec.prompt_ids)
        raise PromptTooLongError(
            f"prompt of {n} tokens + max_new_tokens {new} = {n + new} tokens exceeds the whole KV cache "
            f"of {limits.num_pages * ps} tokens ({limits.num_pages} pages of {ps})"
        )
    what = " and ".join(f"{w} of {n} tokens" for w, n in prompts)  # the two sequences together
    raise PromptTooLongError(
        f"{what} + max_new_tokens {new} need {pages} pages, more than the whole KV cache's "
        f"{limits.num_pages} pages of {ps} tokens"
    )


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's likelihood, twice: `logprob`/`top` before the truncating filters (top_k,
    top_p, min_p, typical) and `final_prob`/`final_top` after them, the distribution it was drawn from."""

    token_id: int
    logprob: float  # log-probability after penalties, biases, bans and temperature, before truncation
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first
    final_prob: float | None = None  # its probability after every filter (1.0 for greedy jobs)
    final_top: tuple[tuple[int, float], ...] = ()  # (token id, probability) after the filters, > 0 only


@dataclass(frozen=True)
class JobTimings:
    queued: float  # seconds from enqueue to first scheduled
    prefill: float  # seconds from first scheduled to first token
    decode: float  # seconds from first token to finish


@dataclass(frozen=True)
class JobStarted:
    job_id: JobId
    identifier: str | None
    prompt_tokens: int
    cached_tokens: int  # prompt tokens found in the prefix cache


@dataclass(frozen=True)
class PrefillProgress:
    job_id: JobId
    identifier: str | None
    done_tokens: int
    total_tokens: int


@dataclass(frozen=True)
class TokensGenerated:
    job_id: JobId
    identifier: str | None
    text: str  # new text, safe to show: whole UTF-8 characters, never past a stop string
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class JobError:
    """Why the engine failed a job: a kind to map to a status and a short message for the caller."""

    kind: ErrorKind
    message: str


@dataclass(frozen=True)
class JobFinished:
    job_id: JobId
    identifier: str | None
    stop_reason: StopReason
    stop_token: int | None  # the token that stopped the job (not part of token ids)
    stop_string: str | None  # the stop string that matched (not part of the text)
    prompt_tokens: int
    new_tokens: int
    cached_tokens: int
    timings: JobTimings
    text: str = ""  # held-back text released at the end, if any
    accepted_draft_tokens: int = 0
    rejected_draft_tokens: int = 0
    error: JobError | None = None  # set exactly when stop_reason is ERROR
    adapter: str | None = None  # the LoRA adapter the job ran with


JobEvent = JobStarted | PrefillProgress | TokensGenerated | JobFinished
