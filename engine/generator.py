"""The dynamic generator: the in-process API of the engine.

`enqueue(spec, job_id=None) -> JobId`, `iterate() -> list[JobEvent]`, `cancel(job_id)`,
and `generate(...)` for simple use. Each `iterate()` asks the scheduler for this
iteration's chunks (decode steps and prefill chunks of many jobs), runs them in one
forward over the paged KV cache, samples every job whose chunk reached its last
token, and turns the results into events. Jobs join and leave at every iteration.

Faults stay with their job: an exception while running one job's step (its share of the
forward, its sampling, text, stop checks or drafts) finishes that job with
StopReason.ERROR and a JobError, releases its pages and logs the traceback; the other
jobs of the step go on. A batched call that raises (forward, sampler, drafter) is re-run
one job at a time to find whose it was; nothing is committed before it returns.

Not thread-safe: one thread (the engine loop) owns a generator.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

import torch

from engine import defaults
from engine.constraints import GrammarCompiler, MaskOverlap, MaskWorker, mask_words, token_bitmask
from engine.errors import DyngenError, ErrorKind, InvalidRequestError, JobNotFoundError, PromptTooLongError
from engine.forward_batch import SequenceInput
from engine.job_state import HeldToken, JobState
from engine.jobs import (
    JobError,
    JobEvent,
    JobFinished,
    JobId,
    JobSpec,
    JobStage,
    JobStarted,
    JobTimings,
    PrefillProgress,
    StopReason,
    TokenLogprob,
    TokensGenerated,
    new_job_id,
)
from engine.kv_cache import KVCacheKind, PagedKVCache
from engine.model.llama import LlamaModel
from engine.model.tokenizer import Tokenizer
from engine.pages import PagePool
from engine.runner import ModelRunner
from engine.sampler import (
    DEFAULT_MIN_SAMPLING_THREADS,
    Sampler,
    SampleRequest,
    SampleResult,
    SamplerMode,
    SamplerState,
)
from engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from engine.speculative import (
    Draft,
    Drafter,
    DrafterKind,
    DraftModelDrafter,
    DraftRequest,
    NgramDrafter,
    SpeculationConfig,
    accept_greedy,
    accept_sampled,
)
from engine.text_stream import BannedMatch, TextStream
from engine.token_healing import TokenHealer

logger = logging.getLogger(__name__)

_MAX_ERROR_CHARS = 200

# A job whose banned strings keep matching gives up (StopReason.ERROR) after this many rewinds:
# each costs a sampler call, and a model set on a banned string could otherwise loop for long.
MAX_REWINDS = 256

# Ids appear in logs and metrics: printable, bounded, no separators to forge.
_JOB_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")


@dataclass(frozen=True)
class GeneratorConfig:
    page_size: int = defaults.PAGE_SIZE
    num_pages: int = 128
    max_seq_len: int | None = None  # default: the model's context length
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    sampling_threads: int = defaults.SAMPLING_THREADS
    min_sampling_threads: int = DEFAULT_MIN_SAMPLING_THREADS
    sampler_mode: SamplerMode = SamplerMode.AUTO
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    # INT8: K/V stored as int8 with a float16 scale per token and head (the draft model's cache stays float).
    kv_cache: KVCacheKind = KVCacheKind.FLOAT
    # Constrained jobs' masks: beside the forward with a core to spare, else just before it.
    mask_overlap: MaskOverlap = MaskOverlap.AUTO

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.num_pages < 1:
            raise InvalidRequestError(
                f"page_size and num_pages must be >= 1, got {self.page_size}, {self.num_pages}"
            )


@dataclass(frozen=True)
class GeneratorStats:
    queued: int
    running: int
    pages_free: int
    pages_cached: int
    pages_used: int
    forwarded_tokens: int  # tokens run through the model since start
    iterations: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    accepted_draft_tokens: int
    rejected_draft_tokens: int
    failed_jobs: int  # jobs finished with StopReason.ERROR since start


@dataclass(frozen=True)
class _StepOutput:
    """One chunk's share of a forward: its logits start at `row` of `logits`."""

    chunk: ScheduledChunk
    seq: SequenceInput
    logits: torch.Tensor
    row: int


def _logit_rows(outputs: list[_StepOutput]) -> torch.Tensor:
    """The logits row of each output, stacked in order (no copy when they are the whole forward's)."""
    first = outputs[0].logits
    if all(o.logits is first for o in outputs):
        if len(outputs) == first.shape[0]:
            return first
        return first[[o.row for o in outputs]]
    return torch.cat([o.logits[o.row : o.row + 1] for o in outputs])


@dataclass(frozen=True)
class Completion:
    """The whole result of one job, for `generate()`."""

    job_id: JobId
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    finished: JobFinished


_Masks = dict[JobId, torch.Tensor]  # a constrained job's token bitmask for this step


class DynamicGenerator:
    def __init__(
        self,
        model: LlamaModel,
        tokenizer: Tokenizer,
        config: GeneratorConfig | None = None,
        draft_model: LlamaModel | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or GeneratorConfig()
        c = self.config
        self.max_seq_len = min(
            c.max_seq_len or model.config.max_position_embeddings, model.config.max_position_embeddings
        )
        self.cache: PagedKVCache = model.new_cache(c.num_pages, c.page_size, c.kv_cache)
        self.runner = ModelRunner(model, self.cache)
        self.pool = PagePool(c.num_pages, c.page_size)
        self.scheduler = Scheduler(c.scheduler, self.pool)
        self.sampler = Sampler(
            model.config.vocab_size, c.sampling_threads, c.min_sampling_threads, c.sampler_mode
        )
        self.jobs: dict[JobId, JobState] = {}
        self.grammars = GrammarCompiler(tokenizer, model.config.vocab_size)
        self.healer = TokenHealer(tokenizer, model.config.vocab_size, self.grammars.ll_tokenizer)
        self._masks: MaskWorker | None = None  # its thread starts with the first constrained job
        self.mask_overlap = c.mask_overlap.resolve()
        self._eos = frozenset(model.config.eos_token_ids) | tokenizer.eos_token_ids
        self._orders = 0
        self._iterations = 0
        self._pending_events: list[JobEvent] = []
        self._accepted_drafts = 0
        self._rejected_drafts = 0
        self._failed_jobs = 0
        self.drafter: Drafter | None = None
        match c.speculation.kind:
            case DrafterKind.NONE:
                pass
            case DrafterKind.NGRAM:
                self.drafter = NgramDrafter(c.speculation.max_ngram)
            case DrafterKind.DRAFT_MODEL:
                if draft_model is None:
                    raise InvalidRequestError("speculation kind draft_model needs a draft model")
                self.drafter = DraftModelDrafter(
                    draft_model, model.config.vocab_size, c.num_pages, c.page_size
                )

    # -- the job API ---------------------------------------------------------------------------

    def enqueue(self, spec: JobSpec, job_id: JobId | None = None) -> JobId:
        """Validate and queue a job; raises InvalidRequestError, PromptTooLongError or QueueFullError.

        `job_id`: the caller's id for the job (minted with `new_job_id()`, e.g. so the caller can
        route the job's events before it is queued); None mints one. An id in use is refused.
        """
        if job_id is not None:
            if not _JOB_ID.fullmatch(job_id):
                raise InvalidRequestError("a job id must be 1 to 64 characters of [0-9A-Za-z_-]")
            if job_id in self.jobs:
                raise InvalidRequestError(f"job id {job_id} is in use by another job")
        spec.validate(self.model.config.vocab_size)
        total = len(spec.prompt_ids) + spec.max_new_tokens
        if total > self.max_seq_len:
            raise PromptTooLongError(
                f"prompt of {len(spec.prompt_ids)} tokens + max_new_tokens {spec.max_new_tokens} = {total} "
                f"tokens exceeds max_seq_len {self.max_seq_len}"
            )
        capacity = self.pool.num_pages * self.pool.page_size
        if total > capacity:
            raise PromptTooLongError(
                f"prompt of {len(spec.prompt_ids)} tokens + max_new_tokens {spec.max_new_tokens} = {total} "
                f"tokens exceeds the whole KV cache of {capacity} tokens "
                f"({self.pool.num_pages} pages of {self.pool.page_size})"
            )
        # Compiled (or taken from the cache) here: a bad schema is the caller's error, at enqueue.
        constraint = self.grammars.compile(spec.response_format) if spec.response_format is not None else None
        heal = self.healer.plan(spec.prompt_ids) if spec.token_healing else None
        if heal is not None:  # the job runs on the prompt less its last token
            spec = dataclasses.replace(spec, prompt_ids=heal.prompt_ids)
        if job_id is None:
            job_id = new_job_id()
        job = JobState(
            job_id=job_id,
            spec=spec,
            sampler=SamplerState(spec.sampling, spec.prompt_ids, self.model.config.vocab_size),
            text=TextStream(
                self.tokenizer,
                spec.stop_strings,
                not spec.decode_special_tokens,
                spec.banned_strings,
                heal.removed_text if heal is not None else "",
            ),
            enqueued_at=time.perf_counter(),
            order=0,
            tokens=list(spec.prompt_ids),
            constraint=constraint,
            heal=heal,
            healing=heal.removed if heal is not None else b"",
        )
        self.scheduler.submit(job)
        self.jobs[job_id] = job
        return job_id

    def cancel(self, job_id: JobId) -> None:
        """Stop a job now (queued, mid-prefill or mid-decode); its pages are freed at once."""
        job = self.jobs.get(job_id)
        if job is None:
            raise JobNotFoundError(f"no job {job_id}")
        self._pending_events.append(self._finish(job, StopReason.CANCELLED, None, None, ""))

    def has_work(self) -> bool:
        return not self.scheduler.idle() or bool(self._pending_events)

    def stats(self) -> GeneratorStats:
        p = self.pool.stats()
        return GeneratorStats(
            queued=len(self.scheduler.queue),
            running=len(self.scheduler.running),
            pages_free=p.free,
            pages_cached=p.cached,
            pages_used=p.referenced,
            forwarded_tokens=self.runner.forwarded_tokens,
            iterations=self._iterations,
            prefix_hit_tokens=p.prefix_hit_tokens,
            prefix_query_tokens=p.prefix_query_tokens,
            accepted_draft_tokens=self._accepted_drafts,
            rejected_draft_tokens=self._rejected_drafts,
            failed_jobs=self._failed_jobs,
        )

    def check_invariants(self) -> None:
        self.pool.check_invariants(j.pages for j in self.jobs.values() if j.pages)

    # -- one iteration -------------------------------------------------------------------------

    def iterate(self) -> list[JobEvent]:
        """Run one forward over this iteration's chunks; return the events it produced.

        A fault while running one job (its forward, sampling, text, stop checks, drafts) fails that
        job alone (StopReason.ERROR); every other job goes on as if it had not happened.
        """
        events, self._pending_events = self._pending_events, []
        self._plan_speculation()
        chunks = self._draft(self.scheduler.schedule(on_preempt=self._on_preempt), events)
        if not chunks:
            return events
        now = time.perf_counter()
        staged: list[tuple[ScheduledChunk, SequenceInput]] = []
        for c in chunks:
            try:
                staged.append((c, self._stage(c, now, events)))
            except Exception as exc:
                self._contain(c.job, "preparing its step", exc, events)
        if not staged:
            return events
        self._iterations += 1
        masks = self._start_masks(staged)
        if masks is not None and self.mask_overlap is MaskOverlap.BEFORE:
            wait([masks])  # no core to spare: the worker would stall the forward's threads
        sampled: list[_StepOutput] = []
        for out in self._forward(staged, events):
            job, seq = out.chunk.job, out.seq
            try:
                if out.chunk.draft:
                    logits = out.logits[out.row : out.row + seq.logit_positions]
                    self._verify(job, out.chunk.draft, logits, events)
                    continue
                self._rewind_drafts(job, self.scheduler.advance(job, seq.end_pos))
                if seq.want_logits:
                    sampled.append(out)
                elif job.computed <= job.prompt_len:
                    events.append(
                        PrefillProgress(job.job_id, job.spec.identifier, job.computed, job.prompt_len)
                    )
            except Exception as exc:
                self._contain(job, "taking its step's results", exc, events)
        if sampled:
            self._sample(sampled, events, masks)
        elif masks is not None:
            masks.result()  # nobody samples after all (failed forwards): let the worker finish
        return events

    def _start_masks(self, staged: list[tuple[ScheduledChunk, SequenceInput]]) -> Future[_Masks] | None:
        """Start computing the token masks of the constrained jobs that sample after this forward."""
        jobs = [
            c.job for c, seq in staged if seq.want_logits and not c.draft and c.job.constraint is not None
        ]
        if not jobs:
            return None
        if self._masks is None:
            self._masks = MaskWorker(self.model.config.vocab_size)
        constraints = [j.constraint for j in jobs if j.constraint is not None]
        future = self._masks.start(constraints)
        result: Future[_Masks] = Future()

        def done(f: Future[torch.Tensor]) -> None:
            exc = f.exception()
            if exc is not None:
                result.set_exception(exc)
            else:
                bitmask = f.result()
                result.set_result({j.job_id: bitmask[i] for i, j in enumerate(jobs)})

        future.add_done_callback(done)
        return result

    def _stage(self, c: ScheduledChunk, now: float, events: list[JobEvent]) -> SequenceInput:
        """The model input of one chunk (and the job's start event, the first time it runs)."""
        job = c.job
        self.scheduler.begin_chunk(job, self.cache.copy_prefix)
        if not job.started:
            job.started = True
            job.scheduled_at = now
            events.append(JobStarted(job.job_id, job.spec.identifier, job.prompt_len, job.cached_tokens))
        if c.draft:
            tokens = [*job.tokens[job.computed :], *c.draft]
            return SequenceInput(tokens, job.computed, job.pages, True, len(tokens))
        end = job.computed + c.num_tokens
        return SequenceInput(job.tokens[job.computed : end], job.computed, job.pages, end == len(job.tokens))

    def _forward(
        self, staged: list[tuple[ScheduledChunk, SequenceInput]], events: list[JobEvent]
    ) -> list[_StepOutput]:
        """One batched forward; if it raises, each chunk alone, failing only the jobs whose chunk fails.

        Nothing is committed before a forward returns (`computed` advances after it), so a chunk can
        simply run again; K/V a failed forward wrote past `computed` is overwritten later.
        """
        try:
            return self._run_model(staged)
        except Exception as exc:
            if len(staged) == 1:
                self._contain(staged[0][0].job, "running the model", exc, events)
                return []
            logger.warning(
                "a forward of %d jobs failed (%s); running them one at a time",
                len(staged),
                type(exc).__name__,
            )
        outputs: list[_StepOutput] = []
        for item in staged:
            try:
                outputs.extend(self._run_model([item]))
            except Exception as exc:
                self._contain(item[0].job, "running the model", exc, events)
        return outputs

    def _run_model(self, staged: list[tuple[ScheduledChunk, SequenceInput]]) -> list[_StepOutput]:
        result = self.runner.run([seq for _, seq in staged])
        return [
            _StepOutput(c, seq, result.logits, row)
            for (c, seq), row in zip(staged, result.first_rows, strict=True)
        ]

    def _sample(
        self, sampled: list[_StepOutput], events: list[JobEvent], masks: Future[_Masks] | None = None
    ) -> None:
        """Sample the next token of every job whose chunk reached its last token, then take it."""
        ready: list[tuple[_StepOutput, SampleRequest]] = []
        allowed: _Masks = {}
        if masks is not None:
            try:
                allowed = masks.result()  # computed while the forward ran
            except Exception as exc:
                for out in sampled:
                    if out.chunk.job.constraint is not None:
                        self._contain(out.chunk.job, "computing its grammar's token mask", exc, events)
                sampled = [o for o in sampled if o.chunk.job.constraint is None]
        for out in sampled:
            try:
                job = out.chunk.job
                ready.append((out, self._sample_request(job, allowed=allowed.get(job.job_id))))
            except Exception as exc:
                self._contain(out.chunk.job, "preparing its sampling", exc, events)
        if not ready:
            return
        taken: list[tuple[_StepOutput, SampleResult]] = []
        try:
            # overwrite: the masks go into the forward's own rows (a masked row stays right for a
            # rewind: the grammar is in the same state when that position is sampled again).
            results = self.sampler.sample(
                _logit_rows([o for o, _ in ready]), [r for _, r in ready], overwrite=True
            )
            taken = list(zip((o for o, _ in ready), results, strict=True))
        except Exception as exc:
            if len(ready) == 1:
                self._contain(ready[0][0].chunk.job, "sampling", exc, events)
                return
            # A seeded sampled job whose uniform was already drawn in the failed call draws again:
            # still a valid sample, though not the one its seed gives alone.
            logger.warning(
                "sampling %d jobs failed (%s); sampling them one at a time", len(ready), type(exc).__name__
            )
            for out, request in ready:
                try:
                    (result,) = self.sampler.sample(out.logits[out.row : out.row + 1], [request])
                    taken.append((out, result))
                except Exception as exc:
                    self._contain(out.chunk.job, "sampling", exc, events)
        for out, result in taken:
            try:
                self._accept(out.chunk.job, result.token_id, result.logprob, events, out.logits[out.row])
            except Exception as exc:
                self._contain(out.chunk.job, "taking its sampled token", exc, events)

    # -- speculation ---------------------------------------------------------------------------

    def _speculates(self, job: JobState) -> bool:
        s = job.spec.sampling
        # Penalties depend on every earlier token, drafts included, and logprobs are reported
        # per sampled token: such jobs decode one token at a time.
        return (
            job.decoding
            and not job.spec.return_logprobs
            and s.repetition_penalty == 1.0
            and s.frequency_penalty == 0.0
            and s.presence_penalty == 0.0
            and not job.spec.banned_strings  # a rewind needs each held token's own logits row
            and not job.healing  # its next token is held to the prompt's taken-back text
        )

    def _plan_speculation(self) -> None:
        """Decide how many draft tokens each decoding job may verify in the next step."""
        if self.drafter is None:
            return  # budgets stay 0: no per-job work in the loop when speculation is off
        spec = self.config.speculation
        active = len(self.scheduler.running) <= spec.max_batch_size
        for job in self.scheduler.running:
            left = job.spec.max_new_tokens - job.new_tokens - 1  # the verify step adds one token of its own
            budget = min(spec.num_draft_tokens, left) if active and self._speculates(job) else 0
            self.scheduler.set_draft_budget(job, budget)

    def _draft(self, chunks: list[ScheduledChunk], events: list[JobEvent]) -> list[ScheduledChunk]:
        """Ask the drafter for the speculating jobs' drafts (their pages exist now) and trim chunks to them."""
        # Only a decode step verifies drafts; a prefill chunk (e.g. of a re-admitted job) never does.
        wanting = [c for c in chunks if c.job.draft_budget > 0 and c.num_tokens > 1 and c.job.decoding]
        if self.drafter is None or not wanting:
            return chunks
        drafter = self.drafter
        requests = [DraftRequest(c.job.job_id, c.job.tokens, c.job.pages, c.num_tokens - 1) for c in wanting]
        drafts: dict[int, Draft] = {}
        try:
            drafts = dict(zip((id(c) for c in wanting), drafter.propose(requests), strict=True))
        except Exception as exc:
            if len(wanting) > 1:
                logger.warning(
                    "drafting for %d jobs failed (%s); drafting one at a time",
                    len(wanting),
                    type(exc).__name__,
                )
            for c, request in zip(wanting, requests, strict=True):
                try:
                    (drafts[id(c)],) = drafter.propose([request])
                except Exception as exc:
                    self._contain(c.job, "drafting", exc, events)
        out = []
        for c in chunks:
            if c.job.stage is JobStage.FINISHED:
                continue  # failed while drafting
            draft = drafts.get(id(c))
            if draft is None:
                out.append(c)
            else:
                out.append(ScheduledChunk(c.job, 1 + len(draft.tokens), draft.tokens))
        return out

    def _verify(
        self, job: JobState, draft: tuple[int, ...], logits: torch.Tensor, events: list[JobEvent]
    ) -> None:
        """Keep the acceptable prefix of `draft` plus one token of the target's own."""
        drafted = len(draft)
        masks: list[torch.Tensor | None] = [None] * (drafted + 1)
        if job.constraint is not None:
            draft, masks = self._grammar_masks(job, draft)
            logits = logits[: len(draft) + 1]
        requests = [self._sample_request(job, ahead=i, allowed=masks[i]) for i in range(len(draft) + 1)]
        probs = self.sampler.processed_probs(logits, requests)
        if job.spec.sampling.greedy:
            choice = probs.argmax(dim=-1).tolist()
            accepted = accept_greedy(choice, draft)
            bonus = int(choice[accepted])
        else:
            accepted, dist = accept_sampled(probs, Draft(draft), job.sampler.generator)
            bonus = self.sampler.draw(dist, job.sampler)
        job.accepted_drafts += accepted
        job.rejected_drafts += drafted - accepted
        self._accepted_drafts += accepted
        self._rejected_drafts += drafted - accepted
        base = job.computed
        for token in (*draft[:accepted], bonus):
            self._accept(job, token, None, events)
            if job.stage is JobStage.FINISHED:
                return
        # K/V are valid for the last token and the accepted drafts only.
        self._rewind_drafts(job, self.scheduler.advance(job, base + 1 + accepted))

    def _grammar_masks(
        self, job: JobState, draft: tuple[int, ...]
    ) -> tuple[tuple[int, ...], list[torch.Tensor | None]]:
        """A constrained job's draft cut where its grammar refuses a token, and the grammar's mask
        at each position of what is left (plus the bonus position). The matcher walks the draft
        and is rolled back: only tokens taken by `_accept` advance it."""
        c = job.constraint
        assert c is not None
        bitmask = torch.zeros((len(draft) + 1, mask_words(self.model.config.vocab_size)), dtype=torch.int32)
        c.fill(bitmask, 0)
        taken = 0
        for token in draft:
            if not c.try_accept(token):
                break
            taken += 1
            if c.complete:  # the job ends with this token; the bonus is never taken
                bitmask[taken] = -1
                break
            c.fill(bitmask, taken)
        c.rollback(taken)
        return draft[:taken], list(bitmask[: taken + 1])

    def _sample_request(
        self, job: JobState, ahead: int = 0, allowed: torch.Tensor | None = None
    ) -> SampleRequest:
        """The request for the job's next token (`ahead` tokens further on, when verifying drafts);
        `allowed`: its grammar's token mask."""
        spec = job.spec
        position = job.new_tokens + ahead
        banned: frozenset[int] = frozenset()
        if position < spec.min_new_tokens:
            banned = spec.stop_token_ids | (frozenset() if spec.ignore_eos else self._eos)
        if job.position_bans:
            banned |= job.position_bans.get(position, frozenset())
        if job.constraint is not None and allowed is None:
            raise RuntimeError("a constrained job must not sample without its token mask")
        if job.healing:
            if ahead:
                raise RuntimeError("a job still healing its prompt's last word must not verify drafts")
            allowed = self.healer.mask(job.healing)
        return SampleRequest(job.sampler, banned, spec.return_logprobs, spec.top_logprobs, allowed)

    def _accept(
        self,
        job: JobState,
        token: int,
        logprob: TokenLogprob | None,
        events: list[JobEvent],
        logits: torch.Tensor | None = None,
    ) -> None:
        """Take one new token of the job (`logits`: the row it was sampled from): stream its text,
        finish the job on a stop condition, or rewind past a banned string and take another."""
        again = self._take(job, token, logprob, logits, events)
        while again is not None:
            again = self._take(job, *again, events)

    def _take(
        self,
        job: JobState,
        token: int,
        logprob: TokenLogprob | None,
        logits: torch.Tensor | None,
        events: list[JobEvent],
    ) -> tuple[int, TokenLogprob | None, torch.Tensor] | None:
        """`_accept` for one token; returns the token sampled again after a rewind, if there was one."""
        spec = job.spec
        now = time.perf_counter()
        if job.first_token_at is None:
            job.first_token_at = now
        if token in spec.stop_token_ids or (not spec.ignore_eos and token in self._eos):
            reason = StopReason.STOP_TOKEN if token in spec.stop_token_ids else StopReason.EOS
            self._finish_releasing(job, reason, token, events)
            return None
        if job.constraint is not None:
            job.constraint.accept(token)
        job.tokens.append(token)
        job.sampler.accept(token)
        if job.healing:
            job.healing = self.healer.remaining(job.healing, (token,))
        delta = job.text.push([token])
        if delta.banned is not None:
            return self._rewind(job, delta.banned, token, logits)
        # Tokens are streamed with their text: the stream releases the oldest `released` of the
        # tokens it holds (this one included, unless it may be the start of a banned string).
        if not job.held and delta.released == 1:  # nothing held back: the usual case
            logprobs = () if logprob is None else (logprob,)
            events.append(TokensGenerated(job.job_id, spec.identifier, delta.text, (token,), logprobs))
        else:
            # A token that may start a banned string keeps its logits row, to be sampled again.
            kept = logits if job.text.held > 0 else None
            job.held.append(HeldToken(token, logprob, None if kept is None else kept.clone()))
            out = job.held[: delta.released]
            del job.held[: delta.released]
            if out or delta.text:
                events.append(self._released(job, delta.text, out))
        if delta.stop_string is not None:
            events.append(self._finish(job, StopReason.STOP_STRING, None, delta.stop_string, ""))
        elif job.constraint is not None and job.constraint.complete:
            self._finish_releasing(job, StopReason.GRAMMAR, None, events)
        elif job.new_tokens >= spec.max_new_tokens:
            self._finish_releasing(job, StopReason.MAX_NEW_TOKENS, None, events)
        return None

    def _finish_releasing(
        self, job: JobState, reason: StopReason, token: int | None, events: list[JobEvent]
    ) -> None:
        """Finish a job that no stop string ended: its held text, and held tokens, are final now."""
        text = job.text.finish()
        if job.held:
            held, job.held = job.held, []
            events.append(self._released(job, text, held))
            text = ""
        events.append(self._finish(job, reason, token, None, text))

    @staticmethod
    def _released(job: JobState, text: str, held: list[HeldToken]) -> TokensGenerated:
        """The event streaming held tokens with the text they complete."""
        logprobs = tuple(h.logprob for h in held if h.logprob is not None)
        return TokensGenerated(job.job_id, job.spec.identifier, text, tuple(h.token for h in held), logprobs)

    def _rewind(
        self, job: JobState, match: BannedMatch, token: int, logits: torch.Tensor | None
    ) -> tuple[int, TokenLogprob | None, torch.Tensor]:
        """A banned string completed: take the job back to before output token `match.token`, ban
        that token at that position, and sample the position again from its kept logits row."""
        if job.rewinds >= MAX_REWINDS:
            raise InvalidRequestError(
                f"banned strings: gave up after {MAX_REWINDS} rewinds (the model keeps writing "
                f"{match.string!r}); remove the ban or change the prompt"
            )
        job.rewinds += 1
        position = match.token
        # The stream holds job.held plus `token` (pushed last, not in job.held yet).
        k = position - (job.new_tokens - len(job.held) - 1)
        if k == len(job.held):
            first, row = token, logits
        else:
            first, row = job.held[k].token, job.held[k].logits
        if row is None:
            raise RuntimeError("a banned string matched at a token sampled without its logits row")
        keep = job.prompt_len + position
        dropped = len(job.tokens) - keep
        job.text.rewind(position)
        del job.held[k:]
        del job.tokens[keep:]
        job.sampler.rewind(job.tokens[job.prompt_len :])
        if job.heal is not None:
            job.healing = self.healer.remaining(job.heal.removed, job.tokens[job.prompt_len :])
        if job.constraint is not None:
            job.constraint.rollback(dropped)
        self._truncate_cache(job, keep)
        # Bans further on were made after another prefix: they no longer apply.
        bans = {p: b for p, b in job.position_bans.items() if p < position}
        bans[position] = job.position_bans.get(position, frozenset()) | {first}
        job.position_bans = bans
        allowed = None
        if job.constraint is not None:
            allowed = token_bitmask([job.constraint], self.model.config.vocab_size)[0]
        request = self._sample_request(job, allowed=allowed)
        (result,) = self.sampler.sample(row.unsqueeze(0), [request])
        t = result.token_id
        # With every token banned or masked, the sampler falls back past the bans (or to token 0).
        if t in bans[position] or (
            request.allowed is not None and not int(request.allowed[t // 32]) >> (t % 32) & 1
        ):
            raise InvalidRequestError(
                f"banned strings leave no token to write at output position {position} "
                f"(every allowed token starts {match.string!r})"
            )
        return result.token_id, result.logprob, row

    def _truncate_cache(self, job: JobState, keep: int) -> None:
        """Take the job's K/V back to its first `keep` tokens (the scheduler's truncate)."""
        if not self.scheduler.truncate(job, keep, self.cache.copy_prefix):
            self._on_preempt(job)
        self._forget_drafts(job)  # its drafter state saw the tokens taken back

    def _rewind_drafts(self, job: JobState, positions: list[int]) -> None:
        """A drafter keyed by pages forgets what it saw past a page the scheduler swapped."""
        if self.drafter is not None:
            for position in positions:
                self.drafter.rewind(job.job_id, position)

    def _on_preempt(self, job: JobState) -> None:
        self._forget_drafts(job)  # the scheduler has sent it back to the queue

    def _forget_drafts(self, job: JobState) -> None:
        if self.drafter is None:
            return
        try:
            self.drafter.forget(job.job_id)
        except Exception:
            # Its per-job state may linger; every job, this one included, can still run.
            logger.exception("job %s: the drafter failed to forget it", job.job_id[:8])

    # -- failures ------------------------------------------------------------------------------

    def _contain(self, job: JobState, where: str, exc: Exception, events: list[JobEvent]) -> None:
        """An exception while running `job` alone: fail the job (once), log the traceback, go on."""
        if job.stage is JobStage.FINISHED:  # its JobFinished is already in `events`
            logger.error("job %s: error while %s after it finished", job.job_id[:8], where, exc_info=exc)
            return
        logger.error("job %s failed while %s", job.job_id[:8], where, exc_info=exc)
        self._failed_jobs += 1
        if isinstance(exc, DyngenError):  # raised on purpose: its message is written for callers
            error = JobError(exc.kind, str(exc)[:_MAX_ERROR_CHARS])
        else:
            error = JobError(ErrorKind.INTERNAL, f"internal error while {where} ({type(exc).__name__})")
        events.append(self._finish(job, StopReason.ERROR, None, None, "", error))

    def _finish(
        self,
        job: JobState,
        reason: StopReason,
        token: int | None,
        stop_string: str | None,
        text: str,
        error: JobError | None = None,
    ) -> JobFinished:
        now = time.perf_counter()
        scheduled = job.scheduled_at if job.scheduled_at is not None else now
        first = job.first_token_at if job.first_token_at is not None else now
        finished = JobFinished(
            job_id=job.job_id,
            identifier=job.spec.identifier,
            stop_reason=reason,
            stop_token=token,
            stop_string=stop_string,
            prompt_tokens=job.prompt_len,
            new_tokens=job.new_tokens,
            cached_tokens=job.cached_tokens,
            timings=JobTimings(scheduled - job.enqueued_at, first - scheduled, now - first),
            text=text,
            accepted_draft_tokens=job.accepted_drafts,
            rejected_draft_tokens=job.rejected_drafts,
            error=error,
        )
        self.jobs.pop(job.job_id, None)
        try:
            self.scheduler.remove(job)  # FINISHED from here on
        except Exception:
            # The scheduler has let go of the job; only its pages' release failed.
            logger.exception("job %s: releasing its pages failed", job.job_id[:8])
        self._forget_drafts(job)
        return finished

    # -- convenience ---------------------------------------------------------------------------

    def generate(self, specs: Sequence[JobSpec]) -> list[Completion]:
        """Run jobs to completion together; results in the specs' order."""
        ids = [self.enqueue(s) for s in specs]
        texts: dict[JobId, list[str]] = {i: [] for i in ids}
        tokens: dict[JobId, list[int]] = {i: [] for i in ids}
        logprobs: dict[JobId, list[TokenLogprob]] = {i: [] for i in ids}
        done: dict[JobId, JobFinished] = {}
        while len(done) < len(ids):
            for event in self.iterate():
                if event.job_id not in texts:
                    continue
                match event:
                    case TokensGenerated():
                        texts[event.job_id].append(event.text)
                        tokens[event.job_id].extend(event.token_ids)
                        logprobs[event.job_id].extend(event.logprobs)
                    case JobFinished():
                        texts[event.job_id].append(event.text)
                        done[event.job_id] = event
                    case JobStarted() | PrefillProgress():
                        pass
        return [Completion(i, "".join(texts[i]), tuple(tokens[i]), tuple(logprobs[i]), done[i]) for i in ids]

    def warmup(self) -> None:
        """Run a few throwaway forwards so first requests don't pay one-time kernel setup."""
        bos = self.model.config.bos_token_id or 0
        for n in (1, 8):
            spec = JobSpec(prompt_ids=(bos,) * n, max_new_tokens=2, ignore_eos=True)
            self.generate([spec])

    def close(self) -> None:
        self.sampler.close()
        if self._masks is not None:
            self._masks.close()
