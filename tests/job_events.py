"""Run jobs on an in-process generator together and keep each one's streamed events (the tests that
compare what a caller would have seen: banned strings, resumed jobs)."""

from __future__ import annotations

from engine.generator import DynamicGenerator
from engine.jobs import JobFinished, JobSpec, TokensGenerated

JobRun = tuple[list[TokensGenerated], JobFinished]


def run_jobs(gen: DynamicGenerator, specs: list[JobSpec], check_pool: bool = False) -> list[JobRun]:
    """Each job's TokensGenerated events and its JobFinished, in the specs' order; `check_pool`: the
    page pool's invariants after every iteration."""
    ids = [gen.enqueue(s) for s in specs]
    deltas: dict[str, list[TokensGenerated]] = {i: [] for i in ids}
    done: dict[str, JobFinished] = {}
    while len(done) < len(ids):
        for e in gen.iterate():
            if isinstance(e, TokensGenerated):
                deltas[e.job_id].append(e)
            elif isinstance(e, JobFinished):
                done[e.job_id] = e
        if check_pool:
            gen.check_invariants()
    return [(deltas[i], done[i]) for i in ids]
