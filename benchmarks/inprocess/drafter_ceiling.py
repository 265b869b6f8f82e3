"""What a batch-1 run of a trace could gain from the n-gram drafter at best: the bound that the
drafter's proposals put on adaptive speculation, whatever its policy.

The trace's outputs (greedy, so the same with and without drafts) are replayed through the served
n-gram drafter and its corpus of finished outputs, request after request as served. At each step
an oracle policy verifies exactly the draft tokens that will be kept, up to the per-job most: no
row is wasted on a rejected token and no kept one is left out. Each step is priced by a step-cost
table (rows -> seconds; the adaptive run's, learned from its own steps at the trace's contexts:
whole steps, forward and host work, as the policy times them), and the run without drafts by the
same table at one row a step, so the ratio compares like with like; each request's prefill is
added to both.

A rule that verifies a prefix of each proposal keeps at most what the oracle keeps from it, and
with step costs subadditive (one step of a + b rows costs no more than steps of a and of b rows:
each step reads the weights once) pays no less for it. The oracle's ratio is so the drafter's
bound on the trace, but for one way round it: stopping a run of kept drafts early, in case the
drafter's next proposal from there runs longer than the rest of this one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.ids import JobId
from engine.speculation.draft_policy import StepCost
from engine.speculation.speculation_config import DrafterKind, SpeculationConfig
from engine.speculation.speculation_step import make_drafter
from engine.speculation.speculative import Drafter, DraftRequest, accept_matching


@dataclass(frozen=True)
class RequestCeiling:
    """One request replayed: its output tokens and the oracle's decode steps and their time."""

    tokens: int
    steps: int
    seconds: float  # the oracle's decode steps, by the cost table
    plain_seconds: float  # one row a step for every token after the first, by the same table

    @property
    def speedup(self) -> float:
        return self.plain_seconds / self.seconds if self.seconds > 0 else 1.0


class StepRule(Protocol):
    """How one replayed step of a job chooses what it verifies."""

    def step(
        self, drafter: Drafter, job: JobId, tokens: Sequence[int], ahead: Sequence[int]
    ) -> tuple[int, int]:
        """The step's rows and the draft tokens it keeps, for a job whose accepted `tokens` the
        output continues with `ahead` (the step's own token first)."""
        ...

    def finished(self, job: JobId) -> None: ...


def replay_requests(
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    cost: StepCost,
    speculation: SpeculationConfig,
    rule: StepRule,
) -> list[RequestCeiling]:
    """Each request's decode steps under `rule`, in order, through the n-gram drafter `speculation`
    configures and its corpus of the earlier requests' outputs, priced by `cost`. A request's first
    output token comes from its prefill; each later step takes its own token and the drafts it kept."""
    if speculation.kind is not DrafterKind.NGRAM:
        raise ValueError(f"the replay runs the n-gram drafter, not {speculation.kind.value}")
    drafter = make_drafter(speculation, None, 0, 0, 0)
    assert drafter is not None
    out: list[RequestCeiling] = []
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        job = JobId(f"replay-{i}")
        tokens = [*prompt, *output[:1]]
        steps, seconds, j = 0, 0.0, 1
        while j < len(output):
            rows, kept = rule.step(drafter, job, tokens, output[j:])
            seconds += cost.at(rows, len(tokens))  # the step's row reads every token so far
            tokens.extend(output[j : j + kept + 1])
            j += kept + 1
            steps += 1
        rule.finished(job)
        drafter.finished("", tokens, len(prompt))
        drafter.forget(job)
        plain = sum(cost.at(1, len(prompt) + n) for n in range(1, len(output)))  # one token a step
        out.append(RequestCeiling(len(output), steps, seconds, plain))
    return out


@dataclass(frozen=True)
class _Oracle:
    """Verifies exactly the draft tokens that will be kept, up to the per-job most."""

    most: int

    def step(
        self, drafter: Drafter, job: JobId, tokens: Sequence[int], ahead: Sequence[int]
    ) -> tuple[int, int]:
        most = min(self.most, len(ahead) - 1)
        proposal: tuple[int, ...] = ()
        if most > 0:
            (draft,) = drafter.propose([DraftRequest(job, tokens, (), most)])
            proposal = draft.tokens
        kept = accept_matching(ahead[: len(proposal)], proposal)
        return 1 + kept, kept

    def finished(self, job: JobId) -> None:
        pass


def replay(
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    cost: StepCost,
    speculation: SpeculationConfig,
) -> list[RequestCeiling]:
    """Each request's best case under the drafter `speculation` configures (an n-gram one), in order:
    every decode step verifies the drafts the oracle keeps plus the step's own token."""
    return replay_requests(prompts, outputs, cost, speculation, _Oracle(speculation.num_draft_tokens))
