"""When to restart a dead or hung engine, and when to stop trying.

A start that served for `stable_seconds` resets the count; a start that died before
that (never loaded, or crashed soon after) counts as a failure and doubles the wait
before the next one, unless it left open jobs to resume: only crashes that resume
nothing count toward the crash loop. After `max_failures` failures in a row the front end gives up
(`dyngen serve` exits 1) rather than respawn forever a model that cannot load.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    backoff_seconds: float = 0.5  # wait before the first restart after a failure
    max_backoff_seconds: float = 30.0
    max_failures: int = 5  # unstable starts in a row before giving up
    stable_seconds: float = 60.0  # a start that served this long was healthy


class RestartTracker:
    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.failures = 0

    def after_exit(self, served_seconds: float | None, resuming: bool = False) -> float | None:
        """Seconds to wait before the next start, or None to give up.

        `served_seconds`: how long the dead engine was ready (None: it never was). `resuming`: it
        left jobs to resume. Such a crash is no failure of the start (the crash triage deals with a
        job that keeps killing engines) and the restart is at once: the jobs' streams are paused.
        """
        p = self.policy
        if served_seconds is not None and served_seconds >= p.stable_seconds:
            self.failures = 0
        if resuming and served_seconds is not None:
            return 0.0
        self.failures += 1
        if self.failures > p.max_failures:
            return None
        return float(min(p.max_backoff_seconds, p.backoff_seconds * 2 ** (self.failures - 1)))
