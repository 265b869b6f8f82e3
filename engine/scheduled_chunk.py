"""ScheduledChunk: what one row of a job runs in the next forward (the scheduler's output)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.job_state import JobState
from engine.sequence import SequenceState


@dataclass(frozen=True)
class ScheduledChunk:
    job: JobState
    num_tokens: int  # new tokens of the row in the forward, starting at its `computed`
    draft: tuple[int, ...] = ()  # speculative tokens after the job's last token (verified in this forward)
    negative: bool = False  # the row is the guided job's negative sequence, not its own

    @property
    def seq(self) -> SequenceState:
        """The row this chunk runs."""
        if self.negative:
            assert self.job.negative is not None
            return self.job.negative
        return self.job
