"""Fair shares between tenants and priority with aging (engine/fair_queue.py, engine/scheduler.py),
on the tiny random model.

The bound stated in docs/ARCHITECTURE.md: with several tenants, a job whose tenant holds fewer
batch rows than the floor of its share is admitted in the next step, preempting a job of the
tenant most over its share if there is no room; its first token then comes at the end of that
step when its prompt fits the step's token budget (max_chunk_size less the running jobs' decode
tokens, at most prefill_while_decoding), else after ceil(prompt / that budget) steps.
"""

from __future__ import annotations

import time

import pytest

from engine.errors import QueueFullError
from engine.generator import DynamicGenerator, GeneratorConfig
from engine.jobs import JobId, JobSpec, JobStarted, TokensGenerated
from engine.model.loader import LoadedModel
from engine.scheduler import SchedulerConfig
from tests.tiny_generator import all_pages_idle


def tiny_gen(tiny: LoadedModel, batch: int = 8, **scheduler: object) -> DynamicGenerator:
    config = GeneratorConfig(
        page_size=4,
        num_pages=512,
        scheduler=SchedulerConfig(max_batch_size=batch, max_chunk_size=256, **scheduler),  # type: ignore[arg-type]
    )
    return DynamicGenerator(tiny.model, tiny.tokenizer, config)


def spec(i: int, tenant: str, new: int = 40, priority: int = 0) -> JobSpec:
    return JobSpec((3 + i % 50, 4, 5 + i % 7, 6), new, ignore_eos=True, tenant=tenant, priority=priority)


def steps_to_first_token(gen: DynamicGenerator, job: JobId, limit: int) -> int | None:
    for step in range(1, limit + 1):
        events = gen.iterate()
        gen.check_invariants()
        if any(isinstance(e, TokensGenerated) and e.job_id == job for e in events):
            return step
    return None


def drain(gen: DynamicGenerator) -> None:
    for job in list(gen.jobs):
        gen.cancel(job)
    while gen.has_work():
        gen.iterate()
    assert all_pages_idle(gen)


def test_a_flood_leaves_a_second_tenant_its_first_token_in_the_next_step(tiny: LoadedModel) -> None:
    gen = tiny_gen(tiny)
    flood = [gen.enqueue(spec(i, "A", new=200)) for i in range(200)]
    for _ in range(3):
        gen.iterate()
    assert len(gen.scheduler.running) == 8  # A holds the whole batch, 192 more waiting
    single = gen.enqueue(spec(7, "B", new=5))
    assert steps_to_first_token(gen, single, 40) == 1
    assert sum(gen.jobs[j].preemptions for j in flood) == 1  # one of A's rows made room
    drain(gen)
    gen.close()


def test_one_tenant_keeps_the_order_of_priority_then_arrival(tiny: LoadedModel) -> None:
    """Without a second tenant there is nobody to be fair to: a late job waits behind the flood."""
    gen = tiny_gen(tiny)
    for i in range(40):
        gen.enqueue(spec(i, "A", new=200))
    for _ in range(3):
        gen.iterate()
    late = gen.enqueue(spec(7, "A", new=5))
    assert steps_to_first_token(gen, late, 40) is None
    drain(gen)
    gen.close()


def _served(gen: DynamicGenerator, owners: dict[JobId, str], steps: int) -> dict[str, int]:
    """Output tokens per tenant over `steps` iterations."""
    out: dict[str, int] = {}
    for _ in range(steps):
        for e in gen.iterate():
            if isinstance(e, TokensGenerated):
                out[owners[e.job_id]] = out.get(owners[e.job_id], 0) + len(e.token_ids)
        gen.check_invariants()
    return out


def test_backlogged_tenants_share_by_weight(tiny: LoadedModel) -> None:
    """Three tenants with deep queues of short jobs (so admissions decide the shares): equal weights
    are served alike; a tenant of weight 2 gets about twice the tokens of one of weight 1."""
    for weights, want in (
        ((), {"A": 1.0, "B": 1.0, "C": 1.0}),
        ((("A", 2.0),), {"A": 2.0, "B": 1.0, "C": 1.0}),
    ):
        gen = tiny_gen(tiny, batch=6, tenant_weights=weights)
        # A arrives first with the most work: arrival order alone would serve A only.
        owners = {gen.enqueue(spec(i, "A", new=6)): "A" for i in range(60)}
        for t, tenant in enumerate(("B", "C")):
            for i in range(30):
                owners[gen.enqueue(spec(100 * (t + 1) + i, tenant, new=6))] = tenant
        served = _served(gen, owners, 60)
        total = sum(served.values())
        scale = sum(want.values())
        for tenant, share in want.items():
            assert abs(served.get(tenant, 0) / total - share / scale) < 0.08, (weights, served)
        drain(gen)
        gen.close()


def test_a_tenant_may_hold_only_its_part_of_the_queue(tiny: LoadedModel) -> None:
    gen = tiny_gen(tiny, batch=1, max_q_size=10, max_q_per_tenant=4)
    for i in range(4):
        gen.enqueue(spec(i, "A"))
    with pytest.raises(QueueFullError, match="max-queue-per-tenant"):
        gen.enqueue(spec(9, "A"))
    for i in range(4):
        gen.enqueue(spec(i, "B"))
    for i in range(2):
        gen.enqueue(spec(i, ""))  # the anonymous tenant (no authentication) has only the queue's bound
    with pytest.raises(QueueFullError, match="the queue is full"):
        gen.enqueue(spec(3, ""))
    drain(gen)
    gen.close()


def test_a_tenants_part_follows_the_queue_size_unless_set(tiny: LoadedModel) -> None:
    """Without --max-queue-per-tenant a tenant holds a quarter of whatever queue the server has,
    so with a small queue one tenant's flood still leaves the others room."""
    gen = tiny_gen(tiny, batch=1, max_q_size=40)
    assert gen.config.scheduler.tenant_queue_cap == 10
    for i in range(10):
        gen.enqueue(spec(i, "A"))
    with pytest.raises(QueueFullError, match="max-queue-per-tenant"):
        gen.enqueue(spec(10, "A"))
    gen.enqueue(spec(0, "B"))
    drain(gen)
    gen.close()
    assert SchedulerConfig(max_q_size=3).tenant_queue_cap == 1
    assert SchedulerConfig(max_q_size=40, max_q_per_tenant=7).tenant_queue_cap == 7


def test_priority_zero_starts_under_constant_higher_priority_traffic(tiny: LoadedModel) -> None:
    """A priority-5 job arrives at every step, enough to keep the one-row batch busy forever. With
    aging (here 50 levels per second, so priority 5 is a 0.1 s head start) the priority-0 job starts,
    and no job that arrived more than 0.1 s after it starts before it; without aging it never does."""
    for aging in (50.0, 0.0):
        gen = tiny_gen(tiny, batch=1, priority_aging=aging)
        gen.enqueue(spec(0, "", new=2, priority=5))
        gen.iterate()
        low = gen.enqueue(spec(1, "", new=2, priority=0))
        low_at = gen.jobs[low].enqueued_at
        started_before: list[float] = []
        low_started = False
        deadline = time.monotonic() + 5
        i = 2
        while time.monotonic() < deadline and not low_started:
            gen.enqueue(spec(i, "", new=2, priority=5))
            i += 1
            for e in gen.iterate():
                if isinstance(e, JobStarted):
                    if e.job_id == low:
                        low_started = True
                    else:
                        started_before.append(gen.jobs[e.job_id].enqueued_at)
            time.sleep(0.005)
        if aging:
            assert low_started
            assert all(t < low_at + 5 / aging for t in started_before)
        else:
            assert not low_started and len(started_before) > 20
        drain(gen)
        gen.close()


def test_a_preempted_job_never_comes_back_ahead_of_its_preemptor(tiny: LoadedModel) -> None:
    """Ranks differ by a constant: once a job outranks another, the other never outranks it back, so
    no pair of jobs preempts each other in turn, however long they wait."""
    gen = tiny_gen(tiny, batch=2, priority_aging=20.0)
    low = [gen.enqueue(spec(i, "", new=60, priority=0)) for i in range(2)]
    gen.iterate()
    high = gen.enqueue(spec(9, "", new=60, priority=10))
    gen.iterate()
    victims = [j for j in low if gen.jobs[j].preemptions]
    assert len(victims) == 1 and gen.jobs[high] in gen.scheduler.running
    q = gen.scheduler.queue
    assert q.outranks(gen.jobs[high], gen.jobs[victims[0]])
    assert not q.outranks(gen.jobs[victims[0]], gen.jobs[high])
    time.sleep(0.6)  # the victim's wait now exceeds the priority gap at this rate: it still may not preempt
    for _ in range(20):
        gen.iterate()
        assert gen.jobs[high].preemptions == 0
    # A priority-10 job that arrives after the low ones have aged past the gap does not preempt them.
    late = gen.enqueue(spec(11, "", new=5, priority=10))
    gen.iterate()
    assert gen.jobs[late] in gen.scheduler.queue
    drain(gen)
    gen.close()
