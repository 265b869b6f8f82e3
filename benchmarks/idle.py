"""Wait until the machine is idle before a timed part: others' CPU use, read from /proc/stat.

The caller sleeps while it waits, so what /proc/stat counts as busy is everyone else (tests,
builds, a peer's leftover threads). On 2 cores one busy process is half the machine, so a timing
taken next to it means little; after the timeout the part runs anyway and says what it saw.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")


@dataclass(frozen=True)
class IdleWait:
    waited: float  # seconds
    busy: float  # the machine's busy fraction over the last window, 0..1
    idle: bool  # False: gave up at the timeout

    def describe(self) -> str:
        state = "idle" if self.idle else "NOT idle (gave up; timings may be disturbed)"
        return f"waited {self.waited:.1f} s, machine {state}: {self.busy:.0%} busy"


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot."""
    fields = [int(v) for v in PROC_STAT.read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already inside user
    return total - idle, total


def busy_fraction(window: float) -> float:
    busy0, total0 = _cpu_times()
    time.sleep(window)
    busy1, total1 = _cpu_times()
    return (busy1 - busy0) / max(total1 - total0, 1)


def wait_for_idle(max_busy: float, timeout: float, window: float = 1.0, quiet_windows: int = 3) -> IdleWait:
    """Return once `quiet_windows` windows in a row were at most `max_busy` busy, or at `timeout`."""
    t0 = time.monotonic()
    quiet = 0
    busy = 1.0
    while True:
        busy = busy_fraction(window)
        quiet = quiet + 1 if busy <= max_busy else 0
        waited = time.monotonic() - t0
        if quiet >= quiet_windows:
            return IdleWait(waited, busy, True)
        if waited >= timeout:
            return IdleWait(waited, busy, False)
