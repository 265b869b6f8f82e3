"""JobChannel: one job as the front end holds it (its stream's buffer, what a resume needs)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from engine.jobs import JobSpec
from service.frontend.event_buffer import EventBuffer


def short_id(job_id: str) -> str:
    """What logs show of a job id: enough to follow one job, too little to name it to the server."""
    return job_id[:8]


@dataclass
class JobChannel:
    """Where one job's events wait for its (single) stream."""

    job_id: str
    owner: str  # the tenant that created it ("" without authentication)
    submitted_at: float
    prompt_tokens: int = 0
    events: EventBuffer = field(default_factory=EventBuffer)
    accepted: bool = False
    streamed: bool = False
    finished: bool = False
    cancel_sent: bool = False
    grace_timer: asyncio.TimerHandle | None = None
    affinity: str = ""  # the request's prefix-affinity key (dyngen_client.affinity), for the logs
    priority: int = 0  # GenerateRequest.priority (the servicer caps a tenant's jobs above 0)
    # What an engine restart needs to resume it: these four written by engine_client.py (from the
    # job's SUBMIT and events), the six after them by job_resume.py alone.
    spec: JobSpec | None = None  # what it was submitted with
    delivered: list[int] = field(default_factory=list)  # the output token ids its stream got
    started_sent: bool = False  # its JobStarted went to its stream (a resumed job's next ones do not)
    cached_tokens: int = 0  # from that JobStarted
    ran: bool = False  # the current engine started it
    submitting: bool = False  # a SUBMIT of it is unanswered (the engine may be handling it)
    progressed: bool = False  # it got a token since it was last submitted
    strikes: int = 0  # crashes in a row it was a suspect of (crash_triage.py)
    waiting: bool = False  # its engine died: waiting to be submitted again
    resumes: int = 0  # times submitted again to a restarted engine
