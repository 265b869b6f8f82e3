"""The serving benchmark's own logic (benchmarks/serving): seeded traces, Poisson arrivals, the
SLO verdict and the rate sweep's search. The servers it drives are exercised by running it."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import pytest

import benchmarks.serving.sweep as sweep_module
from benchmarks.serving import trace
from benchmarks.serving.servers import Send
from benchmarks.serving.sweep import RateResult, Slo, goodput, knee, percentile, requests_needed, sweep
from benchmarks.serving.timing import RequestTiming
from engine.model.shipped_model import default_model_path
from engine.model.tokenizer import HFTokenizer

SLO = Slo(ttft_p99=2.0, itl_p99=0.2)


@pytest.fixture(scope="module")
def tokenizer() -> HFTokenizer:
    return HFTokenizer(default_model_path())


def test_traces_are_seeded_and_shaped(tokenizer: HFTokenizer) -> None:
    chat = trace.build("chat", tokenizer, 80, 3, None)
    assert chat == trace.build("chat", tokenizer, 80, 3, None)
    assert chat != trace.build("chat", tokenizer, 80, 4, None)
    kinds = {r.kind for r in chat.requests}
    assert kinds == {"short", "shared", "long"}
    assert all(trace.MIN_OUTPUT <= r.output_tokens <= trace.MAX_OUTPUT for r in chat.requests)
    shared = [r.prompt for r in chat.requests if r.kind == "shared"]
    assert len({p[:900] for p in shared}) == 1  # one system prompt shared by all of them
    editing = trace.build("editing", tokenizer, 10, 0, None)
    for r in editing.requests:
        text = tokenizer.decode(r.prompt)
        assert "Output only the JSON" in text and r.output_tokens >= trace.MIN_OUTPUT


def test_arrivals_are_poisson_scaled_by_rate() -> None:
    slow, fast = trace.arrivals(2000, 1.0, 7), trace.arrivals(2000, 4.0, 7)
    assert slow[0] == fast[0] == 0.0
    assert all(math.isclose(a, 4 * b) for a, b in zip(slow, fast, strict=True))
    gaps = [b - a for a, b in itertools.pairwise(slow)]
    assert 0.9 < sum(gaps) / len(gaps) < 1.1  # mean gap 1/rate


def _timing(ttft: float, gap: float, tokens: int = 4) -> RequestTiming:
    chunks = tuple(ttft + i * gap for i in range(tokens))
    return RequestTiming(0.0, chunks, tokens, tokens, None)


def test_the_slo_verdict_reads_p99s_and_errors() -> None:
    good = RateResult(1.0, 10.0, tuple(_timing(0.5, 0.05) for _ in range(100)))
    assert good.meets(SLO) and good.ttft(99) == pytest.approx(0.5)
    slow_start = RateResult(1.0, 10.0, (*good.timings, _timing(3.0, 0.05)))
    assert slow_start.ttft(99) == pytest.approx(0.5)  # 1 in 101 is past the 99th percentile's rank
    assert slow_start.ttft(100) == pytest.approx(3.0)
    assert not RateResult(1.0, 10.0, (_timing(3.0, 0.05),) * 5).meets(SLO)
    assert not RateResult(1.0, 10.0, (_timing(0.5, 0.3),) * 5).meets(SLO)
    short = RequestTiming(0.0, (0.1,), 1, 4, None)  # fewer tokens than asked: an error
    assert not RateResult(1.0, 10.0, (short,)).meets(SLO)
    assert percentile([], 50) != percentile([], 50)  # NaN


def test_goodput_is_the_served_rate_while_the_slo_held_not_the_offered_one() -> None:
    """An engine offered 8/s that met the SLO only because its backlog had not reached the latencies
    yet served 3/s: its goodput is what it served, its knee what it was offered."""
    fast = tuple(_timing(0.1, 0.05) for _ in range(30))
    sustained = RateResult(4.0, 10.0, fast)  # 30 requests in 10 s: 3.0/s served
    absorbed = RateResult(8.0, 12.0, fast)  # 30 in 12 s: 2.5/s served, the SLO still met
    missed = RateResult(16.0, 20.0, tuple(_timing(5.0, 0.05) for _ in range(30)))
    results = [sustained, absorbed, missed]
    assert knee(results, SLO) == 8.0
    assert goodput(results, SLO) == pytest.approx(3.0)
    assert goodput([missed], SLO) == knee([missed], SLO) == 0.0


def test_the_sweep_doubles_until_a_miss_then_tries_the_knee(
    tokenizer: HFTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stand-in for the timed runs whose inter-token gap grows with the offered rate: it meets
    the SLO below 3 requests/s, so the sweep passes 1 and 2, misses 4, then narrows the knee:
    2.83 passes, 3.36 misses."""
    t = trace.build("chat", tokenizer, requests_needed(1.0, 16.0, 1.0), 0, None)

    def run_rate(send: Send, requests: Sequence[trace.TraceRequest], rate: float, seed: int) -> RateResult:
        gap = 0.2 * rate / 3.0
        return RateResult(rate, 1.0, tuple(_timing(0.01, gap, 2) for _ in requests))

    monkeypatch.setattr(sweep_module, "run_rate", run_rate)
    results = sweep(_never, t, 1.0, 16.0, 1.0, SLO, 0, lambda line: None)
    assert [round(r.rate, 2) for r in results] == [1.0, 2.0, 4.0, 2.83, 3.36]
    assert knee(results, SLO) == pytest.approx(2.83, abs=0.01)
    # Goodput is what was served while the SLO held: each stand-in rate took 1 s for its requests.
    best = max((r for r in results if r.meets(SLO)), key=lambda r: r.served_rate)
    assert goodput(results, SLO) == pytest.approx(best.served_rate) and best.rate < 3.0
    one_step = sweep(_never, t, 1.0, 16.0, 1.0, SLO, 0, lambda line: None, knee_steps=1)
    assert [round(r.rate, 2) for r in one_step] == [1.0, 2.0, 4.0, 2.83]
    first_misses = sweep(_never, t, 4.0, 16.0, 1.0, SLO, 0, lambda line: None)
    assert [r.rate for r in first_misses] == [4.0]  # no pass to narrow from


def _never(prompt: Sequence[int], output_tokens: int) -> RequestTiming:
    raise AssertionError("the stand-in runs send nothing")
