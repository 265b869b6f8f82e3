"""The jobs waiting for admission, and whose turn it is: fair between tenants, then priority with
aging, then arrival.

Between tenants (virtual token counting): each tenant has a count of the tokens the engine has
forwarded for it, divided by its weight (`--tenant-weight NAME=W`, default 1). The next job comes
from the waiting tenant with the lowest count. A tenant that arrives, or comes back after it had
no job in the engine, starts at the lowest count among the tenants present, so idle time is not
banked as credit and a newcomer is not punished for others' history. The scheduler charges a
job's tokens as it schedules them (a prefill chunk, a decode step with its drafts), so several
admissions in one step already alternate between tenants.

Within a tenant, priority with aging: a job's rank is fixed at arrival as `arrival * rate -
priority` (smaller first; `rate` is `--priority-aging`, levels per second of waiting): priority p
is a head start of p / rate seconds. Two jobs' ranks differ by a constant, so the order never
flips with time; a job is passed only by jobs of higher priority that arrived less than the
difference / rate seconds after it, so priority 0 always starts. At rate 0 it is priority, then
arrival. Equal ranks keep their arrival order.

With one tenant (or authentication off, where every job is tenant "") the tenant step picks that
tenant every time: the order is priority with aging, then arrival.

A new job enters only while the queue holds fewer than `max_q_size` jobs and, with authentication
on, its tenant fewer than `tenant_queue_cap` (QueueFullError past either), so one tenant's flood
cannot fill the queue.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterator, Mapping

from engine.errors import QueueFullError
from engine.job_state import JobState


class FairQueue:
    def __init__(self, aging: float, weights: Mapping[str, float]) -> None:
        if aging < 0:
            raise ValueError(f"priority aging must be >= 0 levels per second, got {aging}")
        if any(w <= 0 for w in weights.values()):
            raise ValueError(f"tenant weights must be > 0, got {dict(weights)}")
        self._aging = aging
        self._weights = dict(weights)
        self._waiting: dict[str, list[JobState]] = {}  # tenant -> its waiting jobs, best rank first
        self._size = 0
        self._served: dict[str, float] = {}  # tenant -> forwarded tokens / weight
        self._present: Counter[str] = Counter()  # tenant -> its jobs in the engine (waiting or running)

    # -- the order --------------------------------------------------------------------------------

    def rank(self, job: JobState) -> tuple[float, float]:
        """Smaller goes first; fixed for the job's life (a preempted job keeps its rank)."""
        if self._aging > 0:
            return (job.enqueued_at * self._aging - job.spec.priority, job.enqueued_at)
        return (-float(job.spec.priority), job.enqueued_at)

    def outranks(self, job: JobState, other: JobState) -> bool:
        """Whether `job` may preempt `other`: a higher priority and a better rank (so aging protects a
        job that has waited long, and equal priorities never preempt each other). Ranks differ by a
        constant, so if `job` outranks `other`, `other` never outranks `job`: no ping-pong."""
        return job.spec.priority > other.spec.priority and self.rank(job) < self.rank(other)

    def enter(self, job: JobState, max_size: int, max_per_tenant: int) -> None:
        """Queue a new job, if the queue and its tenant's share of it have room (QueueFullError)."""
        if self._size >= max_size:
            raise QueueFullError(f"the queue is full ({max_size} jobs waiting); try again later")
        tenant = job.spec.tenant
        if tenant and self.waiting(tenant) >= max_per_tenant:
            raise QueueFullError(
                f"this tenant has {max_per_tenant} jobs waiting, the most one tenant may "
                "queue (--max-queue-per-tenant); try again later"
            )
        self.joined(tenant)
        self.push(job)

    def push(self, job: JobState) -> None:
        """Queue a job (new or preempted) in its tenant's order."""
        bisect.insort(self._waiting.setdefault(job.spec.tenant, []), job, key=self.rank)
        self._size += 1

    def remove(self, job: JobState) -> None:
        jobs = self._waiting[job.spec.tenant]
        jobs.remove(job)
        if not jobs:
            del self._waiting[job.spec.tenant]
        self._size -= 1

    def peek(self, rows: Mapping[str, int] | None = None) -> JobState | None:
        """The next job to admit: the best-ranked job of the waiting tenant with the lowest count; ties
        (a newcomer starts at the lowest count) go to the tenant holding the fewest batch rows for its
        weight (`rows`: each tenant's running rows), then to the better-ranked head."""
        best: tuple[float, float, tuple[float, float]] | None = None
        chosen: JobState | None = None
        for tenant, jobs in self._waiting.items():
            held = (rows or {}).get(tenant, 0) / self.weight(tenant)
            key = (self._served.get(tenant, 0.0), held, self.rank(jobs[0]))
            if best is None or key < best:
                best, chosen = key, jobs[0]
        return chosen

    def of_tenant(self, tenant: str) -> list[JobState]:
        """`tenant`'s waiting jobs, best rank first."""
        return list(self._waiting.get(tenant, ()))

    def waiting(self, tenant: str) -> int:
        return len(self._waiting.get(tenant, ()))

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[JobState]:
        for jobs in self._waiting.values():
            yield from jobs

    def __contains__(self, job: object) -> bool:
        return isinstance(job, JobState) and job in self._waiting.get(job.spec.tenant, ())

    # -- the tenants' accounts ---------------------------------------------------------------------

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    def served(self, tenant: str) -> float:
        return self._served.get(tenant, 0.0)

    def joined(self, tenant: str) -> None:
        """A job of `tenant` entered the engine: a tenant that had none starts at the lowest count
        of those present."""
        if self._present[tenant] == 0:
            counts = [self._served.get(t, 0.0) for t, n in self._present.items() if n > 0]
            floor = min(counts) if counts else 0.0
            self._served[tenant] = max(self._served.get(tenant, 0.0), floor)
        self._present[tenant] += 1

    def left(self, tenant: str) -> None:
        """A job of `tenant` finished or was cancelled."""
        self._present[tenant] -= 1
        if self._present[tenant] > 0:
            return
        del self._present[tenant]
        # A count at or below the floor would be lifted on return anyway: forget it (so the accounts
        # hold the tenants present, and those that used more than them).
        counts = [self._served.get(t, 0.0) for t in self._present]
        floor = min(counts) if counts else None
        for t in [t for t in self._served if t not in self._present]:
            if floor is None or self._served[t] <= floor:
                del self._served[t]

    def charge(self, tenant: str, tokens: int) -> None:
        """Tokens forwarded for `tenant`, as they are scheduled."""
        self._served[tenant] = self._served.get(tenant, 0.0) + tokens / self.weight(tenant)

    def tenants(self) -> list[str]:
        """The tenants with a job in the engine."""
        return list(self._present)

    def share(self, tenant: str, capacity: int) -> float:
        """`tenant`'s weighted share of `capacity` (batch rows) among the tenants present."""
        total = sum(self.weight(t) for t in self._present) or 1.0
        return capacity * self.weight(tenant) / total
