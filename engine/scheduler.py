"""Which jobs run in the next forward, with how many tokens each.

There is no prefill phase and no decode phase: every job has tokens in the cache and
tokens it wants there (the prompt, then each sampled token), and each iteration hands
out a token budget (`max_chunk_size`) so the first catches up with the second. Decode
tokens of running jobs come first (one each, cheap, latency-critical), then prefill
chunks of running jobs, then new jobs admitted from the queue in FIFO order.

Pages are taken on demand: a job gets pages for its prompt when admitted and one page
at a time as its output grows, never its whole max_new_tokens budget up front. When
the pool runs dry, the newest running job is preempted: its pages go back to the pool
(full ones stay findable, so its recompute is mostly a prefix hit) and it waits at
the head of the queue with its output kept.

Admission fairness (`max_skips`): a job whose prompt does not fit yet may be passed
by smaller jobs behind it at most max_skips times; then the queue waits for it.

Shared prefixes arriving together: a job whose next prompt page is being computed right
now by a running job waits (without losing its place) until that page is registered,
then takes it as a prefix hit. So 32 jobs with one long system prompt compute it once,
not 32 times. (Only jobs of the same cache salt share: the salt is part of every hash.)

Partial pages: a shared prefix rarely ends on a page boundary. Past its whole-page hits, an
admitted job copies the K/V of as many leading tokens of its next page as some other page
on the same prefix already holds (a registered page from the pool, or the page a running
job is filling) instead of computing them: 32 prompts that share 1019 tokens on pages of
64 then each compute 12 tokens, not 71.

A queued job's page hashes are computed once and kept on the job, and a try that does
not fit takes nothing and counts no prefix lookup: a job waiting for room costs dict
lookups per step, and the hit-rate stats count one lookup per admission.

Whose turn it is (engine/fair_queue.py): the waiting tenant that has been served the fewest
weighted tokens, then within it priority with aging (priority p is a head start of p / rate
seconds of waiting), then arrival; only jobs of one tenant and equal priority pass each other
under max_skips. When the next job outranks a running one (a higher priority and a better rank)
or its tenant holds fewer batch rows than its share while another tenant holds more, and the
batch or the pool has no room for it, a running job is preempted, again until it fits, so it
starts in the same step: the lowest-priority one (the newest among equals), of the tenant most
over its share where that is the reason. The pool's own preemptions take the same kind of
victim. Equal priorities never preempt each other for priority's sake, and ranks never flip, so
a job preempted for another is never re-admitted ahead of it. With authentication on, one
tenant holds at most `max_q_per_tenant` waiting jobs (QueueFullError past it), so one tenant's
flood cannot fill the queue.

Guided jobs (classifier-free guidance) run with their negative sequence: a second row with
its own pages, admitted, preempted and removed together with the job, which counts two rows
of the batch. Both rows reach their last token in the same forward, since the job samples
from the two rows' logits: until both can, each keeps its last token back.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from engine import defaults
from engine.errors import InvalidRequestError, QueueFullError
from engine.fair_queue import FairQueue
from engine.ids import PageId
from engine.job_state import JobState, PrefixCopy
from engine.jobs import JobStage
from engine.pages import PagePool, common_prefix_len, extend_chain


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = defaults.MAX_BATCH_SIZE
    max_chunk_size: int = defaults.MAX_CHUNK_SIZE
    max_q_size: int = defaults.MAX_QUEUE
    max_skips: int = 4
    prefix_cache: bool = True  # reuse full pages across jobs (off: every job computes its whole prompt)
    # Waiting jobs of one named tenant at once (tenant "", authentication off, has only max_q_size).
    max_q_per_tenant: int = defaults.MAX_QUEUE_PER_TENANT
    priority_aging: float = defaults.PRIORITY_AGING  # priority levels a waiting job gains per second
    tenant_weights: tuple[tuple[str, float], ...] = ()  # (tenant, weight) of its fair share; default 1

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_chunk_size", "max_q_size", "max_q_per_tenant"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_skips < 0:
            raise InvalidRequestError(f"max_skips must be >= 0, got {self.max_skips}")
        if self.priority_aging < 0 or not math.isfinite(self.priority_aging):
            raise InvalidRequestError(f"priority_aging must be >= 0, got {self.priority_aging}")
        for tenant, weight in self.tenant_weights:
            if not (weight > 0 and math.isfinite(weight)):
                raise InvalidRequestError(f"tenant {tenant!r}: weight must be > 0, got {weight}")


@dataclass(frozen=True)
class ScheduledChunk:
    job: JobState
    num_tokens: int  # new tokens of this job in the forward, starting at job.computed
    draft: tuple[int, ...] = ()  # speculative tokens after the job's last token (verified in this forward)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: PagePool) -> None:
        self.config = config
        self.pool = pool
        self.queue = FairQueue(config.priority_aging, dict(config.tenant_weights))
        self.running: list[JobState] = []
        self._admitted = 0
        # Chain hash of a full prompt page -> the running job computing it. An entry leaves when its
        # page is registered or its job stops running (finish, cancel, preemption), so this holds
        # at most the running jobs' uncomputed prompt pages.
        self._inflight: dict[int, JobState] = {}

    def submit(self, job: JobState) -> None:
        if len(self.queue) >= self.config.max_q_size:
            raise QueueFullError(
                f"the queue is full ({self.config.max_q_size} jobs waiting); try again later"
            )
        tenant = job.spec.tenant
        if tenant and self.queue.waiting(tenant) >= self.config.max_q_per_tenant:
            raise QueueFullError(
                f"this tenant has {self.config.max_q_per_tenant} jobs waiting, the most one tenant may "
                "queue (--max-queue-per-tenant); try again later"
            )
        self.queue.joined(tenant)
        self.queue.push(job)

    def remove(self, job: JobState) -> None:
        """Take a job out (finish or cancel) and give its pages back (its negative sequence's too);
        it is FINISHED from here on, even if giving the pages back fails."""
        if job.stage is not JobStage.FINISHED:
            self.queue.left(job.spec.tenant)
        job.stage = JobStage.FINISHED
        if job.negative is not None:
            job.negative.stage = JobStage.FINISHED
            if job.negative in self.running:
                self.running.remove(job.negative)
        if job in self.running:
            self.running.remove(job)
        elif job in self.queue:
            self.queue.remove(job)
        try:
            if job.negative is not None:
                self._release(job.negative)
        finally:
            self._release(job)

    # -- the generator's reports: progress and pages are written here only ----------------------

    def begin_chunk(self, job: JobState, copy_prefix: Callable[[PageId, PageId, int], None]) -> None:
        """Before a scheduled chunk of `job` runs: the partial prefix hit found at admission is
        copied (by `copy_prefix`, the cache's) and its source page let go; the stage follows progress."""
        if job.prefix_copy is not None:
            copy, job.prefix_copy = job.prefix_copy, None
            try:
                copy_prefix(copy.source, copy.target, copy.tokens)
            finally:
                self.pool.release([copy.source])
        job.stage = JobStage.DECODE if job.computed >= job.prompt_len else JobStage.PREFILL

    def set_draft_budget(self, job: JobState, tokens: int) -> None:
        """Draft tokens `job` may verify with its next decode step (0: it does not speculate)."""
        job.draft_budget = tokens

    def advance(self, job: JobState, computed: int) -> list[int]:
        """`job`'s K/V now hold its first `computed` tokens (a forward ran; after speculation,
        the verified ones only: a rejected tail is overwritten later, and no page holding it is
        registered before then). Newly filled pages are registered; returns the token positions
        where a page was swapped for an identical registered one (a drafter keyed by pages rewinds)."""
        job.computed = computed
        return self._register_full_pages(job)

    def _register_full_pages(self, job: JobState) -> list[int]:
        """Make every newly filled page findable; switch to an identical page if one exists."""
        ps = self.pool.page_size
        swapped: list[int] = []
        if not self.config.prefix_cache:
            return swapped
        while (job.registered + 1) * ps <= job.computed:
            i = job.registered
            parent = job.pages[i - 1] if i > 0 else None
            page = self.pool.register_full(
                job.pages[i], parent, job.tokens[i * ps : (i + 1) * ps], job.prefix_salt
            )
            if page != job.pages[i]:
                swapped.append(i * ps)
            job.pages[i] = page
            job.registered += 1
        return swapped

    def truncate(self, job: JobState, keep: int, copy_prefix: Callable[[PageId, PageId, int], None]) -> bool:
        """Make `job`'s K/V hold at most its first `keep` tokens and its pages writable past them.

        Pages registered in the pool are read-only: one the job holds alone is unregistered, a
        shared one is copied (the kept slots, by `copy_prefix`) into a fresh page. No page to copy
        into: the job is preempted (False), and its re-admission recomputes what it keeps (mostly
        prefix hits)."""
        ps = self.pool.page_size
        job.computed = min(job.computed, keep)
        first = keep // ps
        kept = True
        for i in range(first, job.registered):
            page = job.pages[i]
            if self.pool.ref_count(page) == 1:
                self.pool.unregister(page)
                continue
            fresh = self.pool.allocate(1)
            if fresh is None:
                self.preempt(job)
                kept = False
                break
            if i == first and keep % ps:
                copy_prefix(page, fresh[0], keep % ps)
            self.pool.release([page])
            job.pages[i] = fresh[0]
        job.registered = min(job.registered, first)
        del job.page_hashes[first:]
        return kept

    def inflight_pages(self) -> int:
        """Prompt pages running jobs are computing that queued jobs may wait for."""
        return len(self._inflight)

    def idle(self) -> bool:
        return not self.running and not self.queue

    def schedule(self, on_preempt: Callable[[JobState], None]) -> list[ScheduledChunk]:
        """The next forward's chunks. Jobs preempted to make room are reported to `on_preempt`."""
        budget = self.config.max_chunk_size
        ps = self.pool.page_size
        chunks: list[ScheduledChunk] = []
        for job in self.running:
            if job.inflight and job.inflight[0][0] < job.registered:
                self._forget_inflight(job, job.registered)
        # 0. A waiting job that outranks a running one, or whose tenant is short of its share of the
        #    batch, takes a running job's place if there is no room for it.
        self._admit_by_preemption(on_preempt)
        # 1. Decode steps, highest priority and oldest first: each may need one more page; the pool
        #    running dry preempts the lowest-priority, newest job (never one already scheduled).
        #    A speculating job asks for room for its drafts too (verified in the same step).
        decoding = (j for j in self.running if j.positive is None and self._decoding(j))
        for job in sorted(decoding, key=lambda j: (-j.spec.priority, j.order)):
            if budget < 1 or job.stage is JobStage.QUEUED:  # preempted for an older job's page
                continue
            negative = job.negative
            if negative is None:
                take = min(1 + job.draft_budget, budget)
                if not self._ensure_pages(job, job.computed + take, ps, on_preempt):
                    continue
                chunks.append(ScheduledChunk(job, take))
                self.queue.charge(job.spec.tenant, take)
                budget -= take
                continue
            if budget < 2:  # both rows or neither
                continue
            if not (
                self._ensure_pages(job, job.computed + 1, ps, on_preempt)
                and self._ensure_pages(negative, negative.computed + 1, ps, on_preempt)
            ):
                continue
            chunks += (ScheduledChunk(job, 1), ScheduledChunk(negative, 1))
            self.queue.charge(job.spec.tenant, 2)
            budget -= 2
        # 2. Prefill chunks of running jobs (their prompt pages were taken at admission).
        for job in self.running:
            if budget < 1:
                break
            if job.positive is not None or self._decoding(job):  # scheduled above (budget allowing)
                continue
            budget = self._add_chunks(job, budget, chunks)
        # 3. Admit queued jobs, in turn (engine/fair_queue.py), while the budget, the batch and the
        #    pool allow.
        waiting: list[JobState] = []
        while budget >= 1 and len(self.running) < self.config.max_batch_size:
            head = self.queue.peek(self._rows())
            if head is None:
                break
            job = head
            if self._awaits_inflight_prefix(job):
                self.queue.remove(job)
                waiting.append(job)
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
                        if j.spec.priority == p and self._admit_unit(j)
                    ),
                    None,
                )
                if passer is None:
                    break
                job.skips += 1
                job = passer
            self.queue.remove(job)
            budget = self._add_chunks(job, budget, chunks)
        for job in waiting:
            self.queue.push(job)
        return chunks

    @staticmethod
    def _decoding(job: JobState) -> bool:
        """Whether the job (with its negative sequence, if guided) takes a plain decode step."""
        return job.decoding and (job.negative is None or job.negative.decoding)

    def _add_chunks(self, job: JobState, budget: int, chunks: list[ScheduledChunk]) -> int:
        """Add the prefill chunk(s) of a running job within `budget` (charged to its tenant); returns
        the budget left."""
        negative = job.negative
        if negative is None:
            take = min(job.pending, budget)
            chunks.append(ScheduledChunk(job, take))
            self.queue.charge(job.spec.tenant, take)
            return budget - take
        own, neg = job.pending, negative.pending
        if own + neg > budget:
            # The job samples from both rows' logits after the same forward: until both fit, each
            # computes all but its last token.
            neg = min(neg - 1, budget)
            own = min(own - 1, budget - neg)
        for seq, take in ((job, own), (negative, neg)):
            if take > 0:
                chunks.append(ScheduledChunk(seq, take))
        self.queue.charge(job.spec.tenant, own + neg)
        return budget - own - neg

    def _rows(self) -> Counter[str]:
        """Batch rows each tenant's running jobs hold (a guided job holds two)."""
        return Counter(j.spec.tenant for j in self.running)

    def _over_share(self, rows: Counter[str]) -> dict[str, float]:
        """Tenants holding more batch rows than the ceiling of their share, by how many."""
        capacity = self.config.max_batch_size
        out: dict[str, float] = {}
        for tenant, n in rows.items():
            share = self.queue.share(tenant, capacity)
            if n > math.ceil(share):
                out[tenant] = n - share
        return out

    def _victim(self) -> JobState | None:
        """The running job to preempt first: the lowest priority, of the tenant most over its share of
        the batch (with several tenants), the newest among equals."""
        over = self._over_share(self._rows()) if len(self.queue.tenants()) > 1 else {}
        jobs = (j for j in self.running if j.positive is None)
        return max(
            jobs, key=lambda j: (-j.spec.priority, over.get(j.spec.tenant, 0.0), j.order), default=None
        )

    def _displaces(self, head: JobState) -> JobState | None:
        """The running job `head` may take the place of, if there is no room for it: the first victim
        if `head` outranks it; else, with several tenants, when `head`'s tenant has no row running and
        its share holds one, the lowest-priority newest job (of priority <= head's) of the tenant most
        over its share. None: `head` waits for room like any job, and the shares come from the order
        of admission alone (a preemption costs its victim a recompute, so it is kept for the tenant
        that would otherwise wait for another's jobs to end)."""
        victim = self._victim()
        if victim is None:
            return None
        if self.queue.outranks(head, victim):
            return victim
        if len(self.queue.tenants()) < 2:
            return None
        rows = self._rows()
        tenant = head.spec.tenant
        need = 1 if head.negative is None else 2
        if rows[tenant] or need > math.floor(self.queue.share(tenant, self.config.max_batch_size)):
            return None
        over = self._over_share(rows)
        if not over:
            return None
        richest = max(over, key=lambda t: over[t])
        candidates = [
            j
            for j in self.running
            if j.positive is None and j.spec.tenant == richest and j.spec.priority <= head.spec.priority
        ]
        return max(candidates, key=lambda j: (-j.spec.priority, j.order), default=None)

    def _admit_by_preemption(self, on_preempt: Callable[[JobState], None]) -> None:
        """Admit the next waiting jobs while each may displace a running one (_displaces), preempting
        while there is no room for them (batch rows or pages)."""
        while self.queue:
            head = self.queue.peek(self._rows())
            assert head is not None
            victim = self._displaces(head)
            if victim is None:
                return
            if self._admit_unit(head):
                self.queue.remove(head)
                continue
            self._preempt(victim)  # it requeues, never ahead of `head` (see FairQueue.outranks)
            on_preempt(victim)

    def _admit_unit(self, job: JobState) -> bool:
        """Admit a job, and with it its negative sequence (both or neither), if the batch has the rows
        and the pool the pages."""
        negative = job.negative
        if len(self.running) + (1 if negative is None else 2) > self.config.max_batch_size:
            return False
        if not self._admit(job):
            return False
        if negative is None or self._admit(negative):
            return True
        self.running.remove(job)  # no room for the negative sequence: the job waits too
        self._release(job)
        job.stage = JobStage.QUEUED
        return False

    def _full_page_hashes(self, job: JobState) -> list[int]:
        """Chain hashes of the job's full pages that a prefix match may cover (all but the last token).

        Kept on the job and only extended: a job waiting for room is not re-hashed at every step.
        """
        ps = self.pool.page_size
        extend_chain(job.page_hashes, job.tokens, ps, job.prefix_salt, (len(job.tokens) - 1) // ps)
        return job.page_hashes

    def _forget_inflight(self, job: JobState, below: int | None = None) -> None:
        """Drop the job's in-flight entries for pages before `below` (None: all of them)."""
        keep = []
        for i, h in job.inflight:
            if below is not None and i >= below:
                keep.append((i, h))
            elif self._inflight.get(h) is job:
                del self._inflight[h]
        job.inflight = keep

    def _awaits_inflight_prefix(self, job: JobState) -> bool:
        """Whether a running job is computing a page this job could otherwise take from the cache."""
        if not self.config.prefix_cache:
            return False
        ps = self.pool.page_size
        for i, h in enumerate(self._full_page_hashes(job)):
            owner = self._inflight.get(h)
            if owner is None:
                continue
            if owner in self.running and owner.registered <= i and owner.computed < (i + 1) * ps:
                return True
        return False

    def _admit(self, job: JobState) -> bool:
        """Give `job` its prompt pages (prefix hits first) and make it running, if they fit."""
        ps = self.pool.page_size
        # Everything but the last token may come from the prefix cache (its logits are needed).
        # A preempted job recomputes prompt + output, and its old full pages are likely cached.
        # Look without taking: a job that does not fit is neither charged nor counted as a lookup.
        query = len(job.tokens) - 1
        hashes = self._full_page_hashes(job) if self.config.prefix_cache else []
        total = job.pages_for(len(job.tokens), ps)
        # Keep one page spare per running job so decode can continue without preempting at once.
        room = self.pool.available() - len(self.running)
        if total - len(hashes) > room:
            return False  # even a hit on every full page would leave too many to allocate
        matched = (
            self.pool.find_prefix(job.tokens, query, salt=job.prefix_salt, hashes=hashes)
            if self.config.prefix_cache
            else []
        )
        need = total - len(matched)
        donor = self._partial_donor(job, matched) if self.config.prefix_cache else None
        revived = sum(1 for p in matched if self.pool.ref_count(p) == 0)  # CACHED pages leave the LRU
        if donor is not None and self.pool.ref_count(donor[0]) == 0:
            revived += 1
        if need > room - revived:
            return False
        if self.config.prefix_cache:
            self.pool.take_prefix(matched, query, donor[1] if donor else 0)
        if donor is not None:
            self.pool.hold(donor[0])  # before allocating: it must not be evicted for our own pages
        fresh = self.pool.allocate(need)
        assert fresh is not None, "the pages were counted as available"
        job.pages = matched + fresh
        job.computed = len(matched) * ps
        job.registered = len(matched)
        if donor is not None:
            job.prefix_copy = PrefixCopy(donor[0], fresh[0], donor[1])
            job.computed += donor[1]
        if not job.started:
            job.cached_tokens = job.computed
        if self.config.prefix_cache:
            for i, h in enumerate(self._full_page_hashes(job)[len(matched) :], start=len(matched)):
                if self._inflight.setdefault(h, job) is job:
                    job.inflight.append((i, h))
        job.stage = JobStage.PREFILL
        job.order = self._admitted
        self._admitted += 1
        self.running.append(job)
        return True

    def _partial_donor(self, job: JobState, matched: list[PageId]) -> tuple[PageId, int] | None:
        """The page holding the most of `job`'s tokens after its whole-page hits `matched`, computed
        on the very same pages before them, and how many; None if none holds even one."""
        ps = self.pool.page_size
        k = len(matched)
        start = k * ps
        # The last token always runs (its logits are needed).
        want = job.tokens[start : min(start + ps, len(job.tokens) - 1)]
        if not want:
            return None
        salt = job.prefix_salt
        best = self.pool.find_partial(matched[-1] if matched else None, want, salt=salt)
        # A running job's page k is not registered until full, but its computed tokens are usable.
        for other in self.running:
            if (
                other.registered != k
                or len(other.pages) <= k
                or other.prefix_salt != salt
                or other.pages[:k] != matched
            ):
                continue
            have = min(other.computed - start, ps)
            if have <= 0:
                continue
            n = common_prefix_len(other.tokens[start : start + have], want)
            if n and (best is None or n > best[1]):
                best = (other.pages[k], n)
        return best

    def _ensure_pages(
        self, job: JobState, total_tokens: int, page_size: int, on_preempt: Callable[[JobState], None]
    ) -> bool:
        """Make `job` hold pages for `total_tokens`, preempting newer jobs if the pool is dry."""
        need = job.pages_for(total_tokens, page_size) - len(job.pages)
        while need > 0:
            got = self.pool.allocate(need)
            if got is not None:
                job.pages.extend(got)
                return True
            victim = self._victim()
            assert victim is not None, "a job asking for pages is running"
            self._preempt(victim)
            on_preempt(victim)
            if victim is job or victim is job.positive:
                return False
        return True

    def preempt(self, job: JobState) -> None:
        """Send a running job (and its negative sequence, or the job a negative sequence serves)
        back to the queue, before the jobs of its priority, its pages released (its output kept)."""
        if job in self.running:
            self._preempt(job)

    def _preempt(self, job: JobState) -> None:
        job = job.positive or job
        for seq in (job, job.negative):
            if seq is None:
                continue
            if seq in self.running:
                self.running.remove(seq)
            self._release(seq)
            seq.stage = JobStage.QUEUED
            # Its budget was planned for a decode step it will not take: re-admitted, it prefills first.
            seq.draft_budget = 0
            seq.preemptions += 1
        self.queue.push(job)

    def _release(self, job: JobState) -> None:
        if job.prefix_copy is not None:  # admitted but never staged: drop the hold on the source
            self.pool.release([job.prefix_copy.source])
            job.prefix_copy = None
        if job.inflight:
            self._forget_inflight(job)
        pages, job.pages = job.pages, []
        job.computed = 0
        job.registered = 0
        if pages:
            self.pool.release(pages)
