"""`python -m benchmarks load` against a real `dyngen serve` (tiny model): reflection only, ghz's report."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.served.load import main as load_main
from tests.service_harness import ServerProcess, start_tiny_server
from tests.tiny_service_model import write_servable_tiny_gguf

pytestmark = pytest.mark.timeout(300)

DATA = '{"chat": {"messages": [{"role": "user", "content": "Story number {{.RequestNumber}}."}]}, "max_new_tokens": 8, "ignore_eos": true}'


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = write_servable_tiny_gguf(tmp_path_factory.mktemp("load") / "tiny.gguf")
    s = start_tiny_server(model, "--max-streams", "6")
    yield s
    assert s.stop() == 0


def test_summary_of_a_streaming_call(server: ServerProcess, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--insecure", "--call", "dyngen.v1.Generator.Generate", "-c", "4", "-n", "12", "-d", DATA]
    assert load_main([*args, server.target]) == 0
    out = capsys.readouterr().out
    assert "Count:\t12" in out and "[OK]\t12 responses" in out, out
    assert "Time to first token" in out and "Inter-token latency" in out
    assert "Tokens:\t96 " in out  # 12 streams x 8 tokens


def test_json_report_past_the_stream_limit(server: ServerProcess, tmp_path: Path) -> None:
    # 8 workers against --max-streams 6: some calls are refused, and the report counts them.
    out = tmp_path / "report.json"
    command = [
        *(sys.executable, "-m", "benchmarks", "load", "--insecure", "--call", "dyngen.v1.Generator/Generate"),
        *("-c", "8", "-n", "16", "-d", DATA, "-O", "json", "-o", str(out), server.target),
    ]
    subprocess.run(command, check=True, timeout=240)
    report = json.loads(out.read_text())
    statuses = report["statusCodeDistribution"]
    assert sum(statuses.values()) == report["count"] == 16
    assert set(statuses) <= {"OK", "ResourceExhausted"} and statuses.get("OK", 0) >= 6
    assert report["streams"]["tokens"] == 8 * statuses["OK"]
    assert len(report["details"]) == 16


def test_unknown_method_and_bad_data_fail_before_any_call(
    server: ServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    assert load_main(["--insecure", "--call", "dyngen.v1.Generator.Nope", server.target]) == 1
    assert "has no method 'Nope'" in capsys.readouterr().err
    bad = ["--insecure", "--call", "dyngen.v1.Generator.Generate", "-d", '{"no_such_field": 1}']
    assert load_main([*bad, server.target]) == 1
    assert "no_such_field" in capsys.readouterr().err
