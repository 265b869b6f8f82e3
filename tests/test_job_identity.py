"""A JobState is compared by identity: the scheduler's membership tests and removals find the
job itself, never another job whose fields happen to be equal, and cost no field comparisons."""

from __future__ import annotations

from engine.cache.pages import PagePool
from engine.job_state import JobState
from engine.jobs import JobId, JobSpec
from engine.output.text_stream import TextStream
from engine.sampling.sampler import SamplerState
from engine.scheduler import Scheduler, SchedulerConfig


class _NoDecode:
    """Just enough of a tokenizer for a TextStream that never decodes."""

    vocab_size = 16
    eos_token_ids: frozenset[int] = frozenset()

    def decode(self, ids: object, skip_special_tokens: bool = False) -> str:
        raise AssertionError("not decoded in these tests")


def twin_jobs() -> tuple[JobState, JobState]:
    spec = JobSpec(prompt_ids=(1, 2, 3), max_new_tokens=4)
    sampler = SamplerState(spec.sampling, spec.prompt_ids, 16)
    text = TextStream(_NoDecode(), (), True)  # type: ignore[arg-type]

    # Everything equal, the shared helpers included: only identity tells them apart.
    def make() -> JobState:
        return JobState(JobId("same"), spec, sampler, text, 0.0, 0, tokens=[1, 2, 3])

    return make(), make()


def test_equal_fields_are_not_the_same_job() -> None:
    a, b = twin_jobs()
    assert a != b
    assert a in [a] and a not in [b]
    assert len({a, b}) == 2


def test_scheduler_removes_the_job_itself() -> None:
    scheduler = Scheduler(SchedulerConfig(), PagePool(8, 4))
    a, b = twin_jobs()
    scheduler.submit(a)
    scheduler.submit(b)
    scheduler.remove(b)
    assert list(scheduler.queue) == [a] and scheduler.queue.peek() is a
