"""Which jobs run in the next forward, with how many tokens each: the policy. Where their K/V
live is the cache manager's (engine/cache/cache_manager.py); the scheduler asks it for room.

There is no prefill phase and no decode phase: every job has tokens in the cache and
tokens it wants there (the prompt, then each sampled token), and each iteration hands
out a token budget (`max_chunk_size`) so the first catches up with the second. Decode
tokens of running jobs come first (one each, cheap, latency-critical), then prefill
chunks of running jobs, then new jobs admitted from the queue in turn. A forward that carries
decode steps carries prompt slices costing at most what `prefill_while_decoding` prompt tokens from
depth 0 cost, a deeper token costing more (its attention reads more keys:
engine/prompt_depth_cost.py), so a long arriving prompt stalls the running streams a bounded slice
at a time, not for its whole prefill, and its last slices no longer than its first; a forward with no
decode step carries prompt work the warm-up timed at `prefill_alone_ms` (so a request arriving beside a
long prefill waits for a short forward); and no forward costs more than `max_chunk_size` prompt tokens
from depth 0. The first prompt that will not finish
in a forward (in arrival order) takes at most all but `prompt_reserve` of its budget, leaving that
share to the prompts behind it that have fewer tokens left than it will have (a queued one less its
prefix hits), shortest first (running ones, and the queue's head in turn), so a short request
starts beside a long prefill rather than after it. What they leave, it takes back, so alone it
loses nothing; a prompt no shorter waits for it as in arrival order (a queued one is not admitted
meanwhile, so long prompts do not pile up part-computed, holding pages, and shorter ones after it
in the queue may pass it), and the oldest unfinished prompt always keeps its share, so none
starves. The scheduler alone
writes a job's progress (`computed`, `stage`, `order`, `preemptions`, `draft_budget`).

When the pool runs dry, a running job is preempted: its pages go back (full ones stay
findable, so its recompute is mostly a prefix hit) and it waits in the queue with its output kept.

Admission fairness (`max_skips`): a job whose prompt does not fit yet may be passed by smaller
jobs of its tenant and priority behind it at most max_skips times; then the queue waits for it.

Whose turn it is, and who may wait: engine/fair_queue.py (tenants by weighted served tokens, then
priority with aging, then arrival; queue caps); who gives way when there is no room:
engine/preemption.py.

Guided jobs (classifier-free guidance) are one job with two rows (`JobState.rows`): their own and
their negative sequence, each with its own pages, admitted, preempted and removed as one job that
counts two rows of the batch. Both rows reach their last token in the same forward, since the job
samples from the two rows' logits: until both can, each keeps its last token back.
"""

from __future__ import annotations

__all__ = ["ScheduledChunk", "Scheduler", "SchedulerConfig"]

from collections.abc import Callable
from dataclasses import dataclass, replace

from engine.cache.cache_manager import CacheManager, CopyPrefix
from engine.cache.pages import PagePool
from engine.fair_queue import FairQueue
from engine.job_state import JobState
from engine.jobs import JobStage
from engine.preemption import displaced_by, first_victim, rows
from engine.prompt_depth_cost import PromptDepthCost
from engine.scheduled_chunk import ScheduledChunk
from engine.scheduler_config import SchedulerConfig
from engine.sequence import SequenceState

# Queued prompts no shorter than the held-back one that one forward looks past for a shorter one.
_PASS_AT_MOST = 8


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: PagePool) -> None:
        self.config = config
        self.cache = CacheManager(pool, config.prefix_cache)
        self.queue = FairQueue(config.priority_aging, dict(config.tenant_weights))
        self.running: list[JobState] = []
        self._admitted = 0
        self.preemptions = 0  # jobs sent back to the queue since start (the metrics' counter)
        self.prompt_cost = PromptDepthCost()  # depth free until the warm-up times it

    def price_prompts(self, cost: PromptDepthCost) -> None:
        """Price prompt slices by their depth, and bound a forward with no decode step by their time
        (the warm-up's timing)."""
        self.prompt_cost = cost

    @property
    def alone_tokens(self) -> int:
        """A forward's prompt budget with no decode step, in depth-0 tokens (prefill_alone_ms of them)."""
        c = self.config
        return self.prompt_cost.alone_tokens(c.prefill_alone_ms, c.prefill_while_decoding, c.max_chunk_size)

    def describe_slices(self) -> str:
        reserve = self.config.prompt_reserve
        held = (
            f"; an unfinished prompt leaves {reserve:.0%} of each to shorter ones behind it"
            if reserve
            else ""
        )
        return self.prompt_cost.describe(self.config.prefill_while_decoding, self.alone_tokens) + held

    def submit(self, job: JobState) -> None:
        self.queue.enter(job, self.config.max_q_size, self.config.tenant_queue_cap)

    def remove(self, job: JobState) -> None:
        """Take a job out (finish or cancel) and give its rows' pages back; it is FINISHED from here
        on, even if giving the pages back fails."""
        if job.stage is not JobStage.FINISHED:
            self.queue.left(job.spec.tenant)
        job.stage = JobStage.FINISHED
        if job in self.running:
            self.running.remove(job)
        elif job in self.queue:
            self.queue.remove(job)
        self._release_rows(job)

    # -- the generator's reports: progress and pages are written here only ----------------------

    def begin_chunk(self, chunk: ScheduledChunk, copy_prefix: CopyPrefix) -> None:
        """Before a scheduled chunk runs: the cache copies its row's partial prefix hit found at
        admission; the job's stage follows its own row's progress."""
        self.cache.begin(chunk.seq, copy_prefix)
        job = chunk.job
        job.stage = JobStage.DECODE if job.computed >= job.prompt_len else JobStage.PREFILL

    def set_draft_budget(self, job: JobState, tokens: int) -> None:
        """Draft tokens `job` may verify with its next decode step (0: it does not speculate)."""
        job.draft_budget = tokens

    def advance(self, seq: SequenceState, computed: int) -> list[int]:
        """A row's K/V now hold its first `computed` tokens (a forward ran; after speculation,
        the verified ones only: a rejected tail is overwritten later, and no page holding it is
        registered before then). Newly filled pages are registered; returns the token positions
        where a page was swapped for an identical registered one (a drafter keyed by pages rewinds)."""
        seq.computed = computed
        return self.cache.commit(seq)

    def truncate(self, job: JobState, seq: SequenceState, keep: int, copy_prefix: CopyPrefix) -> bool:
        """Make a row of `job` hold at most its first `keep` tokens' K/V and its pages writable past
        them (the cache manager's `truncate`). No page to copy into: the job is preempted (False),
        and its re-admission recomputes what it keeps (mostly prefix hits)."""
        seq.computed = min(seq.computed, keep)
        if self.cache.truncate(seq, keep, copy_prefix):
            return True
        self.preempt(job)
        return False

    def inflight_pages(self) -> int:
        """Prompt pages running jobs are computing that queued jobs may wait for."""
        return self.cache.inflight_pages()

    def idle(self) -> bool:
        return not self.running and not self.queue

    def prompts_pending(self) -> bool:
        """Whether a prompt waits for the model: a queued job, or a running one still prefilling."""
        return bool(self.queue) or not all(self._decoding(j) for j in self.running)

    def schedule(self, on_preempt: Callable[[JobState], None]) -> list[ScheduledChunk]:
        """The next forward's chunks. Jobs preempted to make room are reported to `on_preempt`."""
        budget = _Budget.of(self.config.max_chunk_size, self.alone_tokens, self.prompt_cost)
        chunks: list[ScheduledChunk] = []
        for job in self.running:
            for seq in job.rows:
                self.cache.settle(seq)
        # 0. A waiting job that outranks a running one, or whose tenant is short of its share of the
        #    batch, takes a running job's place if there is no room for it.
        self._admit_by_preemption(on_preempt)
        # 1. Decode steps, highest priority and oldest first: each may need one more page; the pool
        #    running dry preempts the lowest-priority, newest job (never one already scheduled).
        #    A speculating job asks for room for its drafts too (verified in the same step).
        decoding = (j for j in self.running if self._decoding(j))
        for job in sorted(decoding, key=lambda j: (-j.spec.priority, j.order)):
            if budget.left < 1 or job.stage is JobStage.QUEUED:  # preempted for an older job's page
                continue
            negative = job.negative
            if negative is None:
                take = min(1 + job.draft_budget, budget.left)
                if not self._ensure_pages(job, job, job.computed + take, on_preempt):
                    continue
                chunks.append(ScheduledChunk(job, take))
                self.queue.charge(job.spec.tenant, take)
                budget.decode(take)
                continue
            if budget.left < 2:  # both rows or neither
                continue
            if not (
                self._ensure_pages(job, job, job.computed + 1, on_preempt)
                and self._ensure_pages(job, negative, negative.computed + 1, on_preempt)
            ):
                continue
            chunks += (ScheduledChunk(job, 1), ScheduledChunk(job, 1, negative=True))
            self.queue.charge(job.spec.tenant, 2)
            budget.decode(2)
        if chunks:  # streams are decoding: prompts go in slices beside them, priced by depth
            budget.beside_decoding(self.config.prefill_while_decoding)
        # 2. Prefill chunks of running jobs (their prompt pages were taken at admission), in arrival
        #    order. The first prompt that will not finish in this forward leaves a share of the budget
        #    (prompt_reserve) to the prompts behind it with fewer tokens left than it will have, shortest
        #    first, running or queued; a longer one waits for it, as in arrival order. What they leave,
        #    it takes back (4.).
        held: JobState | None = None
        held_left = 0  # prompt tokens the held-back job has left after this forward
        behind: list[JobState] = []
        for job in self.running:
            if self._decoding(job):  # scheduled above (budget allowing)
                continue
            if held is not None:
                if self._prompt_left(job) < held_left:
                    behind.append(job)
                continue
            if not budget.open():
                break
            if self._add_chunks(job, budget, chunks, hold=True):
                held, held_left = job, self._left_after(job, chunks)
        behind.sort(key=self._prompt_left)
        # 3. Admit queued jobs, in turn (engine/fair_queue.py), while the budget, the batch and the
        #    pool allow; a running prompt behind the held one that is shorter than the queue's head
        #    goes first.
        waiting: list[JobState] = []
        passed = 0
        while budget.open() and self._rows() < self.config.max_batch_size:
            head = self.queue.peek(rows(self.running))
            if head is None:
                break
            job = head
            if self.cache.awaits_inflight(job):
                self.queue.remove(job)
                waiting.append(job)
                continue
            queued_left = self._queued_left(job) if held is not None else 0  # a prefix lookup: once
            if behind and self._prompt_left(behind[0]) <= queued_left:
                self._add_chunks(behind.pop(0), budget, chunks)
                continue
            if held is not None and queued_left >= held_left:
                # Not shorter than the held-back prompt: it waits for it, holding no pages meanwhile,
                # and a shorter job after it may take the reserve (it could not start before anyway).
                self.queue.remove(job)
                waiting.append(job)
                passed += 1
                if passed >= _PASS_AT_MOST:
                    break
                continue
            if not self._admit_unit(job):
                if job.skips >= self.config.max_skips:
                    break
                # Let a later job of the same tenant and priority try to pass this one (passed `skips` times).
                p = job.spec.priority
                passer = next(
                    (
                        j
                        for j in self.queue.of_tenant(job.spec.tenant)[1:]
                        if j.spec.priority == p
                        and (held is None or self._queued_left(j) < held_left)
                        and self._admit_unit(j)
                    ),
                    None,
                )
                if passer is None:
                    break
                job.skips += 1
                job = passer
            self.queue.remove(job)
            if self._add_chunks(job, budget, chunks, hold=held is None):
                held, held_left = job, self._left_after(job, chunks)
        for job in behind:
            if not budget.open():
                break
            self._add_chunks(job, budget, chunks)
        for job in waiting:
            self.queue.push(job)
        # 4. What the prompts behind it left, the held-back prompt takes back.
        if held is not None and budget.open():
            self._take_back(held, budget, chunks)
        return chunks

    @staticmethod
    def _decoding(job: JobState) -> bool:
        """Whether the job (each of its rows) takes a plain decode step."""
        return job.decoding and (job.negative is None or job.negative.decoding)

    @staticmethod
    def _prompt_left(job: JobState) -> int:
        """Tokens a running job's rows have yet to compute."""
        return sum(seq.pending for seq in job.rows)

    def _queued_left(self, job: JobState) -> int:
        """Tokens a queued job's rows would have to compute if admitted now (less their prefix hits)."""
        return sum(seq.pending - self.cache.hits(seq) for seq in job.rows)

    def _left_after(self, job: JobState, chunks: list[ScheduledChunk]) -> int:
        """What the job has left to compute once this forward's chunks have run."""
        return self._prompt_left(job) - sum(c.num_tokens for c in chunks if c.job is job)

    def _rows(self) -> int:
        """Batch rows the running jobs hold (a guided job holds two)."""
        return sum(len(j.rows) for j in self.running)

    def _add_chunks(
        self,
        job: JobState,
        budget: _Budget,
        chunks: list[ScheduledChunk],
        at: int | None = None,
        hold: bool = False,
    ) -> bool:
        """Add the prefill chunk(s) of a running job within `budget` (charged to its tenant), at
        position `at` of `chunks` (None: at the end). With `hold`, a prompt that does not finish
        within the budget takes at most all but `prompt_reserve` of it; returns whether it did."""
        own, neg = self._takes(job, budget)
        finishes = own == job.pending and (job.negative is None or neg == job.negative.pending)
        if hold and not finishes:
            own, neg = self._takes(job, budget.holding(self.config.prompt_reserve))
        new = [ScheduledChunk(job, n, negative=is_neg) for is_neg, n in ((False, own), (True, neg)) if n > 0]
        i = len(chunks) if at is None else at
        chunks[i:i] = new
        self.queue.charge(job.spec.tenant, own + neg)
        if job.negative is not None:
            budget.spend(neg, job.negative.computed)
        budget.spend(own, job.computed)
        return hold and not finishes

    @staticmethod
    def _takes(job: JobState, budget: _Budget) -> tuple[int, int]:
        """The prompt tokens of the job's own row and of its negative row (0 without one) that
        fit in `budget`."""
        negative = job.negative
        if negative is None:
            return min(job.pending, budget.room(job.computed)), 0
        own, neg = job.pending, negative.pending
        n_neg = min(neg, budget.room(negative.computed))
        n_own = min(own, budget.after(n_neg, negative.computed).room(job.computed))
        if n_neg < neg or n_own < own:
            # The job samples from both rows' logits after the same forward: until both fit, each
            # computes all but its last token.
            n_neg = min(n_neg, neg - 1)
            n_own = min(own - 1, budget.after(n_neg, negative.computed).room(job.computed))
        return n_own, n_neg

    def _take_back(self, job: JobState, budget: _Budget, chunks: list[ScheduledChunk]) -> None:
        """Re-plan a held-back prompt's chunks, in their place, with what the budget has left once
        they are refunded."""
        mine = [c for c in chunks if c.job is job]
        at = chunks.index(mine[0]) if mine else None  # its held share may have been no token
        for c in mine:
            chunks.remove(c)
            budget.spend(c.num_tokens, c.seq.computed, sign=-1)
            self.queue.charge(job.spec.tenant, -c.num_tokens)
        self._add_chunks(job, budget, chunks, at)

    def _victim(self) -> JobState | None:
        return first_victim(self.running, self.queue, self.config.max_batch_size)

    def _admit_by_preemption(self, on_preempt: Callable[[JobState], None]) -> None:
        """Admit the next waiting jobs while each may displace a running one (_displaces), preempting
        while there is no room for them (batch rows or pages)."""
        while self.queue:
            head = self.queue.peek(rows(self.running))
            assert head is not None
            victim = displaced_by(head, self.running, self.queue, self.config.max_batch_size)
            if victim is None:
                return
            if self._admit_unit(head):
                self.queue.remove(head)
                continue
            self._preempt(victim)  # it requeues, never ahead of `head` (see FairQueue.outranks)
            on_preempt(victim)

    def _admit_unit(self, job: JobState) -> bool:
        """Make `job` running, all its rows or none, if the batch has the rows and the cache manager
        finds each row its pages (prefix hits first)."""
        if self._rows() + len(job.rows) > self.config.max_batch_size:
            return False
        held: list[int] = []
        for seq in job.rows:
            h = self.cache.admit(seq)
            if h is None:  # no room for this row: the rows admitted so far give their pages back
                for admitted in job.rows[: len(held)]:
                    self._release(admitted)
                return False
            held.append(h)
        for seq, h in zip(job.rows, held, strict=True):
            seq.computed = h
        if not job.started:
            job.cached_tokens = held[0]
        job.stage = JobStage.PREFILL
        job.order = self._admitted
        self._admitted += 1
        self.running.append(job)
        return True

    def _ensure_pages(
        self, job: JobState, seq: SequenceState, total_tokens: int, on_preempt: Callable[[JobState], None]
    ) -> bool:
        """Make a row of `job` hold pages for `total_tokens`, preempting others (or the job itself)
        while the pool is dry."""
        while not self.cache.grow(seq, total_tokens):
            victim = self._victim()
            assert victim is not None, "a job asking for pages is running"
            self._preempt(victim)
            on_preempt(victim)
            if victim is job:
                return False
        return True

    def preempt(self, job: JobState) -> None:
        """Send a running job (all its rows) back to the queue, before the jobs of its priority,
        its pages released (its output kept)."""
        if job in self.running:
            self._preempt(job)

    def _preempt(self, job: JobState) -> None:
        self.running.remove(job)
        self._release_rows(job)
        job.stage = JobStage.QUEUED
        # Its budget was planned for a decode step it will not take: re-admitted, it prefills first.
        job.draft_budget = 0
        job.preemptions += 1
        self.preemptions += 1
        self.queue.push(job)

    def _release_rows(self, job: JobState) -> None:
        """Give back every row's pages (each row's, even if one fails)."""
        first, *rest = job.rows
        try:
            for seq in rest:
                self._release(seq)
        finally:
            self._release(first)

    def _release(self, seq: SequenceState) -> None:
        self.cache.free(seq)
        seq.computed = 0


@dataclass
class _Budget:
    """One forward's room. `left`: tokens (max_chunk_size). `work`: what max_chunk_size prompt
    tokens from depth 0 cost, so no forward costs more than that chunk, however deep its prompt
    tokens are. `prompt`: what the forward's prompt tokens may cost: alone_tokens from depth 0, or
    beside decode steps prefill_while_decoding (their stall). Prompt slices spend `work` and `prompt`
    at their depth's price, decode tokens `work` one each."""

    left: int
    work: float
    prompt: float
    price: PromptDepthCost

    @staticmethod
    def of(max_chunk_size: int, alone_tokens: int, price: PromptDepthCost) -> _Budget:
        return _Budget(
            max_chunk_size, price.slice_cost(max_chunk_size, 0), price.slice_cost(alone_tokens, 0), price
        )

    def beside_decoding(self, prompt_tokens: int) -> None:
        self.prompt = min(self.prompt, self.price.slice_cost(prompt_tokens, 0))

    def open(self) -> bool:
        return self.left >= 1 and self.work >= 1 and self.prompt >= 1

    def room(self, depth: int) -> int:
        """Prompt tokens from `depth` on that fit; at least one while the budget is open, so a
        prompt at any depth moves on."""
        if not self.open():
            return 0
        n = self.price.tokens_within(min(self.work, self.prompt), depth)
        return min(max(n, 1), self.left)

    def decode(self, tokens: int) -> None:
        self.left -= tokens
        self.work -= tokens

    def spend(self, tokens: int, depth: int, sign: int = 1) -> None:
        """Take `tokens` prompt tokens from `depth` on out of the budget (sign -1: give them back)."""
        if tokens <= 0:
            return
        cost = sign * self.price.slice_cost(tokens, depth)
        self.left -= sign * tokens
        self.work -= cost
        self.prompt -= cost

    def holding(self, reserve: float) -> _Budget:
        """This budget less the share `reserve` of what it has left (a trial; this one is unchanged)."""
        keep = 1.0 - reserve
        return replace(
            self,
            left=int(self.left * keep),
            work=self.work * keep,
            prompt=self.prompt * keep,
        )

    def after(self, tokens: int, depth: int) -> _Budget:
        """This budget once `tokens` from `depth` are spent (a trial; this one is unchanged)."""
        trial = replace(self)
        trial.spend(tokens, depth)
        return trial
