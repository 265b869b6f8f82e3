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
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine import defaults
from engine.adapters.adapter_registry import AdapterInfo, AdapterRegistry
from engine.adapters.lora_adapter import AdapterLimits, LoraAdapter
from engine.cache.kv_cache import KVCacheKind, PagedKVCache
from engine.cache.pages import PagePool
from engine.errors import (
    AdapterInUseError,
    DyngenError,
    ErrorKind,
    InvalidRequestError,
    JobNotFoundError,
)
from engine.forward_batch import SequenceInput
from engine.grammar.constraints import GrammarCompiler, MaskOverlap, MaskWorker
from engine.job_state import JobState
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
    SamplingSettings,
    SpecLimits,
    StopReason,
    TokenLogprob,
    TokensGenerated,
    new_job_id,
)
from engine.model.llama import LlamaModel
from engine.model.tokenizer import Tokenizer
from engine.output.text_stream import TextStream
from engine.output.token_healing import TokenHealer
from engine.output.token_intake import Outcome, TokenIntake
from engine.prompt.prompt_embeddings import span_token_ids
from engine.runner import ModelRunner
from engine.sampling.logit_processors import mix_guided
from engine.sampling.sampler import (
    DEFAULT_SAMPLER_MODE,
    Sampler,
    SampleRequest,
    SampleResult,
    SamplerMode,
    SamplerState,
)
from engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from engine.speculation.speculation_step import SpeculationStep
from engine.speculation.speculative import (
    Drafter,
    DrafterKind,
    DraftModelDrafter,
    NgramDrafter,
    SpeculationConfig,
)

logger = logging.getLogger(__name__)

_MAX_ERROR_CHARS = 200


# Ids appear in logs and metrics: printable, bounded, no separators to forge.
_JOB_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")


@dataclass(frozen=True)
class GeneratorConfig:
    page_size: int = defaults.PAGE_SIZE
    num_pages: int = 128
    max_seq_len: int | None = None  # default: the model's context length
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    sampling_threads: int = defaults.SAMPLING_THREADS
    sampler_mode: SamplerMode = DEFAULT_SAMPLER_MODE
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    # INT8: K/V stored as int8 with a float16 scale per token and head (the draft model's cache stays float).
    kv_cache: KVCacheKind = KVCacheKind.FLOAT
    # Constrained jobs' masks: beside the forward with a core to spare, else just before it.
    mask_overlap: MaskOverlap = MaskOverlap.AUTO
    max_adapters: int = defaults.MAX_ADAPTERS  # LoRA adapters loaded at once
    adapter_limits: AdapterLimits = field(default_factory=AdapterLimits)  # rank and bytes of one adapter
    adapter_dir: Path | None = None  # where run-time loads may read; None: none may

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
        # What every job must fit: the rule the front end applies too, from the engine's READY.
        self.limits = SpecLimits(
            model.config.vocab_size, model.config.hidden_size, self.max_seq_len, c.num_pages, c.page_size
        )
        self.scheduler = Scheduler(c.scheduler, self.pool)
        self.adapters = AdapterRegistry(
            model.config, c.max_adapters, model.device, c.adapter_limits, c.adapter_dir
        )
        self.sampler = Sampler(model.config.vocab_size, c.sampling_threads, c.sampler_mode)
        self.jobs: dict[JobId, JobState] = {}
        self.grammars = GrammarCompiler(tokenizer, model.config.vocab_size)
        self.healer = TokenHealer(tokenizer, model.config.vocab_size, self.grammars.ll_tokenizer)
        self._masks: MaskWorker | None = None  # its thread starts with the first constrained job
        self.mask_overlap = c.mask_overlap.resolve()
        self._eos = frozenset(model.config.eos_token_ids) | tokenizer.eos_token_ids
        self.intake = TokenIntake(self.sampler, self.healer, self._eos, model.config.vocab_size)
        self._orders = 0
        self._iterations = 0
        self._pending_events: list[JobEvent] = []
        self._failed_jobs = 0
        drafter: Drafter | None = None
        match c.speculation.kind:
            case DrafterKind.NONE:
                pass
            case DrafterKind.NGRAM:
                drafter = NgramDrafter(c.speculation.max_ngram)
            case DrafterKind.DRAFT_MODEL:
                if draft_model is None:
                    raise InvalidRequestError("speculation kind draft_model needs a draft model")
                drafter = DraftModelDrafter(draft_model, model.config.vocab_size, c.num_pages, c.page_size)
        self.speculation = SpeculationStep(
            c.speculation,
            drafter,
            self.scheduler,
            self.intake,
            self.sampler,
            model.config.vocab_size,
            self._contain,
        )

    @property
    def drafter(self) -> Drafter | None:
        return self.speculation.drafter

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
        spec.check(self.limits)  # the front end's rule too (engine/jobs.py)
        adapter = self.adapters.get(spec.adapter) if spec.adapter is not None else None
        # Compiled (or taken from the cache) here: a bad schema is the caller's error, at enqueue.
        constraint = self.grammars.compile(spec.response_format) if spec.response_format is not None else None
        heal = self.healer.plan(spec.prompt_ids) if spec.token_healing else None
        if heal is not None:  # the job runs on the prompt less its last token
            spec = dataclasses.replace(spec, prompt_ids=heal.prompt_ids)
        if job_id is None:
            job_id = new_job_id()
        embeds = self._embedding_spans(spec) if spec.embeddings else ()
        tokens = list(spec.prompt_ids)
        for (
            e
        ) in spec.embeddings:  # their positions take pseudo ids, which the prefix cache hashes like tokens
            tokens[e.position : e.end] = span_token_ids(e)
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
            tokens=tokens,
            constraint=constraint,
            heal=heal,
            healing=heal.removed if heal is not None else b"",
            adapter=adapter,
            embeds=embeds,
        )
        if spec.guidance is not None:
            job.negative = self._negative_sequence(job)
        self.scheduler.submit(job)
        self.jobs[job_id] = job
        return job_id

    def _embedding_spans(self, spec: JobSpec) -> tuple[tuple[int, torch.Tensor], ...]:
        """The job's prompt embeddings as tensors, by start position."""
        hidden = self.model.config.hidden_size
        spans = []
        for i, e in enumerate(spec.embeddings):
            values = torch.frombuffer(bytearray(e.data), dtype=torch.float32).view(e.rows, hidden)
            if not bool(torch.isfinite(values).all()):
                raise InvalidRequestError(
                    f"embeddings[{i}].data: holds values that are not finite (NaN or inf)"
                )
            spans.append((e.position, values))
        return tuple(spans)

    def _negative_sequence(self, job: JobState) -> JobState:
        """A guided job's second sequence: its negative prompt, then (as they come) its output tokens;
        run with the job's adapter and cache salt, never sampled (engine/prompt/guidance.py)."""
        spec = job.spec
        assert spec.guidance is not None
        ids = spec.guidance.negative_prompt_ids
        return JobState(
            job_id=JobId(f"{job.job_id}-negative"),
            spec=JobSpec(
                prompt_ids=ids,
                max_new_tokens=spec.max_new_tokens,
                cache_salt=spec.cache_salt,
                adapter=spec.adapter,
                priority=spec.priority,
                tenant=spec.tenant,
            ),
            sampler=SamplerState(SamplingSettings(), (), self.model.config.vocab_size),
            text=TextStream(self.tokenizer, (), True, (), ""),
            enqueued_at=job.enqueued_at,
            order=0,
            tokens=list(ids),
            started=True,  # it reports nothing: the job's events are the job's alone
            adapter=job.adapter,
            positive=job,
        )

    # -- LoRA adapters -------------------------------------------------------------------------

    def load_adapter(self, name: str, path: Path) -> LoraAdapter:
        """Load a PEFT adapter folder under `name` for jobs to name (see adapter_registry.py)."""
        return self.adapters.load(name, path)

    def unload_adapter(self, name: str) -> None:
        """Forget an adapter; refused (AdapterInUseError) while a queued or running job uses it."""
        adapter = self.adapters.get(name)
        users = sum(1 for j in self.jobs.values() if j.adapter is adapter)
        if users:
            raise AdapterInUseError(
                f"adapter {name!r} is in use by {users} job(s); unload it when they end, or cancel them"
            )
        self.adapters.remove(name)

    def adapter_infos(self) -> list[AdapterInfo]:
        uses = Counter(j.adapter.name for j in self.jobs.values() if j.adapter is not None)
        return [AdapterInfo(a.name, a.label, a.describe(), uses[a.name]) for a in self.adapters.adapters()]

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
            running=sum(1 for j in self.scheduler.running if j.positive is None),  # jobs, not rows
            pages_free=p.free,
            pages_cached=p.cached,
            pages_used=p.referenced,
            forwarded_tokens=self.runner.forwarded_tokens,
            iterations=self._iterations,
            prefix_hit_tokens=p.prefix_hit_tokens,
            prefix_query_tokens=p.prefix_query_tokens,
            accepted_draft_tokens=self.speculation.accepted,
            rejected_draft_tokens=self.speculation.rejected,
            failed_jobs=self._failed_jobs,
        )

    def check_invariants(self) -> None:
        sequences = [s for j in self.jobs.values() for s in (j, j.negative) if s is not None]
        holds = [s.prefix_copy.source for s in sequences if s.prefix_copy is not None]
        self.pool.check_invariants((s.pages for s in sequences if s.pages), holds)

    # -- one iteration -------------------------------------------------------------------------

    def iterate(self) -> list[JobEvent]:
        """Run one forward over this iteration's chunks; return the events it produced.

        A fault while running one job (its forward, sampling, text, stop checks, drafts) fails that
        job alone (StopReason.ERROR); every other job goes on as if it had not happened.
        """
        events, self._pending_events = self._pending_events, []
        self.speculation.plan()
        chunks = self.speculation.draft(self.scheduler.schedule(on_preempt=self._on_preempt), events)
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
        if any(seq.adapter is not None for _, seq in staged):
            # Each adapter's rows side by side: its deltas then run on one slice of the batch.
            staged.sort(key=lambda cs: 0 if cs[1].adapter is None else cs[1].adapter.uid)
        self._iterations += 1
        masks = self._start_masks(staged)
        if masks is not None and self.mask_overlap is MaskOverlap.BEFORE:
            wait([masks])  # no core to spare: the worker would stall the forward's threads
        sampled: list[_StepOutput] = []
        negatives: dict[JobState, _StepOutput] = {}  # guided job -> its negative sequence's row
        for out in self._forward(staged, events):
            job, seq = out.chunk.job, out.seq
            try:
                if job.positive is not None:  # a negative sequence: its row waits for its job's
                    self.scheduler.advance(job, seq.end_pos)
                    if seq.want_logits:
                        negatives[job.positive] = out
                    continue
                if out.chunk.draft:
                    logits = out.logits[out.row : out.row + seq.logit_positions]
                    self._apply(job, self.speculation.verify(job, out.chunk.draft, logits, events), events)
                    continue
                self.speculation.rewind(job, self.scheduler.advance(job, seq.end_pos))
                if seq.want_logits:
                    sampled.append(out)
                elif job.computed <= job.prompt_len:
                    events.append(
                        PrefillProgress(job.job_id, job.spec.identifier, job.computed, job.prompt_len)
                    )
            except Exception as exc:
                self._contain(job, "taking its step's results", exc, events)
        if sampled:
            if negatives or any(o.chunk.job.negative is not None for o in sampled):
                sampled = self._guide(sampled, negatives, events)
            self._sample(sampled, events, masks)
        elif masks is not None:
            masks.result()  # nobody samples after all (failed forwards): let the worker finish
        return events

    def _guide(
        self, sampled: list[_StepOutput], negatives: dict[JobState, _StepOutput], events: list[JobEvent]
    ) -> list[_StepOutput]:
        """Replace each guided job's logits row by its mix with its negative sequence's row, in place
        (so every later step, masks and kept rows for rewinds, sees the guided distribution)."""
        guided: list[tuple[_StepOutput, _StepOutput]] = []
        scales: list[float] = []
        kept: list[_StepOutput] = []
        for out in sampled:
            job = out.chunk.job
            if job.negative is None or job.spec.guidance is None:
                kept.append(out)
            elif job.stage is JobStage.FINISHED:  # failed with its negative sequence's share
                continue
            elif (negative := negatives.get(job)) is None:
                error = RuntimeError("its negative sequence's logits are not in the same forward")
                self._contain(job, "guiding its sampling", error, events)
            else:
                guided.append((out, negative))
                scales.append(job.spec.guidance.scale)
        if not guided:
            return kept
        try:
            cond = torch.stack([o.logits[o.row] for o, _ in guided])
            uncond = torch.stack([n.logits[n.row] for _, n in guided])
            mixed = mix_guided(cond, uncond, torch.tensor(scales))
            inference = guided[0][0].logits.is_inference()  # the forward's logits are inference tensors
            with torch.inference_mode(inference):
                for i, (o, _) in enumerate(guided):
                    o.logits[o.row].copy_(mixed[i])
        except Exception as exc:
            for o, _ in guided:
                self._contain(o.chunk.job, "guiding its sampling", exc, events)
            return kept
        return kept + [o for o, _ in guided]

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
            return SequenceInput(tokens, job.computed, job.pages, True, len(tokens), job.adapter)
        start, end = job.computed, job.computed + c.num_tokens
        embeds = tuple(
            (max(at, start) - start, values[max(at, start) - at : min(at + len(values), end) - at])
            for at, values in job.embeds
            if at < end and at + len(values) > start
        )
        return SequenceInput(
            job.tokens[start:end], start, job.pages, end == len(job.tokens), 1, job.adapter, embeds
        )

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
                ready.append((out, self.intake.sample_request(job, allowed=allowed.get(job.job_id))))
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
                job = out.chunk.job
                self._apply(
                    job,
                    self.intake.accept(job, result.token_id, result.logprob, events, out.logits[out.row]),
                    events,
                )
                if job.negative is not None and (keep := self.intake.follow_output(job)) is not None:
                    self._truncate_cache(job.negative, keep)
            except Exception as exc:
                self._contain(out.chunk.job, "taking its sampled token", exc, events)

    def _apply(self, job: JobState, outcome: Outcome, events: list[JobEvent]) -> None:
        """Do what a job's taken tokens call for: its K/V taken back past a rewind, then its end."""
        if outcome.keep is not None:
            self._truncate_cache(job, outcome.keep)
        if outcome.stop is not None:
            s = outcome.stop
            events.append(self._finish(job, s.reason, s.token, s.stop_string, s.text))

    def _truncate_cache(self, job: JobState, keep: int) -> None:
        """Take the job's K/V back to its first `keep` tokens (the scheduler's truncate)."""
        if not self.scheduler.truncate(job, keep, self.cache.copy_prefix):
            self._on_preempt(job.positive or job)  # preempted, with its pair if guided
        self.speculation.forget(job.positive or job)  # its drafter state saw the tokens taken back

    def _on_preempt(self, job: JobState) -> None:
        self.speculation.forget(job)  # the scheduler has sent it back to the queue

    # -- failures ------------------------------------------------------------------------------

    def _contain(self, job: JobState, where: str, exc: Exception, events: list[JobEvent]) -> None:
        """An exception while running `job` alone: fail the job (once), log the traceback, go on.
        A negative sequence's failure is its guided job's."""
        job = job.positive or job
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
            adapter=job.spec.adapter,
        )
        self.jobs.pop(job.job_id, None)
        try:
            self.scheduler.remove(job)  # FINISHED from here on
        except Exception:
            # The scheduler has let go of the job; only its pages' release failed.
            logger.exception("job %s: releasing its pages failed", job.job_id[:8])
        self.speculation.forget(job)
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
