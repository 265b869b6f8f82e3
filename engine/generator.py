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

import logging
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import wait
from pathlib import Path

from engine.adapters.adapter_registry import AdapterInfo, AdapterRegistry
from engine.adapters.lora_adapter import LoraAdapter
from engine.cache.kv_cache import PagedKVCache
from engine.cache.kv_events import BlockStored, KvEvent
from engine.cache.pages import PagePool
from engine.completion import Completion, finished_event, run_to_completion
from engine.device import describe_device
from engine.errors import (
    AdapterInUseError,
    DyngenError,
    ErrorKind,
    InvalidRequestError,
    JobNotFoundError,
)
from engine.forward_batch import SequenceInput
from engine.generator_config import GeneratorConfig, GeneratorStats
from engine.grammar.constraints import GrammarCompiler, MaskOverlap
from engine.guided_pair import guide
from engine.job_builder import JobBuilder
from engine.job_state import JobState
from engine.jobs import (
    JobError,
    JobEvent,
    JobFinished,
    JobId,
    JobSpec,
    JobStage,
    JobStarted,
    PrefillProgress,
    SpecLimits,
    StopReason,
    new_job_id,
)
from engine.model.llama import LlamaModel
from engine.model.tokenizer import Tokenizer
from engine.output.token_healing import TokenHealer
from engine.output.token_intake import Outcome, TokenIntake
from engine.prompt_depth_cost import PromptDepthCost
from engine.prompt_depth_timing import METHOD as PROMPT_DEPTH_METHOD
from engine.prompt_depth_timing import (
    can_time,
    read_prompt_depth,
    time_prompt_depth,
    write_prompt_depth,
)
from engine.runner import ModelRunner
from engine.sampling.sampler import (
    Sampler,
)
from engine.sampling.step_sampling import StepSampling, Taken
from engine.scheduled_chunk import ScheduledChunk
from engine.scheduler import Scheduler
from engine.sequence import SequenceState
from engine.speculation.draft_policy import KV_READ_BYTES_PER_SECOND, StepCost
from engine.speculation.speculation_step import SpeculationStep, make_drafter
from engine.speculation.speculative import (
    Drafter,
)
from engine.speculation.step_cost_store import StepCostKey, read_step_cost, step_cost_what, write_step_cost
from engine.step_failure import StepFailure
from engine.step_forward import Staged, StepOutput, run_forward
from engine.timing_key import TimingKey

__all__ = ["Completion", "DynamicGenerator", "GeneratorConfig", "GeneratorStats"]

logger = logging.getLogger(__name__)

_MAX_ERROR_CHARS = 200
STEP_COST_RETIMES = 2  # further timings of a warm-up step size that looked disturbed


# Ids appear in logs and metrics: printable, bounded, no separators to forge.
_JOB_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")


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
        self.builder = JobBuilder(
            tokenizer, self.grammars, self.healer, model.config.vocab_size, model.config.hidden_size
        )
        self.mask_overlap = c.mask_overlap.resolve()
        self._eos = frozenset(model.config.eos_token_ids) | tokenizer.eos_token_ids
        self.intake = TokenIntake(self.sampler, self.healer, self._eos, model.config.vocab_size)
        self.sampling = StepSampling(self.sampler, self.intake, model.config.vocab_size)
        self._orders = 0
        self._iterations = 0
        self._pending_events: list[JobEvent] = []
        self._failed_jobs = 0
        drafter = make_drafter(c.speculation, draft_model, model.config.vocab_size, c.num_pages, c.page_size)
        self.speculation = SpeculationStep(
            c.speculation,
            drafter,
            self.scheduler,
            self.intake,
            self.sampler,
            model.config.vocab_size,
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
        job = self.builder.build(spec, job_id or new_job_id(), adapter)
        if spec.resume_output:  # a job an earlier engine ran: its output so far, taken as its own
            self.intake.resume(job, spec.resume_output)
        self.scheduler.submit(job)
        self.jobs[job.job_id] = job
        return job.job_id

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

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The tokens that end a job (the model's and the tokenizer's), unless it ignores EOS."""
        return self._eos

    def has_work(self) -> bool:
        return not self.scheduler.idle() or bool(self._pending_events)

    def stats(self) -> GeneratorStats:
        p = self.pool.stats()
        return GeneratorStats(
            queued=len(self.scheduler.queue),
            running=len(self.scheduler.running),  # jobs, not rows
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
            preemptions=self.scheduler.preemptions,
        )

    def kv_events(self, since: int) -> list[tuple[int, KvEvent]] | None:
        """The prefix cache's KV events numbered `since` and after; None if some are gone."""
        return self.scheduler.cache.events(since)

    def kv_events_next(self) -> int:
        """The number the next KV event will get."""
        return self.scheduler.cache.events_next()

    def kv_snapshot(self) -> list[BlockStored]:
        """Every findable page as its BlockStored, parents first."""
        return self.scheduler.cache.snapshot()

    def flush_prefix_cache(self) -> int:
        """Drop the cached prefix pages no job holds; returns how many."""
        return self.scheduler.cache.flush()

    def check_invariants(self) -> None:
        sequences = [s for j in self.jobs.values() for s in j.rows]
        holds = [s.prefix_copy.source for s in sequences if s.prefix_copy is not None]
        self.pool.check_invariants((s.pages for s in sequences if s.pages), holds)

    # -- one iteration -------------------------------------------------------------------------

    def iterate(self, before_forward: Callable[[list[JobEvent]], None] | None = None) -> list[JobEvent]:
        """Run one forward over this iteration's chunks; return the events it produced.

        `before_forward`: handed the step's events so far before its forward runs, when a job starts
        in it (the engine process sends them at once, so that even a crash inside the forward leaves
        the front end knowing which jobs ran); they are not returned again.

        A fault while running one job (its forward, sampling, text, stop checks, drafts) fails that
        job alone (StopReason.ERROR); every other job goes on as if it had not happened. The step
        reads schedule -> stage -> forward -> (guide) -> sample -> intake -> apply: each part
        returns what it did, its faults as StepFailures, and calls back into nothing.
        """
        started = time.perf_counter()
        events, self._pending_events = self._pending_events, []
        self.speculation.plan()
        chunks, failures = self.speculation.draft(self.scheduler.schedule(on_preempt=self._on_preempt))
        self._contain_all(failures, events)
        if not chunks:
            return events
        now = time.perf_counter()
        staged: Staged = []
        for c in chunks:
            try:
                staged.append((c, self._stage(c, now, events)))
            except Exception as exc:
                self._contain(c.job, "preparing its step", exc, events)
        if not staged:
            return events
        # A step of decode rows (and drafts) only: its time teaches adaptive speculation's cost table.
        decode_only = self.speculation.learns_cost() and all(c.seq.decoding for c, _ in staged)
        if any(seq.adapter is not None for _, seq in staged):
            # Each adapter's rows side by side: its deltas then run on one slice of the batch.
            staged.sort(key=lambda cs: 0 if cs[1].adapter is None else cs[1].adapter.uid)
        self._iterations += 1
        masks = self.sampling.start_masks(staged)
        if masks is not None and self.mask_overlap is MaskOverlap.BEFORE:
            wait([masks])  # no core to spare: the worker would stall the forward's threads
        if before_forward is not None and any(isinstance(e, JobStarted) for e in events):
            before_forward(events[:])
            events.clear()
        outputs, failures = run_forward(self.runner, staged)
        self._contain_all(failures, events)
        sampled: list[StepOutput] = []
        negatives: dict[JobState, StepOutput] = {}  # guided job -> its negative sequence's row
        for out in outputs:
            job, seq = out.chunk.job, out.seq
            try:
                if out.chunk.negative:  # the negative sequence's row waits for its job's own
                    self.scheduler.advance(out.chunk.seq, seq.end_pos)
                    if seq.want_logits:
                        negatives[job] = out
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
                sampled, failures = guide(sampled, negatives)
                self._contain_all(failures, events)
            taken, failures = self.sampling.sample(sampled, masks)
            self._contain_all(failures, events)
            self._take(taken, events)
        elif masks is not None:
            masks.result()  # nobody samples after all (failed forwards): let the worker finish
        if decode_only:
            self.speculation.observe(
                sum(c.num_tokens for c, _ in staged),
                time.perf_counter() - started,
                sum(seq.end_pos for _, seq in staged),  # the keys each sequence's rows read
            )
        return events

    def _stage(self, c: ScheduledChunk, now: float, events: list[JobEvent]) -> SequenceInput:
        """The model input of one chunk (and the job's start event, the first time it runs)."""
        job, row = c.job, c.seq
        self.scheduler.begin_chunk(c, self.cache.copy_prefix)
        if not job.started and not c.negative:  # the job starts with its own row
            job.started = True
            job.scheduled_at = now
            events.append(JobStarted(job.job_id, job.spec.identifier, job.prompt_len, job.cached_tokens))
        if c.draft:
            tokens = [*row.tokens[row.computed :], *c.draft]
            return SequenceInput(tokens, row.computed, row.pages, True, len(tokens), job.adapter)
        start, end = row.computed, row.computed + c.num_tokens
        embeds = tuple(
            (max(at, start) - start, values[max(at, start) - at : min(at + len(values), end) - at])
            for at, values in row.embeds
            if at < end and at + len(values) > start
        )
        return SequenceInput(
            row.tokens[start:end], start, row.pages, end == len(row.tokens), 1, job.adapter, embeds
        )

    def _take(self, taken: Taken, events: list[JobEvent]) -> None:
        """Each sampled token taken by its job (token intake), and its outcome applied."""
        for out, result in taken:
            job = out.chunk.job
            try:
                outcome = self.intake.accept(
                    job, result.token_id, result.logprob, events, out.logits[out.row]
                )
                self._apply(job, outcome, events)
                if job.negative is not None and (keep := self.intake.follow_output(job)) is not None:
                    self._truncate_cache(job, keep, job.negative)
            except Exception as exc:
                self._contain(job, "taking its sampled token", exc, events)

    def _apply(self, job: JobState, outcome: Outcome, events: list[JobEvent]) -> None:
        """Do what a job's taken tokens call for: its K/V taken back past a rewind, then its end."""
        if outcome.keep is not None:
            self._truncate_cache(job, outcome.keep, job)
        if outcome.stop is not None:
            s = outcome.stop
            events.append(self._finish(job, s.reason, s.token, s.stop_string, s.text))

    def _truncate_cache(self, job: JobState, keep: int, row: SequenceState) -> None:
        """Take a row of the job back to its first `keep` tokens' K/V (the scheduler's truncate)."""
        if not self.scheduler.truncate(job, row, keep, self.cache.copy_prefix):
            self._on_preempt(job)  # preempted, all its rows
        self.speculation.forget(job)  # its drafter state saw the tokens taken back

    def _on_preempt(self, job: JobState) -> None:
        self.speculation.forget(job)  # the scheduler has sent it back to the queue

    # -- failures ------------------------------------------------------------------------------

    def _contain_all(self, failures: list[StepFailure], events: list[JobEvent]) -> None:
        for f in failures:
            self._contain(f.job, f.where, f.error, events)

    def _contain(self, job: JobState, where: str, exc: Exception, events: list[JobEvent]) -> None:
        """An exception while running `job` alone: fail the job (once), log the traceback, go on.
        A fault in either row of a guided job is the job's."""
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
        finished = finished_event(job, reason, token, stop_string, text, error)
        self.speculation.finished(job)
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
        """Run jobs to completion together; results in the specs' order. All or nothing: if one spec
        is refused, those enqueued before it are cancelled, and the error's `spec_index` says which."""
        ids: list[JobId] = []
        try:
            for spec in specs:
                ids.append(self.enqueue(spec))
        except DyngenError as exc:
            for job_id in ids:
                self.cancel(job_id)
            mine = set(ids)  # their CANCELLED finishes go to no one: no caller knows these jobs
            self._pending_events = [e for e in self._pending_events if e.job_id not in mine]
            exc.spec_index = len(ids)
            raise
        return run_to_completion(ids, self.iterate)

    def warmup(self, step_costs: Path | None = None) -> None:
        """Run a few throwaway forwards so first requests don't pay one-time kernel setup; time
        prompt slices by depth for the scheduler's price of them and, with adaptive speculation,
        plain steps of growing batches for its cost model, or read what an earlier start timed
        from `step_costs` (a folder; None: always timed)."""
        bos = self.model.config.bos_token_id or 0
        # Throwaway outputs are no text for other jobs' drafts to copy: ~70 runs of BOS tokens
        # in the n-gram drafter's corpus cost every draft request their indexing and matching.
        self.speculation.keeps_outputs = False
        try:
            for n in (1, 8):
                spec = JobSpec(prompt_ids=(bos,) * n, max_new_tokens=2, ignore_eos=True)
                self.generate([spec])
            depth_cost = self._prompt_depth_cost(step_costs)
            if depth_cost is not None:
                self.scheduler.price_prompts(depth_cost)
            if self.speculation.wants_cost() and self.scheduler.idle():
                cost = self._step_cost(bos, step_costs)
                if cost is not None:  # else drafts keep their fixed length
                    self.speculation.measured(cost)
        finally:
            self.speculation.keeps_outputs = True

    def _timing_key(self, what: str) -> TimingKey:
        m, cache = self.model, self.cache
        return TimingKey.make(
            what, m.timing_key, describe_device(m.device), f"{cache.kind.value}|{cache.dtype}"
        )

    def _prompt_depth_cost(self, folder: Path | None) -> PromptDepthCost | None:
        """The price of prompt slices by depth (engine/prompt_depth_timing.py): read back from
        `folder`, else timed. None where it cannot be timed: a busy generator, no prefix cache, a
        pool, context or forward too small for the slices."""
        page, scheduling = self.config.page_size, self.scheduler.config
        if not (
            self.scheduler.idle()
            and scheduling.prefix_cache
            and can_time(page, self.max_seq_len, self.pool.num_pages * page, scheduling.max_chunk_size)
        ):
            return None
        key = self._timing_key(PROMPT_DEPTH_METHOD) if folder is not None else None
        if key is not None:
            kept = read_prompt_depth(key, folder)
            if kept is not None:
                return kept
        cost = time_prompt_depth(
            self.enqueue, self.iterate, self.has_work, self.model.config.vocab_size, page
        )
        if key is not None:
            write_prompt_depth(key, folder, cost)
        return cost

    def _step_cost(self, bos: int, folder: Path | None) -> StepCost | None:
        """Seconds of a decode step of 1, 2, 4, ... rows up to the batch (or twice the most jobs that
        speculate: the table's last slope goes on past it): the best of four steps each (a single
        step's time on a shared 2-core machine can double), made non-decreasing. None where the
        queue or the pool holds fewer than two such jobs. On the CPU its keys' rate starts at the
        cache's bytes per token read at KV_READ_BYTES_PER_SECOND (these steps' keys are too few to
        show it); served steps correct both.

        A step of more rows never costs more per row than a smaller one (its weights are read once
        for all rows): a size whose time breaks that was timed while something else held the
        cores, and is timed again (STEP_COST_RETIMES times at most), then held to the bound. One such table
        (8 rows at 45 ms against 4.4) kept a batch-1 run's drafts short for its whole life."""
        top = min(
            self.scheduler.config.max_batch_size,
            self.scheduler.config.max_q_size,  # each size's jobs wait in the queue together
            self.pool.num_pages // 2,
            2 * self.config.speculation.max_batch_size,
        )
        if top < 2:
            return None  # no batch to time: a queue or pool this small
        sizes = sorted({n for n in (1, 2, 4, 8, 16, 32, 64, 128) if n <= top} | {max(top, 2)})
        key: StepCostKey | None = None
        if folder is not None:
            key = StepCostKey(self._timing_key(step_cost_what(sizes)), tuple(sizes))
            kept = read_step_cost(key, folder)
            if kept is not None:
                return kept
        rows: list[int] = []
        seconds: list[float] = []
        self.speculation.paused = True  # plain steps only
        try:
            for n in sizes:
                best = self._time_step(bos, n)
                if rows:
                    bound = seconds[-1] * n / rows[-1]  # the smaller size's cost per row
                    for _ in range(STEP_COST_RETIMES):
                        if best <= bound:
                            break
                        best = min(best, self._time_step(bos, n))
                    best = min(max(best, seconds[-1]), bound)
                rows.append(n)
                seconds.append(best)
        finally:
            self.speculation.paused = False
        # The rate is a CPU's; on a GPU the keys' term starts at 0 (and so stays there: the split
        # by shares gives it none of the error) and the table alone prices steps.
        cpu = self.model.device.type == "cpu"
        per_key = self.cache.bytes_per_token / KV_READ_BYTES_PER_SECOND if cpu else 0.0
        cost = StepCost(tuple(rows), tuple(seconds), per_key)
        if key is not None:
            write_step_cost(key, folder, cost)
        return cost

    def _time_step(self, bos: int, n: int) -> float:
        """The best of four decode steps of n one-token jobs (their prompt step untimed)."""
        for _ in range(n):
            self.enqueue(JobSpec(prompt_ids=(bos,), max_new_tokens=5, ignore_eos=True))
        self.iterate()  # the prompts, one row each
        times = []
        for _ in range(4):
            t0 = time.perf_counter()
            self.iterate()
            times.append(time.perf_counter() - t0)
        while self.has_work():
            self.iterate()
        return min(times)

    def close(self) -> None:
        self.sampler.close()
        self.sampling.close()
