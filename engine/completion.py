"""A job's end as its JobFinished event, and jobs run to completion (the generator's `generate()`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.job_state import JobState
from engine.jobs import (
    JobError,
    JobEvent,
    JobFinished,
    JobId,
    JobStarted,
    JobTimings,
    PrefillProgress,
    StopReason,
    TokenLogprob,
    TokensGenerated,
)


def finished_event(
    job: JobState,
    reason: StopReason,
    token: int | None,
    stop_string: str | None,
    text: str,
    error: JobError | None = None,
) -> JobFinished:
    """The job's JobFinished, with its counts and timings as of now."""
    now = time.perf_counter()
    scheduled = job.scheduled_at if job.scheduled_at is not None else now
    first = job.first_token_at if job.first_token_at is not None else now
    return JobFinished(
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


@dataclass(frozen=True)
class Completion:
    """The whole result of one job."""

    job_id: JobId
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    finished: JobFinished


def run_to_completion(ids: Sequence[JobId], iterate: Callable[[], list[JobEvent]]) -> list[Completion]:
    """`iterate` until every job of `ids` finished; their results in that order."""
    texts: dict[JobId, list[str]] = {i: [] for i in ids}
    tokens: dict[JobId, list[int]] = {i: [] for i in ids}
    logprobs: dict[JobId, list[TokenLogprob]] = {i: [] for i in ids}
    done: dict[JobId, JobFinished] = {}
    while len(done) < len(ids):
        for event in iterate():
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
