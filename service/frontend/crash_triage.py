"""After an engine crash or hang: which open jobs resume at once, which are tried alone first, and
which are not run again.

A job is a suspect of a crash when the dead engine had started it (its JobStarted arrived: the
engine sends it before the step's forward) or had yet to answer its SUBMIT, and it delivered no
token since it was last submitted: the crash came while it was being admitted, or running its
prefill or its first step. Each crash as a suspect is a
strike; delivering a token clears them. A job with one strike (a PROBE) is resubmitted alone, once
the jobs resumed beside it have each delivered a token (or ended), so that a second crash names it
alone. Two strikes in a row make it POISON: it ends with INTERNAL and is never replayed, so a
request that kills the engine cannot crash-loop the service, and the others resume.

A job that never ran on the dead engine (queued) or that was delivering tokens is no suspect: an
outside kill of a busy engine poisons nobody, however often it comes.
"""

from __future__ import annotations

import enum

POISON_STRIKES = 2  # crashes in a row as a suspect that end a job


class Verdict(enum.Enum):
    RESUME = "resume"  # resubmitted as soon as the restarted engine is ready
    PROBE = "probe"  # resubmitted alone, after the resumed jobs delivered a token
    POISON = "poison"  # ended with INTERNAL; not run again


def strikes_after_crash(started: bool, progressed: bool, strikes: int) -> int:
    """A job's strikes after a crash: one more if it is a suspect (started on the dead engine, no
    token since it was last submitted), else unchanged (a token already cleared them)."""
    return strikes + 1 if started and not progressed else strikes


def verdict(strikes: int) -> Verdict:
    if strikes >= POISON_STRIKES:
        return Verdict.POISON
    return Verdict.PROBE if strikes else Verdict.RESUME


def poison_message(job_id: str) -> str:
    """What a poison job's caller reads."""
    return (
        f"job {job_id[:8]} was running when the engine failed twice in a row; it is not run again "
        "(if the request itself crashes the engine, please report it)"
    )
