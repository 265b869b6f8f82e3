"""The policy replay (benchmarks/inprocess/policy_replay.py) makes the served policy's choices: the
same drafts verified and kept, step by step, as a generator running the same requests one at a time
with the same frozen cost table; and on text it cannot predict it stays near one row a step."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from benchmarks.inprocess.drafter_ceiling import replay
from benchmarks.inprocess.policy_replay import replay_policy
from engine.generator import DynamicGenerator, GeneratorConfig
from engine.ids import JobId
from engine.jobs import JobSpec
from engine.model.loader import LoadedModel
from engine.speculation.draft_policy import DraftPolicy, StepCost
from engine.speculation.speculation_config import DrafterKind, SpeculationConfig

# A 2-core CPU's shape: the second row costs a fifth of a step, a 16-row tile's worth each row past it.
COST = StepCost((1, 2, 4, 8, 16, 32), (0.004, 0.0049, 0.0061, 0.0077, 0.0121, 0.0242))
NGRAM = SpeculationConfig(DrafterKind.NGRAM)


@pytest.fixture
def verifications(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int]]]:
    """Every (drafted, kept) the policy is told of, with its cost table frozen (observe does nothing)."""
    log: list[tuple[int, int]] = []
    verified = DraftPolicy.verified

    def logged(
        self: DraftPolicy, job_id: JobId, drafted: int, kept: int, evidence: Sequence[int] = ()
    ) -> None:
        if drafted > 0:
            log.append((drafted, kept))
        verified(self, job_id, drafted, kept, evidence)

    monkeypatch.setattr(DraftPolicy, "verified", logged)
    monkeypatch.setattr(DraftPolicy, "observe", lambda self, rows, seconds, keys=0: None)
    yield log


def test_the_replay_verifies_what_the_generator_verifies(
    tiny: LoadedModel, verifications: list[tuple[int, int]]
) -> None:
    loop = [5, 6, 7, 8, 9, 10, 11, 12]
    specs = [JobSpec(tuple(loop * 4 + [20 + i]), max_new_tokens=48, ignore_eos=True) for i in range(3)] + [
        JobSpec(tuple(range(30, 90)), max_new_tokens=40, ignore_eos=True)
    ]
    gen = DynamicGenerator(
        tiny.model, tiny.tokenizer, GeneratorConfig(page_size=16, num_pages=256, speculation=NGRAM)
    )
    gen.speculation.measured(COST)
    outputs = []
    for spec in specs:  # one at a time: batch 1, as the replay
        (result,) = gen.generate([spec])
        outputs.append(result.token_ids)
    gen.close()
    served = list(verifications)
    verifications.clear()
    replayed = replay_policy([s.prompt_ids for s in specs], outputs, COST, COST, NGRAM)
    assert served, "the generator verified no draft: the test shows nothing"
    assert verifications == served
    assert sum(r.tokens for r in replayed) == sum(len(o) for o in outputs)
    # Each step makes its own token and the drafts it kept.
    assert sum(r.steps for r in replayed) == sum(r.tokens - 1 for r in replayed) - sum(k for _, k in served)


def test_a_copied_span_is_fast_and_text_nothing_predicts_stays_near_one_row_a_step() -> None:
    record = [7, 8, 9, *range(200, 300)]
    prompts = [[1, 2, 3, *record, 4, 5], list(range(400, 440))]
    outputs = [record[:90], list(range(1000, 1090))]
    copied, fresh = replay_policy(prompts, outputs, COST, COST, NGRAM)
    bound = replay(prompts, outputs, COST, NGRAM)
    assert copied.speedup > 2.5
    assert copied.speedup <= bound[0].speedup + 1e-9  # this copy has no longer proposal to wait for
    assert fresh.steps == len(outputs[1]) - 1
    assert fresh.speedup == pytest.approx(1.0)  # nothing proposed, nothing verified


def test_only_the_adaptive_ngram_drafter_is_replayed() -> None:
    for config in (SpeculationConfig(DrafterKind.NONE), SpeculationConfig(DrafterKind.NGRAM, adaptive=False)):
        with pytest.raises(ValueError, match="adaptive n-gram"):
            replay_policy([[1]], [[2, 3]], COST, COST, config)
