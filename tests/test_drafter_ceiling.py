"""The n-gram drafter's bound (benchmarks/inprocess/drafter_ceiling.py): its replay accounts for every
output token once, keeps only what the served drafter proposes, and prices steps by the table."""

from __future__ import annotations

import pytest

from benchmarks.inprocess.drafter_ceiling import replay
from engine.speculation.draft_policy import StepCost
from engine.speculation.speculation_config import DrafterKind, SpeculationConfig

COST = StepCost((1, 2, 8, 32), (0.003, 0.0035, 0.006, 0.015))
NGRAM = SpeculationConfig(DrafterKind.NGRAM)


def test_text_nothing_predicts_takes_one_step_a_token() -> None:
    prompt, output = list(range(100, 140)), list(range(1000, 1050))  # no token seen before
    (r,) = replay([prompt], [output], COST, NGRAM)
    assert (r.tokens, r.steps) == (50, 49)
    assert r.seconds == pytest.approx(r.plain_seconds) == pytest.approx(49 * 0.003)
    assert r.speedup == pytest.approx(1.0)


def test_a_copied_span_is_verified_in_few_long_steps() -> None:
    record = [7, 8, 9, *range(200, 300)]
    prompt = [1, 2, 3, *record, 4, 5]
    output = record[:60]  # the model copies the record
    (r,) = replay([prompt], [output], COST, NGRAM)
    assert r.steps <= 4  # 59 decode tokens, up to 32 drafts a step
    assert r.speedup > 3
    capped = replay([prompt], [output], COST, SpeculationConfig(DrafterKind.NGRAM, num_draft_tokens=4))[0]
    assert capped.steps >= 59 // 5  # a step takes at most its 4 drafts and its own token
    assert capped.seconds > r.seconds


def test_an_earlier_requests_output_is_copied_through_the_corpus() -> None:
    answer = list(range(500, 580))
    first, second = replay([[1, 2, 3, 4], [9, 8, 7, 6]], [answer, answer], COST, NGRAM)
    assert first.steps == len(answer) - 1  # nothing to copy yet
    assert second.steps < 10
    without = replay(
        [[1, 2, 3, 4], [9, 8, 7, 6]],
        [answer, answer],
        COST,
        SpeculationConfig(DrafterKind.NGRAM, corpus_tokens=0),
    )
    assert without[1].steps == len(answer) - 1


def test_only_the_ngram_drafter_is_replayed() -> None:
    with pytest.raises(ValueError, match="n-gram"):
        replay([[1]], [[2, 3]], COST, SpeculationConfig(DrafterKind.NONE))
