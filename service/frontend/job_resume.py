"""JobResume: the open jobs of a dead engine, from its death to their resumption on the next one.

When the engine dies (crash, kill, or the watchdog's kill of a hang), `triage` sorts the open
jobs (crash_triage.py): cancelled ones end, poison ones end INTERNAL, the rest wait. When the next
engine is READY, `resume_waiting` submits every waiting job without a strike again under its own
id with its delivered tokens as JobSpec.resume_output, before new jobs; then the suspects one at a
time (`next_probe`), each once the jobs resumed beside it delivered a token (`settled`). A call
whose first SUBMIT the engine never answered is adopted as a waiting suspect (`adopt_unanswered`).

It alone writes JobChannel's resume fields (waiting, strikes, ran, progressed, submitting,
resumes): the client tells it what the job's events and SUBMITs showed. It talks to the engine
only through ResumeHost (EngineClient).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import structlog

from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from engine.errors import ErrorKind
from engine.ids import JobId
from engine.jobs import JobError, JobFinished, JobSpec, JobTimings, StopReason
from service.frontend.codec import event_to_proto
from service.frontend.crash_triage import Verdict, poison_message, strikes_after_crash, verdict
from service.frontend.event_buffer import EngineDownError
from service.frontend.job_channel import JobChannel, short_id

log = structlog.get_logger("dyngen.engine_client")


class EngineCallError(Exception):
    """An engine refused or could not take a call (EngineRejectedError, EngineBusyError): raised by
    ResumeHost.submit_again for a SUBMIT that will not be queued however long one waits."""

    def __init__(self, message: str, adapter_missing: bool = False) -> None:
        super().__init__(message)
        self.adapter_missing = adapter_missing


@dataclass(frozen=True)
class Recovery:
    """One engine restart as its open jobs saw it."""

    resumed: int  # jobs submitted again as soon as it was ready
    poisoned: int  # jobs ended (two crashes in a row as a suspect)
    outage_seconds: float  # from the old engine's end to the resumed jobs queued on the new one


class ResumeHost(Protocol):
    """What JobResume needs of the engine client."""

    @property
    def jobs(self) -> dict[str, JobChannel]: ...

    def emit(self, event: pb.GenerateEvent) -> None:
        """Hand a job event to its stream, as if the engine had sent it."""
        ...

    async def submit_again(self, job_id: str, spec: JobSpec) -> None:
        """SUBMIT to the engine that is starting; EngineDownError if it dies first, EngineCallError
        if it refuses."""
        ...

    def engine_serving(self) -> bool:
        """An engine is up and READY (probes may go to it)."""
        ...


class JobResume:
    def __init__(
        self,
        host: ResumeHost,
        loop: asyncio.AbstractEventLoop,
        on_recovered: list[Callable[[Recovery], None]],
    ) -> None:
        self._host = host
        self._loop = loop
        self._on_recovered = on_recovered
        self._down_at: float | None = None  # when the engine with open jobs died
        self.poisoned: list[str] = []  # short ids poisoned by that crash, for the log lines
        self._probe: JobChannel | None = None  # the suspect resubmitted alone (crash_triage.py)
        self._clearing: set[str] = set()  # resumed jobs yet to deliver a token (the next probe waits)

    def engine_lost(self) -> None:
        """The engine died: no probe or resumed job is in flight any more."""
        self._probe = None
        self._clearing.clear()

    def outage_begins(self) -> None:
        """Jobs wait for the next engine: their outage is timed from the first engine that died."""
        if self._down_at is None:
            self._down_at = time.monotonic()

    def triage(self) -> None:
        """The dead engine's open jobs: cancelled ones end, poison ones end INTERNAL, the rest wait."""
        self.poisoned = []
        for job in list(self._host.jobs.values()):
            if job.finished or not job.accepted or job.spec is None:
                continue  # its events wait for its stream; or its first SUBMIT is unanswered (submit adopts it)
            if job.cancel_sent:
                self.end(job, StopReason.CANCELLED)
                continue
            job.strikes = strikes_after_crash(job.ran or job.submitting, job.progressed, job.strikes)
            job.ran = job.progressed = job.submitting = False
            if verdict(job.strikes) is Verdict.POISON:
                self.poisoned.append(short_id(job.job_id))
                self.end(job, StopReason.ERROR, JobError(ErrorKind.INTERNAL, poison_message(job.job_id)))
            else:
                job.waiting = True

    def end(self, job: JobChannel, reason: StopReason, error: JobError | None = None) -> None:
        """End a job the engine no longer holds, as the engine would have: its JobFinished."""
        assert job.spec is not None
        job.waiting = False
        timings = JobTimings(0.0, 0.0, 0.0)
        self._host.emit(
            event_to_proto(
                JobFinished(
                    JobId(job.job_id),
                    job.spec.identifier,
                    reason,
                    None,
                    None,
                    job.prompt_tokens,
                    len(job.delivered),
                    job.cached_tokens,
                    timings,
                    error=error,
                    adapter=job.spec.adapter,
                )
            )
        )

    async def resume_waiting(self) -> None:
        """On a ready engine, before new jobs: submit the waiting jobs again (suspects later, alone)."""
        waiting = [j for j in self._host.jobs.values() if j.waiting]
        cleared = sorted((j for j in waiting if verdict(j.strikes) is Verdict.RESUME), key=_arrival)
        self._clearing = {j.job_id for j in cleared}
        resumed = await asyncio.gather(*(self._resubmit(j) for j in cleared))
        outage = 0.0 if self._down_at is None else time.monotonic() - self._down_at
        recovery = Recovery(sum(resumed), len(self.poisoned), outage)
        if waiting or self.poisoned:
            log.info(
                "engine_recovered",
                outage_seconds=round(outage, 3),
                resumed=[short_id(j.job_id) for j, ok in zip(cleared, resumed, strict=True) if ok],
                poisoned=self.poisoned,
                probes=[short_id(j.job_id) for j in waiting if j.strikes],
            )
            for listener in self._on_recovered:
                listener(recovery)
        self._down_at = None
        self.poisoned = []
        self.next_probe()

    async def _resubmit(self, job: JobChannel) -> bool:
        """Submit a waiting job again, its delivered tokens as resume_output; whether it was queued."""
        spec = job.spec
        if spec is None or job.job_id not in self._host.jobs or job.finished:
            return False
        if len(job.delivered) >= spec.max_new_tokens:  # all delivered: its end was lost with the engine
            self.end(job, StopReason.MAX_NEW_TOKENS)
            return False
        job.waiting = False  # from here a cancel goes to the engine, behind this SUBMIT
        resume = dataclasses.replace(spec, resume_output=tuple(job.delivered))
        job.submitting = True
        try:
            await self._host.submit_again(job.job_id, resume)
        except EngineDownError:
            return False  # it died again: that crash's triage has the job waiting again
        except EngineCallError as exc:
            kind = ErrorKind.NOT_FOUND if exc.adapter_missing else ErrorKind.INTERNAL
            self.end(job, StopReason.ERROR, JobError(kind, f"the job could not resume: {exc}"))
            self.settled(job)
            return False
        finally:
            job.submitting = False
        job.resumes += 1
        return True

    def next_probe(self) -> None:
        """Submit the next suspect alone, once the resumed jobs have each delivered a token."""
        if self._probe is not None or self._clearing or not self._host.engine_serving():
            return
        suspects = sorted((j for j in self._host.jobs.values() if j.waiting and j.strikes), key=_arrival)
        if suspects:
            self._probe = suspects[0]
            self._loop.create_task(self._run_probe(suspects[0]))

    async def _run_probe(self, job: JobChannel) -> None:
        if not await self._resubmit(job) and self._probe is job:
            self.settled(job)

    def forgotten(self, job: JobChannel) -> None:
        """The job left the client's table: a probe waiting on it, or it as the probe, goes on."""
        if job.job_id in self._clearing or self._probe is job:
            self.settled(job)

    def settled(self, job: JobChannel) -> None:
        """The job delivered a token or ended: it holds back probes no longer."""
        self._clearing.discard(job.job_id)
        if self._probe is job:
            self._probe = None
        self.next_probe()

    def adopt_unanswered(self, job: JobChannel) -> None:
        """A job whose first SUBMIT the engine died without answering waits for the next engine like
        any open job, as a suspect (the engine may have died handling it: it is tried alone, and a
        second such crash poisons it). The caller has checked that another engine comes."""
        job.strikes = strikes_after_crash(True, False, job.strikes)
        job.waiting = True
        self.next_probe()  # if the next engine is ready already

    # -- what the job's events and SUBMITs tell ------------------------------------------------------

    def started(self, job: JobChannel) -> None:
        """Its JobStarted arrived: the current engine runs it."""
        job.ran = True

    def delivered(self, job: JobChannel) -> None:
        """It got a token: its strikes clear, and it holds back probes no longer."""
        if not job.progressed:
            job.progressed, job.strikes = True, 0
            self.settled(job)

    def submit_sent(self, job: JobChannel) -> None:
        job.submitting = True

    def submit_answered(self, job: JobChannel) -> None:
        """Its SUBMIT was answered, refused or given up on (not: lost with the engine, which
        triage reads first)."""
        job.submitting = False


def _arrival(job: JobChannel) -> float:
    return job.submitted_at
