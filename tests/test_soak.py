"""The soak benchmark, short, in CI: 64 streams with random cancels, disconnects, deadlines and
Cancel RPCs for 45 s against `dyngen serve` with a tiny random-weight model on 127.0.0.1.

Asserts what a short run can prove: no unexpected status, no malformed stream (lost or
extra events) and none left hanging, no orphaned job (the engine never holds more jobs
than there are open calls, in the median sample), no engine restart, the pool idle at
the end. RSS growth over 45 s is noise (allocator warm-up, batch shapes), so it is only
bounded loosely here; the 5 % criterion is the long run's (`python -m benchmarks soak --minutes 10`).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from benchmarks.served.soak import SoakSettings, render_report, soak
from tests.service_harness import ServerProcess, log_count, start_tiny_server
from tests.tiny_service_model import write_servable_tiny_gguf

pytestmark = [pytest.mark.timeout(240)]

SECONDS = 45.0
LOOSE_RSS_GROWTH_PERCENT = 30.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = write_servable_tiny_gguf(tmp_path_factory.mktemp("soak") / "tiny.gguf")
    s = start_tiny_server(model)
    yield s
    assert s.stop() == 0


def test_short_soak_has_no_unexpected_error_and_leaves_the_pool_idle(server: ServerProcess) -> None:
    # The tiny model finishes any of these calls in seconds: one still open a minute after the
    # end is a stream that lost its end (counted as unexpected).
    settings = SoakSettings(
        seconds=SECONDS,
        streams=64,
        seed=0,
        max_new_tokens=64,
        sample_interval=0.5,
        end_grace=60.0,
        cut_is_error=True,
    )
    report = soak(server.target, settings, server.process.pid)
    print(render_report(report, f"Short soak, {SECONDS:.0f} s, tiny model"))
    assert report.total_requests > 64
    assert report.unexpected_count == 0, report.unexpected
    assert report.pool_idle, report.final_info
    assert not report.orphans, f"engine jobs beyond open calls: {report.excess_jobs}"
    assert log_count(server, "engine_starting") == 1 and log_count(server, "engine_down") == 0
    assert len(report.engine_pids) == 1
    for which in ("front_end", "engine"):
        growth = report.rss_growth(which)
        assert growth is None or growth < LOOSE_RSS_GROWTH_PERCENT, (which, growth)
