"""The adaptive draft lengths (engine/speculation/draft_policy.py): acceptance per job, and draft
tokens handed out while they raise the step's expected tokens per second."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.forward_batch import SequenceInput
from engine.generator import DynamicGenerator, GeneratorConfig
from engine.jobs import JobId
from engine.model.loader import LoadedModel
from engine.runner import ForwardResult
from engine.scheduler import SchedulerConfig
from engine.speculation.draft_policy import OBSERVE_RATE, OUTLIER, DraftPolicy, DraftWant, StepCost
from engine.speculation.speculation_config import DrafterKind, SpeculationConfig

# A 2-core CPU's shape: a row costs ~the weights' read up to a few rows, then ~1 ms each.
CPU = StepCost((1, 2, 4, 8, 16, 32, 64), (0.0026, 0.0027, 0.0030, 0.0050, 0.0100, 0.0200, 0.0670))
A, B = JobId("a"), JobId("b")


def trained(p_kept: int, p_drafted: int, rounds: int = 20, cost: StepCost = CPU) -> DraftPolicy:
    policy = DraftPolicy(cost, 16, 16)
    for _ in range(rounds):
        policy.verified(A, p_drafted, p_kept)
    return policy


def test_a_job_whose_drafts_are_kept_drafts_long_at_batch_1() -> None:
    policy = trained(8, 8)
    assert policy.acceptance(A) > 0.9
    # 8 rows cost 5 ms against 2.6 for one: 7 drafts, and an 8th would not raise tokens per second.
    assert policy.budgets([DraftWant(A, 100)], rows=1)[A] == 7


def test_a_job_whose_drafts_are_rejected_stops_drafting() -> None:
    policy = trained(0, 4)
    assert policy.acceptance(A) < 0.1
    assert policy.budgets([DraftWant(A, 100)], rows=1)[A] == 0


def test_at_batch_64_nothing_pays() -> None:
    policy = trained(8, 8)
    wants = [DraftWant(JobId(f"j{i}"), 100) for i in range(63)] + [DraftWant(A, 100)]
    assert sum(policy.budgets(wants, rows=64).values()) == 0


def test_the_likelier_job_gets_the_drafts_first() -> None:
    policy = trained(8, 8)
    for _ in range(20):
        policy.verified(B, 4, 1)
    budgets = policy.budgets([DraftWant(A, 100), DraftWant(B, 100)], rows=2)
    assert budgets[A] > budgets[B]


def test_a_job_gets_no_more_than_it_can_use() -> None:
    policy = trained(8, 8)
    assert policy.budgets([DraftWant(A, 3)], rows=1)[A] == 3


def certain_drafters(per_job: int, per_step: int, count: int) -> tuple[DraftPolicy, list[JobId]]:
    """`count` jobs whose drafts are always kept, where rows cost next to nothing: every certain
    draft would pay up to the per-job most, so only the limits bind."""
    policy = DraftPolicy(StepCost((1, 64, 128), (0.0026, 0.0027, 0.0028)), per_job, per_step)
    jobs = [JobId(f"j{i}") for i in range(count)]
    for job in jobs:
        for _ in range(20):
            policy.verified(job, per_job, per_job)
    return policy, jobs


def test_a_step_verifies_no_more_drafts_than_its_bound_however_many_jobs_draft() -> None:
    policy, jobs = certain_drafters(8, 12, 4)
    alone = policy.budgets([DraftWant(jobs[0], 100)], rows=1)
    assert alone[jobs[0]] == 8  # the per-job most binds first at batch 1
    for _ in range(100):  # probes included: they stay within the step's bound too
        budgets = policy.budgets([DraftWant(j, 100) for j in jobs], rows=4)
        assert sum(budgets.values()) == 12 and max(budgets.values()) <= 8


def test_a_job_decoding_alone_may_draft_past_the_step_bound() -> None:
    """The step's bound protects other streams; a job alone in its step delays only itself."""
    policy, jobs = certain_drafters(24, 12, 2)
    assert policy.budgets([DraftWant(jobs[0], 100)], rows=1)[jobs[0]] == 24
    # Two rows decoding (two jobs, or one guided pair): the step's bound again.
    assert policy.budgets([DraftWant(jobs[0], 100)], rows=2)[jobs[0]] == 12
    for _ in range(100):
        assert sum(policy.budgets([DraftWant(j, 100) for j in jobs], rows=2).values()) == 12


def test_a_draft_is_verified_only_as_far_as_its_evidence_pays() -> None:
    """Tokens of an evidence class that is always kept are all verified; the draft stops at the
    first token of a class that is rarely kept (a branch), and a class a trim passes over drifts
    back toward the prior, so it is tried again."""
    policy = DraftPolicy(CPU, 16, 16)
    sure, branch = 1, 2
    for _ in range(50):
        policy.verified(A, 6, 5, (sure,) * 5 + (branch,))
    assert policy.trim((sure,) * 6, rows=1) == 6
    assert policy.trim((sure,) * 3 + (branch,) + (sure,) * 2, rows=1) == 3
    assert policy.trim((branch, sure), rows=1) == 0
    for _ in range(200):
        policy.trim((branch,), rows=1)
    assert policy.trim((branch,), rows=1) == 1  # back near the prior (0.5): worth a row again
    # A class never seen starts from the prior; at batch 64 even a sure token does not pay.
    assert policy.trim((3, 3), rows=1) > 0
    assert policy.trim((sure,) * 6, rows=64) == 0


def test_a_paused_job_is_probed_again() -> None:
    policy = trained(0, 4)
    for _ in range(40):
        policy.verified(B, 8, 8)  # others' drafts are kept: the prior rises
    assert policy.budgets([DraftWant(A, 100)], rows=1)[A] == 0  # not at once: it drifts back
    steps = 1
    while policy.budgets([DraftWant(A, 100)], rows=1)[A] == 0:
        steps += 1
        assert steps < 500
    assert policy.acceptance(A) < 0.2  # probed with one cheap draft, not trusted yet


def test_acceptance_rises_fast_and_falls_slowly() -> None:
    policy = trained(0, 4, rounds=3)
    low = policy.acceptance(A)
    policy.verified(A, 8, 8)
    risen = policy.acceptance(A)
    policy.verified(A, 8, 0)
    assert risen - low > 0.3 and risen - policy.acceptance(A) < 0.2


@given(
    st.lists(st.integers(1, 64), min_size=2, max_size=8, unique=True).map(sorted),
    st.lists(st.floats(1e-4, 1.0), min_size=8, max_size=8),
    st.integers(1, 200),
)
def test_step_cost_is_positive_and_matches_its_points(rows: list[int], times: list[float], at: int) -> None:
    seconds = sorted(times[: len(rows)])
    cost = StepCost(tuple(rows), tuple(seconds))
    assert cost.at(at) > 0
    for r, s in zip(rows, seconds, strict=True):
        assert cost.at(r) == pytest.approx(s)


def test_step_cost_is_checked() -> None:
    with pytest.raises(ValueError):
        StepCost((4, 2), (0.1, 0.2))


def test_a_step_held_up_moves_the_table_no_more_than_an_outlier_would() -> None:
    """A step a garbage collection or the OS held up (20x its prediction) counts as OUTLIER of its
    prediction off, not its whole error: one such step used to raise two table points by 2.5 ms."""
    cost = StepCost((1, 2, 4, 8), (0.004, 0.004, 0.006, 0.010))
    held = cost.observed(4, 0.120)
    assert held.seconds[2] == pytest.approx(0.006 + OBSERVE_RATE * OUTLIER * 0.006)
    fast = cost.observed(4, 0.0)  # and no faster than OUTLIER under it
    assert fast.seconds[2] == pytest.approx(0.006 - OBSERVE_RATE * OUTLIER * 0.006)
    normal = cost.observed(4, 0.007)  # an error within the bound counts whole
    assert normal.seconds[2] == pytest.approx(0.006 + OBSERVE_RATE * 0.001)


def test_a_step_moves_the_two_row_counts_around_it() -> None:
    cost = StepCost((1, 2, 4, 8), (0.004, 0.004, 0.006, 0.010))
    slower = cost.observed(3, 0.007, rate=0.5)  # predicted 5 ms: 2 ms over, half of it shared
    assert slower.seconds[0] == cost.seconds[0]
    assert slower.seconds[1] == pytest.approx(0.004 + 0.5 * 0.5 * 0.002)
    assert slower.seconds[2] == pytest.approx(0.006 + 0.5 * 0.5 * 0.002)
    assert slower.seconds[3] == cost.seconds[3]
    # Past the end, the end point takes the error; times stay non-decreasing.
    assert cost.observed(9, 0.012, rate=1.0).seconds[3] == pytest.approx(0.010 + 0.012 - cost.at(9))
    faster = cost.observed(1, 0.0025, rate=1.0)
    assert faster.seconds[0] == pytest.approx(0.0025) and list(faster.seconds) == sorted(faster.seconds)


def test_keys_cost_their_rate_and_drafts_add_rows_not_keys() -> None:
    cost = StepCost((1, 8, 16, 24, 32), (0.004, 0.0055, 0.0085, 0.0115, 0.0145), per_key=1e-6)
    assert cost.at(24, 12_000) == pytest.approx(0.0115 + 0.012)
    assert cost.at(24) == pytest.approx(0.0115)  # no keys: the table alone
    with pytest.raises(ValueError):
        StepCost((1, 2), (0.004, 0.005), per_key=-1e-9)


def test_drafts_pay_among_long_contexts_where_a_row_carries_no_keys() -> None:
    """24 sequences of 500 keys: a draft row costs the table's slope (0.375 ms), not a sequence's
    share of the step (~1 ms). Priced as rows alone, with the keys' time folded into the rows (as
    a table that learnt from steps whose contexts grew), not even a certain draft pays."""
    rows_and_keys = StepCost((1, 8, 16, 24, 32), (0.004, 0.0055, 0.0085, 0.0115, 0.0145), per_key=1e-6)
    folded = StepCost((1, 8, 16, 24, 32), (0.0045, 0.0095, 0.0165, 0.0235, 0.0395))
    wants = [DraftWant(JobId(f"j{i}"), 100) for i in range(24)]
    for cost in (rows_and_keys, folded):
        policy = DraftPolicy(cost, 16, 16)
        for w in wants:
            for _ in range(20):
                policy.verified(w.job_id, 4, 4)
        drafts = sum(policy.budgets(wants, rows=24, keys=24 * 500).values())
        assert drafts == (16 if cost is rows_and_keys else 0)


def _taught(start: float, steps: int = 3000) -> tuple[StepCost, StepCost]:
    """Steps whose time is a table of rows plus 1 us a key, at 8-24 sequences of 100-1000 keys,
    observed by a cost whose table was timed 30% fast and whose keys' rate starts at `start` us."""
    f = StepCost((1, 8, 16, 24, 32), (0.004, 0.0055, 0.0085, 0.0115, 0.0145))
    cost = StepCost(f.rows, tuple(s * 0.7 for s in f.seconds), start * 1e-6)
    rng = random.Random(0)
    for _ in range(steps):
        rows = rng.choice([8, 16, 24])
        keys = rows * rng.randint(100, 1000)
        cost = cost.observed(rows, (f.at(rows) + 1e-6 * keys) * rng.uniform(0.95, 1.05), keys=keys)
    return cost, f


def test_steps_teach_a_low_keys_rate_its_own_and_leave_the_rows_table_its_own() -> None:
    cost, f = _taught(1 / 3)
    assert cost.per_key == pytest.approx(1e-6, rel=0.25)
    for rows in (8, 16, 24):
        assert cost.at(rows) == pytest.approx(f.at(rows), rel=0.25)


def test_a_high_keys_rate_comes_down_toward_the_steps() -> None:
    """Started high, the rate comes down, though not all the way: the keys grow with the rows, and
    the split by shares settles with part of the keys' time in a table that stays low."""
    cost, _ = _taught(2.0)
    assert 1e-6 < cost.per_key < 1.6e-6


def test_observed_steps_correct_a_table_measured_on_a_busy_machine() -> None:
    """Warm-up timed while another process held a core: 2 rows read as 3x one row, so no draft
    pays and none is verified. Probes and every step's time bring drafting back."""
    true = StepCost((1, 2, 4, 8, 16), (0.004, 0.0042, 0.0048, 0.0066, 0.011))
    busy = StepCost((1, 2, 4, 8, 16), (0.004, 0.012, 0.020, 0.030, 0.050))
    policy = DraftPolicy(busy, 8, 8)
    for _ in range(20):
        policy.verified(A, 8, 8)  # the job's drafts are always kept
    assert policy.budgets([DraftWant(A, 10_000)], rows=1)[A] == 0
    drafted = []
    for _ in range(3000):
        d = policy.budgets([DraftWant(A, 10_000)], rows=1)[A]
        drafted.append(d)
        if d:
            policy.verified(A, d, d)
        policy.observe(1 + d, true.at(1 + d))
    assert sum(drafted[-100:]) >= 100 * 3  # drafting again, on the table the steps taught
    rows = 1 + drafted[-1]
    assert policy.cost.at(rows) == pytest.approx(true.at(rows), abs=0.001)  # where it runs now


def _disturbed_warmup(tiny: LoadedModel, rows: int, calls: int) -> StepCost:
    """The warm-up's step cost table with the model's forward 40 ms slower at `rows` rows for its
    first `calls` such calls (another process holding the cores while that size is timed)."""
    config = GeneratorConfig(
        page_size=4,
        num_pages=128,
        scheduler=SchedulerConfig(max_batch_size=16),
        speculation=SpeculationConfig(DrafterKind.NGRAM),
    )
    gen = DynamicGenerator(tiny.model, tiny.tokenizer, config)
    run = gen.runner.run
    left = [calls]

    def slow(seqs: Sequence[SequenceInput]) -> ForwardResult:
        if sum(len(s.token_ids) for s in seqs) == rows and left[0] > 0:
            left[0] -= 1
            time.sleep(0.04)
        return run(seqs)

    gen.runner.run = slow  # type: ignore[method-assign]
    gen.warmup()
    assert gen.speculation.policy is not None
    gen.close()
    return gen.speculation.policy.cost


def test_a_warmup_size_timed_while_the_machine_was_busy_is_timed_again(tiny: LoadedModel) -> None:
    # The 4-row size's prompt step and its four timed steps are all slow; its next timing is not.
    cost = _disturbed_warmup(tiny, rows=4, calls=5)
    four, two = cost.at(4), cost.at(2)
    assert four < 0.04 and four <= 2 * two


def test_a_size_slow_at_every_timing_is_held_to_the_rows_bound(tiny: LoadedModel) -> None:
    cost = _disturbed_warmup(tiny, rows=8, calls=10_000)
    assert cost.at(8) == pytest.approx(2 * cost.at(4))  # no dearer per row than 4 rows
    assert cost.at(16) >= cost.at(8)
