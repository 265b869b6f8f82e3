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

from benchmarks.inprocess.drafter_ceiling import RequestCeiling
from engine.ids import JobId
from engine.speculation.draft_policy import DraftPolicy, DraftWant, StepCost
from engine.speculation.speculation_config import DrafterKind, SpeculationConfig
from engine.speculation.speculation_step import make_drafter
from engine.speculation.speculative import DraftRequest, accept_matching


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
    drafter = make_drafter(speculation, None, 0, 0, 0)
    assert drafter is not None
    policy = DraftPolicy(start, speculation.num_draft_tokens, speculation.step_draft_tokens)
    out: list[RequestCeiling] = []
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        job = JobId(f"policy-replay-{i}")
        tokens = [*prompt, *output[:1]]
        steps, seconds, j = 0, 0.0, 1
        while j < len(output):
            # As SpeculationStep.plan and .draft: the most a job can use leaves room for the
            # step's own token; a step of one job has one row before its drafts.
            budget = policy.budgets([DraftWant(job, len(output) - j - 1)], 1)[job]
            draft: tuple[int, ...] = ()
            evidence: tuple[int, ...] = ()
            if budget > 0:
                (proposed,) = drafter.propose([DraftRequest(job, tokens, (), budget)])
                draft = proposed.tokens
                if proposed.evidence:
                    keep = policy.trim(proposed.evidence, 1)
                    draft, evidence = draft[:keep], proposed.evidence[:keep]
            kept = accept_matching(output[j : j + len(draft)], draft)
            policy.verified(job, len(draft), kept, evidence)
            rows = 1 + len(draft)
            policy.observe(rows, cost.at(rows))
            tokens.extend(output[j : j + kept + 1])
            j += kept + 1
            steps += 1
            seconds += cost.at(rows)
        policy.forget(job)
        drafter.finished("", tokens, len(prompt))
        drafter.forget(job)
        out.append(RequestCeiling(len(output), steps, seconds, cost.at(1) * max(len(output) - 1, 0)))
    return out
