"""Speculative decoding inside the generator's iteration, around a drafter (speculative.py).

Before scheduling, `plan` gives each decoding job its draft budget (through the scheduler,
which owns it: the step must hold pages for the drafts too); after scheduling, `draft` asks
the drafter for the scheduled jobs' drafts and widens their chunks to carry them; after the
forward, `verify` keeps the acceptable prefix of a draft plus one token of the target's own,
takes those tokens (token_intake.py) and tells the scheduler how far the cache is valid.
"""

from __future__ import annotations

import logging

import torch

from engine.errors import InvalidRequestError
from engine.grammar.constraints import mask_words
from engine.job_state import JobState
from engine.jobs import JobEvent, JobId
from engine.model.llama import LlamaModel
from engine.output.token_intake import CARRY_ON, Outcome, TokenIntake
from engine.sampling.sampler import Sampler
from engine.scheduled_chunk import ScheduledChunk
from engine.scheduler import Scheduler
from engine.speculation.draft_policy import DraftPolicy, DraftWant, StepCost
from engine.speculation.speculation_config import SpeculationConfig
from engine.speculation.speculative import (
    MATCH_LOOKBACK,
    NGRAM_CANDIDATES,
    Draft,
    Drafter,
    DrafterKind,
    DraftModelDrafter,
    DraftRequest,
    NgramDrafter,
    accept_matching,
)
from engine.speculation.suffix_corpus import SuffixCorpus
from engine.step_failure import StepFailure

logger = logging.getLogger(__name__)


def make_drafter(
    config: SpeculationConfig, draft_model: LlamaModel | None, vocab_size: int, num_pages: int, page_size: int
) -> Drafter | None:
    """The drafter `config` asks for (a draft model's with its own page tables), or None."""
    match config.kind:
        case DrafterKind.NONE:
            return None
        case DrafterKind.NGRAM:
            corpus = (
                SuffixCorpus(config.max_ngram, config.corpus_tokens, NGRAM_CANDIDATES, MATCH_LOOKBACK)
                if config.corpus_tokens
                else None
            )
            return NgramDrafter(config.max_ngram, corpus)
        case DrafterKind.DRAFT_MODEL:
            if draft_model is None:
                raise InvalidRequestError("speculation kind draft_model needs a draft model")
            return DraftModelDrafter(draft_model, vocab_size, num_pages, page_size)


class SpeculationStep:
    def __init__(
        self,
        config: SpeculationConfig,
        drafter: Drafter | None,
        scheduler: Scheduler,
        intake: TokenIntake,
        sampler: Sampler,
        vocab_size: int,
    ) -> None:
        self._config = config
        self.drafter = drafter
        self._scheduler = scheduler
        self._intake = intake
        self._sampler = sampler
        self._vocab_size = vocab_size
        self.accepted = 0  # draft tokens accepted, over all jobs
        self.rejected = 0
        # Adaptive draft lengths once the step's cost is measured (`measured`, at warm-up); before
        # that, every speculating job may verify num_draft_tokens while the batch is small.
        self.policy: DraftPolicy | None = None
        self.paused = False  # no drafts at all (while warm-up times plain steps)
        self.keeps_outputs = True  # finished outputs go to the drafter (not the warm-up's)
        self._evidence: dict[JobId, tuple[int, ...]] = {}  # this step's drafts' evidence classes

    def wants_cost(self) -> bool:
        return self.drafter is not None and self._config.adaptive

    def measured(self, cost: StepCost) -> None:
        self.policy = DraftPolicy(cost, self._config.num_draft_tokens, self._config.step_draft_tokens)

    def learns_cost(self) -> bool:
        return self.policy is not None and not self.paused

    def observe(self, rows: int, seconds: float, keys: int) -> None:
        """A step of decode rows only (drafts included), whose sequences read `keys` cached keys,
        took `seconds`: the cost learns it."""
        if self.policy is not None:
            self.policy.observe(rows, seconds, keys)

    def _speculates(self, job: JobState) -> bool:
        s = job.spec.sampling
        # Penalties depend on every earlier token, drafts included, and logprobs are reported
        # per sampled token: such jobs decode one token at a time.
        return (
            job.decoding
            and not job.spec.return_logprobs
            and s.repetition_penalty == 1.0
            and s.frequency_penalty == 0.0
            and s.presence_penalty == 0.0
            and not job.spec.banned_strings  # a rewind needs each held token's own logits row
            and not job.healing  # its next token is held to the prompt's taken-back text
            # A guided job's draft would need its negative sequence to verify alongside: it does not speculate.
            and job.negative is None
            # Pseudo ids stand under prompt embeddings: no drafter may read or propose them.
            and not job.embeds
            # A draft model runs without the job's adapter, so its drafts would mostly be rejected:
            # such jobs do not speculate (n-gram drafts come from the job's own tokens and do).
            and not (job.adapter is not None and isinstance(self.drafter, DraftModelDrafter))
        )

    def plan(self) -> None:
        """Decide how many draft tokens each decoding job may verify in the next step."""
        if self.drafter is None:
            return  # budgets stay 0: no per-job work in the loop when speculation is off
        running = self._scheduler.running
        # Prompts first (adaptive): draft rows would lengthen the steps that carry a waiting job's
        # prefill, and near saturation (a queue that never empties) that cost the chat trace's
        # first tokens their SLO (p99 TTFT 2.11 s against 0.17 s without drafts). The scan of the
        # running jobs runs only when the cheaper tests let drafts through.
        active = (
            len(running) <= self._config.max_batch_size
            and not self.paused
            and not (self.policy is not None and self._scheduler.prompts_pending())
        )
        # The most each speculating job can use: the verify step adds one token of its own.
        wants = [
            DraftWant(j.job_id, j.spec.max_new_tokens - j.new_tokens - 1)
            for j in running
            if active and self._speculates(j)
        ]
        budgets: dict[JobId, int] = {}  # nobody wants drafts: no pass over the running jobs' rows
        if self.policy is None:
            budgets = {w.job_id: min(self._config.num_draft_tokens, w.most) for w in wants}
        elif wants:
            # Each sequence's next row reads its cached keys and the new one; drafts add no keys.
            keys = sum(seq.computed + 1 for j in running for seq in j.rows)
            budgets = self.policy.budgets(wants, sum(len(j.rows) for j in running), keys)
        for job in running:
            self._scheduler.set_draft_budget(job, budgets.get(job.job_id, 0))

    def draft(self, chunks: list[ScheduledChunk]) -> tuple[list[ScheduledChunk], list[StepFailure]]:
        """Ask the drafter for the speculating jobs' drafts (their pages exist now) and trim chunks to
        them; the jobs whose drafting failed are left out and reported."""
        # Only a decode step verifies drafts; a prefill chunk (e.g. of a re-admitted job) never does.
        wanting = [c for c in chunks if c.job.draft_budget > 0 and c.num_tokens > 1 and c.job.decoding]
        if self.drafter is None or not wanting:
            return chunks, []
        failures: list[StepFailure] = []
        drafter = self.drafter
        requests = [
            DraftRequest(c.job.job_id, c.job.tokens, c.job.pages, c.num_tokens - 1, c.job.spec.cache_salt)
            for c in wanting
        ]
        drafts: dict[int, Draft] = {}
        try:
            drafts = dict(zip((id(c) for c in wanting), drafter.propose(requests), strict=True))
        except Exception as exc:
            if len(wanting) > 1:
                logger.warning(
                    "drafting for %d jobs failed (%s); drafting one at a time",
                    len(wanting),
                    type(exc).__name__,
                )
            for c, request in zip(wanting, requests, strict=True):
                try:
                    (drafts[id(c)],) = drafter.propose([request])
                except Exception as exc:
                    failures.append(StepFailure(c.job, "drafting", exc))
        failed = {id(f.job) for f in failures}
        out = []
        # The step's rows without each job's drafts: what a draft's trim weighs its rows against.
        rows = sum(c.num_tokens for c in chunks) - sum(c.num_tokens - 1 for c in wanting)
        keys = sum(c.seq.computed + 1 for c in chunks) if self.policy is not None else 0
        for c in chunks:
            if id(c.job) in failed:
                continue
            draft = drafts.get(id(c))
            if draft is None:
                out.append(c)
                continue
            tokens = draft.tokens
            if self.policy is not None and draft.evidence:
                kept = self.policy.trim(draft.evidence, rows, keys)
                tokens = tokens[:kept]
                if tokens:
                    self._evidence[c.job.job_id] = draft.evidence[:kept]
            rows += len(tokens)
            out.append(ScheduledChunk(c.job, 1 + len(tokens), tokens))
        return out, failures

    def verify(
        self, job: JobState, draft: tuple[int, ...], logits: torch.Tensor, events: list[JobEvent]
    ) -> Outcome:
        """Keep the acceptable prefix of `draft` plus one token of the target's own; the outcome for
        the generator to apply (a stop the taken tokens reached)."""
        drafted = len(draft)
        masks: list[torch.Tensor | None] = [None] * (drafted + 1)
        if job.constraint is not None:
            draft, masks = self._grammar_masks(job, draft)
            logits = logits[: len(draft) + 1]
        requests = [
            self._intake.sample_request(job, ahead=i, allowed=masks[i]) for i in range(len(draft) + 1)
        ]
        # The token the job takes at each position, as decoding one token at a time would take it
        # (its argmax, or its draw with that position's own uniform): drafts are kept while they
        # match it. A sampled draft token x is kept with probability p(x), as rejection sampling
        # keeps a proposed token, and the job's tokens are the same whatever drafts it was
        # offered: a seed gives one output at any load, after a resume too.
        choice = [r.token_id for r in self._sampler.sample(logits, requests)]
        accepted = accept_matching(choice, draft)
        bonus = int(choice[accepted])
        job.accepted_drafts += accepted
        job.rejected_drafts += drafted - accepted
        evidence = self._evidence.pop(job.job_id, ())
        if self.policy is not None:
            self.policy.verified(job.job_id, drafted, accepted, evidence)
        self.accepted += accepted
        self.rejected += drafted - accepted
        base = job.computed
        for token in (*draft[:accepted], bonus):
            outcome = self._intake.accept(job, token, None, events)
            if outcome.stop is not None:
                return outcome  # a job with banned strings does not speculate: no rewind here
        # K/V are valid for the last token and the accepted drafts only.
        self.rewind(job, self._scheduler.advance(job, base + 1 + accepted))
        return CARRY_ON

    def _grammar_masks(
        self, job: JobState, draft: tuple[int, ...]
    ) -> tuple[tuple[int, ...], list[torch.Tensor | None]]:
        """A constrained job's draft cut where its grammar refuses a token, and the grammar's mask
        at each position of what is left (plus the bonus position). The matcher walks the draft
        and is rolled back: only tokens taken by `_accept` advance it."""
        c = job.constraint
        assert c is not None
        bitmask = torch.zeros((len(draft) + 1, mask_words(self._vocab_size)), dtype=torch.int32)
        c.fill(bitmask, 0)
        taken = 0
        for token in draft:
            if not c.try_accept(token):
                break
            taken += 1
            if c.complete:  # the job ends with this token; the bonus is never taken
                bitmask[taken] = -1
                break
            c.fill(bitmask, taken)
        c.rollback(taken)
        return draft[:taken], list(bitmask[: taken + 1])

    def rewind(self, job: JobState, positions: list[int]) -> None:
        """A drafter keyed by pages forgets what it saw past a page the scheduler swapped."""
        if self.drafter is not None:
            for position in positions:
                self.drafter.rewind(job.job_id, position)

    def finished(self, job: JobState) -> None:
        """A job ended: its output may be copied by other jobs' drafts (before `forget`)."""
        if self.drafter is None or not self.keeps_outputs or job.embeds or job.new_tokens == 0:
            return  # pseudo ids under prompt embeddings are no text to copy
        try:
            self.drafter.finished(job.spec.cache_salt, job.tokens, job.prompt_len)
        except Exception:
            logger.exception("job %s: the drafter failed to keep its output", job.job_id[:8])

    def forget(self, job: JobState) -> None:
        if self.drafter is None:
            return
        self._evidence.pop(job.job_id, None)
        if self.policy is not None:
            self.policy.forget(job.job_id)
        try:
            self.drafter.forget(job.job_id)
        except Exception:
            # Its per-job state may linger; every job, this one included, can still run.
            logger.exception("job %s: the drafter failed to forget it", job.job_id[:8])
