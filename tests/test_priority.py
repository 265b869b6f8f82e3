"""Priority with preemption (JobSpec.priority, engine/scheduler.py).

With the batch full of priority-0 jobs, a priority-10 job's first token comes in the next step, its
prompt cold (nothing of it in the prefix cache), and every job, the preempted ones included, ends
with the text it has alone (greedy, the shipped model).
On a tiny random model: the queue's order, preemption for pages as for batch rows, and equal
priorities never preempting each other.
"""

from __future__ import annotations

import pytest

from engine.generator import DynamicGenerator, GeneratorConfig
from engine.jobs import JobEvent, JobId, JobSpec, JobStarted, TokensGenerated
from engine.model.loader import LoadedModel
from engine.model.tokenizer import ChatMessage
from engine.scheduler import SchedulerConfig
from tests.conftest import PARITY_PROMPTS
from tests.tiny_generator import all_pages_idle


def run(gen: DynamicGenerator, tokens: dict[JobId, list[int]], steps: int) -> list[JobEvent]:
    """`steps` iterations: the tokens of the jobs in `tokens` added there; the events returned."""
    events: list[JobEvent] = []
    for _ in range(steps):
        for e in gen.iterate():
            events.append(e)
            if isinstance(e, TokensGenerated) and e.job_id in tokens:
                tokens[e.job_id].extend(e.token_ids)
        gen.check_invariants()
    return events


def cold_start(events: list[JobEvent], job: JobId) -> bool:
    """The job started in these events with nothing of its prompt found in the prefix cache."""
    return any(isinstance(e, JobStarted) and e.job_id == job and e.cached_tokens == 0 for e in events)


@pytest.mark.slow
def test_a_high_priority_job_starts_in_the_next_step_and_no_text_changes(smollm: LoadedModel) -> None:
    def chat(text: str) -> tuple[int, ...]:
        return tuple(smollm.tokenizer.encode_chat([ChatMessage("user", text)]))

    low = [JobSpec(chat(p), 48, ignore_eos=True) for p in PARITY_PROMPTS[:4]]
    # Plain text, not chat: no page in common with the running jobs' prompts (their chat template).
    high = JobSpec(tuple(smollm.tokenizer.encode(PARITY_PROMPTS[4])), 24, ignore_eos=True, priority=10)
    config = GeneratorConfig(page_size=16, num_pages=256, scheduler=SchedulerConfig(max_batch_size=4))
    solo = DynamicGenerator(smollm.model, smollm.tokenizer, config)
    alone = [solo.generate([s])[0].token_ids for s in (*low, high)]
    solo.close()

    gen = DynamicGenerator(smollm.model, smollm.tokenizer, config)  # a cold prefix cache
    ids = [gen.enqueue(s) for s in low]
    tokens: dict[JobId, list[int]] = {i: [] for i in ids}
    run(gen, tokens, 4)
    assert all(len(t) >= 2 for t in tokens.values())  # the batch is full and decoding
    urgent = gen.enqueue(high)
    tokens[urgent] = []
    step = run(gen, tokens, 1)
    # Its whole prefill, none of it from the prefix cache, and its first token took the very next step.
    assert cold_start(step, urgent) and len(tokens[urgent]) == 1
    assert sum(j.preemptions for j in gen.jobs.values()) == 1  # one row made room
    while gen.has_work():
        run(gen, tokens, 1)
    assert [tuple(tokens[i]) for i in (*ids, urgent)] == alone
    assert all_pages_idle(gen)
    gen.close()


def tiny_gen(tiny: LoadedModel, batch: int = 16, num_pages: int = 64) -> DynamicGenerator:
    config = GeneratorConfig(
        page_size=4, num_pages=num_pages, scheduler=SchedulerConfig(max_batch_size=batch, max_chunk_size=64)
    )
    return DynamicGenerator(tiny.model, tiny.tokenizer, config)


def start_order(gen: DynamicGenerator) -> list[JobId]:
    started: list[JobId] = []
    while gen.has_work():
        started += [e.job_id for e in gen.iterate() if isinstance(e, JobStarted)]
        gen.check_invariants()
    return started


def test_the_queue_admits_by_priority_then_arrival(tiny: LoadedModel) -> None:
    gen = tiny_gen(tiny, batch=1)
    first = gen.enqueue(JobSpec((3, 4, 5), 6, ignore_eos=True, priority=9))
    gen.iterate()
    order = [
        gen.enqueue(JobSpec((3, 4, 5 + i), 3, ignore_eos=True, priority=p))
        for i, p in enumerate((0, 5, 1, 5, -2, 1))
    ]
    assert start_order(gen) == [order[i] for i in (1, 3, 2, 5, 0, 4)]
    assert first not in order


def test_equal_priorities_never_preempt_each_other(tiny: LoadedModel) -> None:
    gen = tiny_gen(tiny, batch=2)
    running = [gen.enqueue(JobSpec((3, 4, 5 + i), 10, ignore_eos=True, priority=3)) for i in range(2)]
    gen.iterate()
    late = gen.enqueue(JobSpec((7, 8), 5, ignore_eos=True, priority=3))
    gen.iterate()
    assert all(gen.jobs[j].preemptions == 0 for j in running)
    assert gen.jobs[late] in gen.scheduler.queue
    assert start_order(gen) == [late]


def test_a_high_priority_job_preempts_for_pages_too(tiny: LoadedModel) -> None:
    """A batch with rows to spare but a pool without room: the lowest-priority, newest job goes."""
    specs = [
        JobSpec(tuple(range(3 + i, 23 + i)), 12, ignore_eos=True, priority=p) for i, p in enumerate((1, 0, 0))
    ]
    urgent_spec = JobSpec(tuple(range(30, 50)), 8, ignore_eos=True, priority=5)
    alone = [tiny_gen(tiny, num_pages=24).generate([s])[0].token_ids for s in (*specs, urgent_spec)]
    gen = tiny_gen(tiny, num_pages=24)  # a cold prefix cache
    ids = [gen.enqueue(s) for s in specs]
    tokens: dict[JobId, list[int]] = {i: [] for i in ids}
    run(gen, tokens, 2)
    urgent = gen.enqueue(urgent_spec)
    tokens[urgent] = []
    step = run(gen, tokens, 1)
    assert cold_start(step, urgent) and len(tokens[urgent]) == 1
    assert [gen.jobs[i].preemptions for i in ids] == [0, 0, 1]  # the newest of the lowest priority
    while gen.has_work():
        run(gen, tokens, 1)
    assert [tuple(tokens[i]) for i in (*ids, urgent)] == alone
    assert all_pages_idle(gen)
