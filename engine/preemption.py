"""Who gives way when the batch or the pool has no room: the scheduler's victims (pure policy over
the running jobs and the fair queue's shares; it changes nothing).

- The first victim: the lowest priority, of the tenant most over its share of the batch (with
  several tenants), the newest among equals. The pool's own preemptions take it too.
- A waiting job displaces the first victim if it outranks it (FairQueue.outranks: a higher
  priority and a better rank, so no pair ever preempts each other in turn); else, with several
  tenants, when its tenant has no row running and its share holds one, it displaces the newest
  lowest-priority job (of priority at most its own) of the tenant most over its share. Otherwise
  it waits for room like any job: a preemption costs its victim a recompute, so beyond a tenant's
  first row its share comes from the order of admission alone.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from engine.fair_queue import FairQueue
from engine.job_state import JobState


def rows(running: Sequence[JobState]) -> Counter[str]:
    """Batch rows each tenant's running jobs hold (a guided job holds two)."""
    held: Counter[str] = Counter()
    for j in running:
        held[j.spec.tenant] += len(j.rows)
    return held


def over_share(queue: FairQueue, held: Counter[str], capacity: int) -> dict[str, float]:
    """Tenants holding more batch rows than the ceiling of their share, by how many."""
    out: dict[str, float] = {}
    for tenant, n in held.items():
        share = queue.share(tenant, capacity)
        if n > math.ceil(share):
            out[tenant] = n - share
    return out


def first_victim(running: Sequence[JobState], queue: FairQueue, capacity: int) -> JobState | None:
    over = over_share(queue, rows(running), capacity) if len(queue.tenants()) > 1 else {}
    return max(running, key=lambda j: (-j.spec.priority, over.get(j.spec.tenant, 0.0), j.order), default=None)


def displaced_by(
    head: JobState, running: Sequence[JobState], queue: FairQueue, capacity: int
) -> JobState | None:
    """The running job `head` may take the place of, if there is no room for it (None: it waits)."""
    victim = first_victim(running, queue, capacity)
    if victim is None:
        return None
    if queue.outranks(head, victim):
        return victim
    if len(queue.tenants()) < 2:
        return None
    held = rows(running)
    tenant = head.spec.tenant
    need = len(head.rows)
    if held[tenant] or need > math.floor(queue.share(tenant, capacity)):
        return None
    over = over_share(queue, held, capacity)
    if not over:
        return None
    richest = max(over, key=lambda t: over[t])
    candidates = [j for j in running if j.spec.tenant == richest and j.spec.priority <= head.spec.priority]
    return max(candidates, key=lambda j: (-j.spec.priority, j.order), default=None)
