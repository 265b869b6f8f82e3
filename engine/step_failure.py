"""A fault while running one job's share of a step, reported as data: the generator fails that job
alone (StopReason.ERROR) and the rest of the step goes on."""

from __future__ import annotations

from dataclasses import dataclass

from engine.job_state import JobState


@dataclass(frozen=True, eq=False)
class StepFailure:
    job: JobState
    where: str  # what the job was doing, for its error and the log ("running the model", ...)
    error: Exception
