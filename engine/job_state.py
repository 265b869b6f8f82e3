"""A job's mutable state inside the generator: its first row (a SequenceState: tokens, page table,
progress), a guided job's second row, and the job's own state (stage, sampler, text, events).

Used on the generator thread alone. Each field has one writing module (tests/test_job_state_owners.py):
progress the scheduler, pages and prefix-cache state the cache manager, tokens and output state
token intake. Per-job sampler state and text stream live here, never on shared settings objects,
so nothing leaks from one job to another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from engine.adapters.lora_adapter import LoraAdapter
from engine.grammar.constraints import Constraint
from engine.jobs import JobId, JobSpec, JobStage, TokenLogprob
from engine.output.text_stream import TextStream
from engine.output.token_healing import HealPlan
from engine.sampling.sampler import SamplerState
from engine.sequence import SequenceState, prefix_salt


@dataclass(frozen=True)
class HeldToken:
    """An output token whose text may still become a banned string: not streamed yet. `logits` is
    the row it was sampled from, kept so a rewind can sample that position again without a forward."""

    token: int
    logprob: TokenLogprob | None
    logits: torch.Tensor | None


# eq=False: a job is itself, compared by identity. The generated __eq__ compared every field,
# and the scheduler's list membership tests made that O(jobs^2) field comparisons per step.
@dataclass(eq=False)
class JobState(SequenceState):
    """A job, which is also its first row (its own tokens and pages: SequenceState's fields)."""

    job_id: JobId
    spec: JobSpec
    sampler: SamplerState
    text: TextStream
    enqueued_at: float
    order: int  # admission order; the newest running job is preempted first
    stage: JobStage = JobStage.QUEUED
    constraint: Constraint | None = None  # the response_format's grammar state
    heal: HealPlan | None = None  # token healing: the prompt tokens taken back and their text
    healing: bytes = b""  # of that text, what the output has yet to spell (b"": healed)
    held: list[HeldToken] = field(default_factory=list)  # the text stream's held tokens, oldest first
    # Output position -> tokens banned there because a banned string started with them.
    position_bans: dict[int, frozenset[int]] = field(default_factory=dict)
    rewinds: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache (first admission)
    skips: int = 0  # times smaller jobs were admitted past this one
    started: bool = False
    preemptions: int = 0
    draft_budget: int = 0  # draft tokens to verify with the next decode step (0: no speculation)
    adapter: LoraAdapter | None = None  # set at enqueue from spec.adapter, never changed
    # Classifier-free guidance (engine/guided_pair.py): a guided job's second row, the negative
    # prompt followed by this job's output tokens; set at enqueue, never changed. It is a row, not a
    # job: scheduled, preempted and finished with this job, whose stage and events are its own.
    negative: SequenceState | None = None
    accepted_drafts: int = 0
    rejected_drafts: int = 0
    scheduled_at: float | None = None
    first_token_at: float | None = None

    def __post_init__(self) -> None:
        # The spec and adapter are fixed: the row's prompt length and prefix salt follow from them.
        self.prompt_len = len(self.spec.prompt_ids)
        self.prefix_salt = prefix_salt(
            self.spec.cache_salt, None if self.adapter is None else self.adapter.uid
        )

    @cached_property  # read several times per job per step; `negative` never changes
    def rows(self) -> tuple[SequenceState, ...]:
        """The job's rows of the batch: itself, and its negative sequence when guided."""
        return (self,) if self.negative is None else (self, self.negative)
