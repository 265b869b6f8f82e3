"""The served draft policy replayed at batch 1 over a trace's outputs: where a run's ratio goes
between the drafter's bound (drafter_ceiling.py) and what was measured.

The trace's outputs (greedy, so the same with and without drafts) are replayed request after
request through the served n-gram drafter, its corpus, and `DraftPolicy` as `SpeculationStep`
drives it for one job: each step asks the policy for the job's budget (its rows: one), has the
drafter propose that many tokens, trims them by their evidence, keeps the prefix the output
matches, and tells the policy what was kept. Each step is priced by a step-cost table (the run's
learned one, as the bound prices its steps) and the policy, starting from `start` (its table at
warm-up), observes that price, as it observes a served step's time. So the replay's ratio is what
the policy's own choices are worth with no host noise and no drift, and the bound's ratio over
it is what better choices could still win. Being deterministic, it tells policy changes apart in
seconds where a run's ±5% drift hides them.
"""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks.inprocess.drafter_ceiling import RequestCeiling, replay_requests
from engine.ids import JobId
from engine.speculation.draft_policy import DraftPolicy, DraftWant, StepCost
from engine.speculation.speculation_config import DrafterKind, SpeculationConfig
from engine.speculation.speculative import Drafter, DraftRequest, accept_matching


class _Served:
    """The steps `SpeculationStep` makes for one job decoding alone, priced by `cost`."""

    def __init__(self, policy: DraftPolicy, cost: StepCost) -> None:
        self.policy = policy
        self.cost = cost

    def step(
        self, drafter: Drafter, job: JobId, tokens: Sequence[int], ahead: Sequence[int]
    ) -> tuple[int, int]:
        # As SpeculationStep.plan and .draft: the most a job can use leaves room for the step's own
        # token; a step of one job has one row before its drafts, and reads every token so far.
        policy = self.policy
        budget = policy.budgets([DraftWant(job, len(ahead) - 1)], 1, len(tokens))[job]
        draft: tuple[int, ...] = ()
        evidence: tuple[int, ...] = ()
        if budget > 0:
            (proposed,) = drafter.propose([DraftRequest(job, tokens, (), budget)])
            draft = proposed.tokens
            if proposed.evidence:
                keep = policy.trim(proposed.evidence, 1, len(tokens))
                draft, evidence = draft[:keep], proposed.evidence[:keep]
        kept = accept_matching(ahead[: len(draft)], draft)
        policy.verified(job, len(draft), kept, evidence)
        rows = 1 + len(draft)
        policy.observe(rows, self.cost.at(rows, len(tokens)), len(tokens))
        return rows, kept

    def finished(self, job: JobId) -> None:
        self.policy.forget(job)


def replay_policy(
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    cost: StepCost,
    start: StepCost,
    speculation: SpeculationConfig,
) -> list[RequestCeiling]:
    """Each request under the policy and drafter `speculation` configures (an adaptive n-gram one),
    in order, its steps priced by `cost`; the policy's table starts as `start`."""
    if speculation.kind is not DrafterKind.NGRAM or not speculation.adaptive:
        raise ValueError("the policy replay runs the adaptive n-gram drafter")
    policy = DraftPolicy(start, speculation.num_draft_tokens, speculation.step_draft_tokens)
    return replay_requests(prompts, outputs, cost, speculation, _Served(policy, cost))
