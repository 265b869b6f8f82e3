"""ghz's report of a load run: the summary text (ghz's default) and the JSON (`--format json`).

Both carry ghz's parts (count, total, slowest/fastest/average, requests/s, a latency
histogram and percentiles, status code and error distributions) and, for streams, time to
the first text delta and the gaps between deltas (ghz has no notion of tokens). In JSON,
durations are integer nanoseconds and histogram marks seconds, as ghz writes them.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from benchmarks.served.load_runner import LoadRun, Sample

PERCENTAGES = (10, 25, 50, 75, 90, 95, 99)
HISTOGRAM_BUCKETS = 10
BAR_WIDTH = 40


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest rank: the smallest value with at least pct% of the values at or below it."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]


def status_name(code: str) -> str:
    """grpc.StatusCode names as Go's codes print them (DEADLINE_EXCEEDED -> DeadlineExceeded)."""
    return "OK" if code == "OK" else "".join(part.capitalize() for part in code.split("_"))


@dataclass(frozen=True)
class Bucket:
    mark: float  # seconds: the bucket's upper bound
    count: int


@dataclass(frozen=True)
class Report:
    count: int
    total: float  # seconds, the whole run
    fastest: float
    slowest: float
    average: float
    rps: float
    histogram: tuple[Bucket, ...]
    latencies: tuple[tuple[int, float], ...]  # (percentage, seconds)
    statuses: tuple[tuple[str, int], ...]  # most frequent first
    errors: tuple[tuple[str, int], ...]  # "rpc error: code = X desc = ...", most frequent first
    ttft: tuple[tuple[int, float], ...]  # streams with deltas only
    inter_token: tuple[tuple[int, float], ...]
    tokens: int
    cut_short: int
    samples: tuple[Sample, ...]


def _histogram(latencies: Sequence[float]) -> tuple[Bucket, ...]:
    if not latencies:
        return ()
    lo, hi = min(latencies), max(latencies)
    width = (hi - lo) / HISTOGRAM_BUCKETS
    if width == 0:
        return (Bucket(lo, len(latencies)),)
    marks = [lo + width * (i + 1) for i in range(HISTOGRAM_BUCKETS)]
    counts = [0] * HISTOGRAM_BUCKETS
    for x in latencies:  # a value on a mark belongs to the bucket the mark closes
        counts[min(HISTOGRAM_BUCKETS - 1, max(0, math.ceil((x - lo) / width) - 1))] += 1
    return tuple(Bucket(m, c) for m, c in zip(marks, counts, strict=True))


def make_report(run: LoadRun) -> Report:
    samples = run.samples
    latencies = [s.latency for s in samples]
    ttfts = [s.first_token for s in samples if s.first_token is not None]
    gaps = [g for s in samples for g in s.token_gaps]
    errors = Counter(
        f"rpc error: code = {status_name(s.status)} desc = {s.error}" for s in samples if s.status != "OK"
    )
    return Report(
        count=len(samples),
        total=run.seconds,
        fastest=min(latencies, default=math.nan),
        slowest=max(latencies, default=math.nan),
        average=sum(latencies) / len(latencies) if latencies else math.nan,
        rps=len(samples) / run.seconds if run.seconds > 0 else math.nan,
        histogram=_histogram(latencies),
        latencies=tuple((p, percentile(latencies, p)) for p in PERCENTAGES) if latencies else (),
        statuses=tuple(Counter(s.status for s in samples).most_common()),
        errors=tuple(errors.most_common()),
        ttft=tuple((p, percentile(ttfts, p)) for p in PERCENTAGES) if ttfts else (),
        inter_token=tuple((p, percentile(gaps, p)) for p in PERCENTAGES) if gaps else (),
        tokens=sum(s.tokens for s in samples),
        cut_short=run.cut_short,
        samples=samples,
    )


def _duration(seconds: float) -> str:
    if math.isnan(seconds):
        return "-"
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def summary(report: Report) -> str:
    lines = [
        "",
        "Summary:",
        f"  Count:\t{report.count}",
        f"  Total:\t{_duration(report.total)}",
        f"  Slowest:\t{_duration(report.slowest)}",
        f"  Fastest:\t{_duration(report.fastest)}",
        f"  Average:\t{_duration(report.average)}",
        f"  Requests/sec:\t{report.rps:.2f}",
    ]
    if report.cut_short:
        lines.append(f"  Cut short:\t{report.cut_short} (in flight when the duration ended; not counted)")
    if report.histogram:
        in_seconds = report.slowest >= 1
        scale, unit = (1.0, "s") if in_seconds else (1e3, "ms")
        most = max(b.count for b in report.histogram)
        lines += ["", f"Response time histogram ({unit}):"]
        for b in report.histogram:
            bar = "∎" * (round(BAR_WIDTH * b.count / most) if most else 0)
            lines.append(f"  {b.mark * scale:.3f} [{b.count}]\t|{bar}")
    if report.latencies:
        lines += ["", "Latency distribution:"]
        lines += [f"  {p} % in {_duration(v)} " for p, v in report.latencies]
    if report.ttft:
        lines += ["", "Time to first token (first text delta):"]
        lines += [f"  {p} % in {_duration(v)} " for p, v in report.ttft]
    if report.inter_token:
        lines += ["", "Inter-token latency (between text deltas):"]
        lines += [f"  {p} % in {_duration(v)} " for p, v in report.inter_token]
    if report.tokens:
        lines += ["", f"Tokens:\t{report.tokens} ({report.tokens / report.total:.1f} tok/s over the run)"]
    lines += ["", "Status code distribution:"]
    lines += [f"  [{status_name(code)}]\t{n} responses" for code, n in report.statuses]
    if report.errors:
        lines += ["", "Error distribution:"]
        lines += [f"  [{n}]\t{text}" for text, n in report.errors]
    return "\n".join(lines) + "\n"


def _ns(seconds: float) -> int | None:
    return None if math.isnan(seconds) else round(seconds * 1e9)


def _distribution(pairs: Sequence[tuple[int, float]]) -> list[dict[str, int | None]]:
    return [{"percentage": p, "latency": _ns(v)} for p, v in pairs]


def to_json(report: Report, options: dict[str, object], started: datetime) -> str:
    """ghz's JSON report (its field names), with a `streams` object of ours."""
    obj: dict[str, object] = {
        "date": started.astimezone(UTC).isoformat(),
        "options": options,
        "count": report.count,
        "total": _ns(report.total),
        "average": _ns(report.average),
        "fastest": _ns(report.fastest),
        "slowest": _ns(report.slowest),
        "rps": None if math.isnan(report.rps) else report.rps,
        "errorDistribution": dict(report.errors),
        "statusCodeDistribution": {status_name(code): n for code, n in report.statuses},
        "latencyDistribution": _distribution(report.latencies),
        "histogram": [
            {"mark": b.mark, "count": b.count, "frequency": b.count / report.count if report.count else 0.0}
            for b in report.histogram
        ],
        "streams": {
            "ttftDistribution": _distribution(report.ttft),
            "interTokenDistribution": _distribution(report.inter_token),
            "tokens": report.tokens,
            "tokensPerSecond": report.tokens / report.total if report.total > 0 else None,
            "cutShort": report.cut_short,
        },
        "details": [
            {
                "timestamp": datetime.fromtimestamp(started.timestamp() + s.start, UTC).isoformat(),
                "latency": _ns(s.latency),
                "error": s.error,
                "status": status_name(s.status),
            }
            for s in report.samples
        ],
    }
    return json.dumps(obj, indent=2, ensure_ascii=False)
