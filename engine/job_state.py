"""A job's mutable state inside the generator: tokens, page table, progress, per-job helpers.

Used on the generator thread alone. Each field has one writing module: progress and pages
(`computed`, `pages`, `registered`, `stage`, `prefix_copy`, `draft_budget`, ...) the scheduler,
which the generator tells what a forward did; tokens and output state the generator
(tests/test_job_state_owners.py). Per-job sampler state and text stream live here, never on
shared settings objects, so nothing leaks from one job to another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from engine.adapters.lora_adapter import LoraAdapter
from engine.grammar.constraints import Constraint
from engine.ids import PageId
from engine.jobs import JobId, JobSpec, JobStage, TokenLogprob
from engine.output.text_stream import TextStream
from engine.output.token_healing import HealPlan
from engine.sampling.sampler import SamplerState


@dataclass(frozen=True)
class PrefixCopy:
    """K/V to copy before the job's first forward: the first `tokens` slots of `source` (a page
    another sequence computed over the same leading tokens, held by the job until copied) into
    `target`, the job's first page past its whole-page prefix hit."""

    source: PageId
    target: PageId
    tokens: int


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
class JobState:
    job_id: JobId
    spec: JobSpec
    sampler: SamplerState
    text: TextStream
    enqueued_at: float
    order: int  # admission order; the newest running job is preempted first
    stage: JobStage = JobStage.QUEUED
    tokens: list[int] = field(default_factory=list)  # prompt + accepted output
    pages: list[PageId] = field(default_factory=list)
    computed: int = 0  # tokens whose K/V are in this job's pages
    registered: int = 0  # leading pages already registered as full in the pool
    # Chain hashes of the leading full pages of `tokens` (all but the last token), computed once:
    # tokens only ever grow, so a hash never goes stale; extended as the job's tokens grow.
    page_hashes: list[int] = field(default_factory=list)
    # (page index, hash) of prompt pages this job is computing that queued jobs may wait for.
    inflight: list[tuple[int, int]] = field(default_factory=list)
    constraint: Constraint | None = None  # the response_format's grammar state
    heal: HealPlan | None = None  # token healing: the prompt tokens taken back and their text
    healing: bytes = b""  # of that text, what the output has yet to spell (b"": healed)
    held: list[HeldToken] = field(default_factory=list)  # the text stream's held tokens, oldest first
    # Output position -> tokens banned there because a banned string started with them.
    position_bans: dict[int, frozenset[int]] = field(default_factory=dict)
    rewinds: int = 0
    prefix_copy: PrefixCopy | None = None  # set at admission, done by the generator before the forward
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache (first admission)
    skips: int = 0  # times smaller jobs were admitted past this one
    started: bool = False
    preemptions: int = 0
    draft_budget: int = 0  # draft tokens to verify with the next decode step (0: no speculation)
    adapter: LoraAdapter | None = None  # set at enqueue from spec.adapter, never changed
    # Classifier-free guidance (engine/prompt/guidance.py), both set at enqueue and never changed: a guided
    # job's negative sequence (the negative prompt, then this job's output tokens), and on that
    # sequence the job it serves. The pair is scheduled, preempted and finished as one unit.
    negative: JobState | None = None
    positive: JobState | None = None
    # Prompt embedding spans (start position, float32 rows [n, hidden]), set at enqueue from
    # spec.embeddings: fed instead of the token embeddings there, at every (re)computation.
    embeds: tuple[tuple[int, torch.Tensor], ...] = ()
    accepted_drafts: int = 0
    rejected_drafts: int = 0
    scheduled_at: float | None = None
    first_token_at: float | None = None

    @cached_property
    def prompt_len(self) -> int:  # read several times per job per step; the spec is frozen
        return len(self.spec.prompt_ids)

    @cached_property
    def prefix_salt(self) -> str:
        """The prefix cache's salt for this job's pages: its cache_salt, and under an adapter that
        adapter's load too (K/V computed with an adapter are shared only with jobs of the same load;
        base-model jobs keep sharing with each other)."""
        if self.adapter is None:
            return self.spec.cache_salt
        return f"{self.spec.cache_salt}\x00lora\x00{self.adapter.uid}"

    @property
    def new_tokens(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def pending(self) -> int:
        """Tokens not yet in the cache: the rest of the prompt, or the last sampled token."""
        return len(self.tokens) - self.computed

    @property
    def decoding(self) -> bool:
        # One pending token after the prompt is done: the last sampled token.
        return self.computed >= self.prompt_len and self.pending == 1

    def pages_for(self, total_tokens: int, page_size: int) -> int:
        """Pages this job must hold to store `total_tokens` tokens."""
        return -(-total_tokens // page_size)
