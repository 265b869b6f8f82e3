"""Speculative decoding's settings (DrafterKind, SpeculationConfig): plain values, no torch.

engine/speculation/speculative.py runs the drafters; these settings stay light so that building the
command line (`dyngen serve` parses its flags in the front-end process) imports no torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from engine.errors import InvalidRequestError


class DrafterKind(enum.Enum):
    NONE = "none"
    NGRAM = "ngram"
    DRAFT_MODEL = "draft_model"


@dataclass(frozen=True)
class SpeculationConfig:
    kind: DrafterKind = DrafterKind.NONE
    # The most draft tokens one job verifies per step, and (adaptive) one step over all its jobs
    # where other streams share it: the step's bound keeps every running stream's next token from
    # waiting on more than that many extra rows, however many jobs draft; a job decoding alone
    # delays no one and may use its per-job most. Editing trace, batch 1, Zen 5 (best of 3 rounds,
    # two seeds): 32 a job alone gave 2.04x and 2.41x over no drafts against 1.97x and 2.23x for 16
    # (docs/ARCHITECTURE.md).
    num_draft_tokens: int = 32
    step_draft_tokens: int = 16
    max_ngram: int = 4
    # With more running jobs than this, no speculation at all. With `adaptive`, the step's measured
    # cost stops drafts that do not pay (engine/speculation/draft_policy.py), but its table is an
    # estimate: served near saturation (~30 running jobs on 2 cores, chat trace), drafting cut the
    # rate served at 5.66 req/s from 4.37 to 3.95-4.18 req/s and broke the TTFT SLO, while at up to
    # ~16 running it halved the time per output token.
    max_batch_size: int = 16
    # Each job's draft length follows its own acceptance and the step's cost (num_draft_tokens is
    # then the most any job drafts); off: every speculating job drafts num_draft_tokens.
    adaptive: bool = True
    # Recent finished outputs the n-gram drafter also copies from, in tokens (0: none); jobs copy
    # only outputs of their own cache salt (engine/speculation/suffix_corpus.py).
    corpus_tokens: int = 1 << 14

    def __post_init__(self) -> None:
        if not 1 <= self.num_draft_tokens <= 32:
            raise InvalidRequestError(f"num_draft_tokens must be in [1, 32], got {self.num_draft_tokens}")
        if not 1 <= self.step_draft_tokens <= 256:
            raise InvalidRequestError(f"step_draft_tokens must be in [1, 256], got {self.step_draft_tokens}")
        if not 1 <= self.max_ngram <= 16:
            raise InvalidRequestError(f"max_ngram must be in [1, 16], got {self.max_ngram}")
        if self.corpus_tokens < 0:
            raise InvalidRequestError(f"corpus_tokens must be >= 0, got {self.corpus_tokens}")
        if self.max_batch_size < 1:
            raise InvalidRequestError(f"speculation max_batch_size must be >= 1, got {self.max_batch_size}")
