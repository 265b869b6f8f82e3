"""How fast the engine finishes jobs, for the retry delay a RESOURCE_EXHAUSTED refusal carries.

A full queue, too many open streams or a tenant's cap all clear as jobs finish: one more finish
makes room for one more caller. So a refused caller is told to come back after the time the
engine takes to finish as many jobs as stand between it and a free place, at the rate measured
over the last window; without a measurement yet, a fixed second.
"""

from __future__ import annotations

import collections
import time

WINDOW_SECONDS = 10.0  # finishes counted for the rate: long enough to average a batch's ends
MIN_RETRY_SECONDS = 0.1  # never "retry at once": a burst of refused callers would all come back
MAX_RETRY_SECONDS = 30.0
UNMEASURED_RETRY_SECONDS = 1.0


class DrainRate:
    def __init__(self, window: float = WINDOW_SECONDS) -> None:
        self._window = window
        self._finishes: collections.deque[float] = collections.deque()
        self._since = time.monotonic()  # when measuring began: a young window is shorter

    def _trim(self, now: float) -> None:
        while self._finishes and self._finishes[0] < now - self._window:
            self._finishes.popleft()

    def finished(self, now: float | None = None) -> None:
        """One job finished (any reason: it left the engine and freed its place)."""
        now = time.monotonic() if now is None else now
        self._finishes.append(now)
        self._trim(now)

    def per_second(self, now: float | None = None) -> float | None:
        """Finishes per second over the window; None before any."""
        now = time.monotonic() if now is None else now
        self._trim(now)
        if not self._finishes:
            return None
        span = min(self._window, now - self._since)
        return len(self._finishes) / max(span, MIN_RETRY_SECONDS)

    def retry_after(self, ahead: int = 1, now: float | None = None) -> float:
        """Seconds until `ahead` more jobs have finished, at the measured rate (clamped)."""
        rate = self.per_second(now)
        if rate is None:
            return UNMEASURED_RETRY_SECONDS
        return min(MAX_RETRY_SECONDS, max(MIN_RETRY_SECONDS, max(1, ahead) / rate))
