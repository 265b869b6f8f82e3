"""When `dyngen cluster` starts a replica that exited again."""

from __future__ import annotations

import time

from service.frontend.restart_policy import RestartPolicy, RestartTracker


class ReplicaRestarts:
    """When to start a replica that exited again, as `dyngen serve` decides for its engine
    (RestartPolicy: a doubling wait, and a give-up after failed starts in a row). A replica that
    exits 2 refused its flags, which no restart mends."""

    def __init__(self, replicas: int, policy: RestartPolicy | None = None) -> None:
        self._trackers = [RestartTracker(policy or RestartPolicy()) for _ in range(replicas)]
        self._started = [time.monotonic()] * replicas
        self._due: list[float | None] = [None] * replicas

    def exited(self, i: int, code: int) -> float | None:
        """Seconds until replica i starts again, or None: stop the cluster."""
        if code == 2:
            return None
        wait = self._trackers[i].after_exit(time.monotonic() - self._started[i])
        self._due[i] = None if wait is None else time.monotonic() + wait
        return wait

    def why(self, i: int, code: int) -> str:
        if code == 2:
            return "refused its flags (exit 2; its error is above)"
        return f"failed {self._trackers[i].failures} starts in a row (last exit {code}; its error is above)"

    def due(self, i: int) -> bool:
        due = self._due[i]
        return due is not None and time.monotonic() >= due

    def started(self, i: int) -> None:
        self._started[i] = time.monotonic()
        self._due[i] = None
