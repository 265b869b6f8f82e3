"""`python -m benchmarks load` without a server: ghz's templates, durations and report."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from benchmarks.served.load_report import make_report, percentile, status_name, summary, to_json
from benchmarks.served.load_runner import LoadRun, Sample
from benchmarks.served.load_template import (
    CallData,
    TemplateError,
    check_template,
    parse_duration,
    render_json,
)


def test_templates_render_per_request_and_stay_json() -> None:
    template = '{"text": "Story {{.RequestNumber}} by {{ .WorkerID }}", "max_new_tokens": 8}'
    rendered = render_json(template, CallData(41, "g3c0"))
    assert json.loads(rendered) == {"text": "Story 41 by g3c0", "max_new_tokens": 8}
    assert len(json.loads(render_json('{"id": "{{.UUID}}"}', CallData(0, "g0c0")))["id"]) == 36
    with pytest.raises(TemplateError, match="RequestNumbr"):
        check_template("{{.RequestNumbr}}")


def test_durations_read_like_go() -> None:
    assert parse_duration("20s") == 20.0
    assert parse_duration("1m30s") == 90.0
    assert parse_duration("250ms") == 0.25
    assert parse_duration("2") == 2.0
    assert parse_duration("0") == 0.0
    with pytest.raises(TemplateError):
        parse_duration("20 seconds")


def test_percentiles_are_nearest_rank() -> None:
    values = [float(x) for x in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([3.0], 10) == 3.0


def test_report_has_ghz_sections_and_stream_latencies() -> None:
    ok = [Sample(i * 0.1, 1.0 + i * 0.1, "OK", "", 0.2 + i * 0.01, (0.05, 0.06), 3) for i in range(9)]
    failed = Sample(0.5, 20.0, "DEADLINE_EXCEEDED", "Deadline Exceeded")
    report = make_report(LoadRun((*ok, failed), seconds=21.0, cut_short=0))
    assert report.count == 10 and report.tokens == 27
    assert report.fastest == 1.0 and report.slowest == 20.0
    assert len(report.histogram) == 10 and sum(b.count for b in report.histogram) == 10
    assert report.histogram[-1].mark == 20.0
    text = summary(report)
    for section in (
        "Summary:",
        "Count:\t10",
        "Requests/sec:\t0.48",
        "Response time histogram (s):",
        "Latency distribution:",
        "  50 % in ",
        "Time to first token",
        "Inter-token latency",
        "Status code distribution:",
        "[OK]\t9 responses",
        "[DeadlineExceeded]\t1 responses",
        "Error distribution:",
        "[1]\trpc error: code = DeadlineExceeded desc = Deadline Exceeded",
    ):
        assert section in text, section
    obj = json.loads(to_json(report, {"call": "x"}, datetime.now(UTC)))
    assert obj["count"] == 10 and obj["slowest"] == 20_000_000_000
    assert obj["statusCodeDistribution"] == {"OK": 9, "DeadlineExceeded": 1}
    assert [d["percentage"] for d in obj["latencyDistribution"]] == [10, 25, 50, 75, 90, 95, 99]
    assert obj["streams"]["tokens"] == 27 and len(obj["details"]) == 10
    assert status_name("RESOURCE_EXHAUSTED") == "ResourceExhausted"
