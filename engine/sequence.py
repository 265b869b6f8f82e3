"""A sequence: one row of the batch, with its tokens and where their K/V live.

A job runs as one sequence, or, when guided, as two (engine/guided_pair.py): its own, then its
negative prompt's. The cache manager (engine/cache/cache_manager.py) takes sequences, never jobs:
the page table and prefix-cache state are per row. Everything else a job is (its spec, sampler,
text, stage, events) is the job's alone (engine/job_state.py), so a guided pair is one job with
two rows, admitted, preempted, freed and resumed as one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.ids import PageId


@dataclass(frozen=True)
class PrefixCopy:
    """K/V to copy before the sequence's first forward: the first `tokens` slots of `source` (a page
    another sequence computed over the same leading tokens, held until copied) into `target`, the
    sequence's first page past its whole-page prefix hit."""

    source: PageId
    target: PageId
    tokens: int


# eq=False: a sequence is itself, compared by identity (the scheduler's and the cache manager's
# membership tests would otherwise compare every field). kw_only: a job's own fields come first.
@dataclass(eq=False, kw_only=True)
class SequenceState:
    prompt_len: int = 0  # leading tokens that are its prompt (set at construction, never changed)
    # The prefix cache's salt for its pages: the job's cache_salt, and under an adapter that
    # adapter's load too (K/V computed with an adapter are shared only with the same load).
    prefix_salt: str = ""
    tokens: list[int] = field(default_factory=list)  # prompt + accepted output
    pages: list[PageId] = field(default_factory=list)
    computed: int = 0  # tokens whose K/V are in its pages
    registered: int = 0  # leading pages already registered as full in the pool
    # Chain hashes of the leading full pages of `tokens` (all but the last token), computed once:
    # tokens only ever grow, so a hash never goes stale; extended as the tokens grow.
    page_hashes: list[int] = field(default_factory=list)
    # (page index, hash) of prompt pages this sequence is computing that waiting ones may wait for.
    inflight: list[tuple[int, int]] = field(default_factory=list)
    prefix_copy: PrefixCopy | None = None  # set at admission, done before its first forward
    # Prompt embedding spans (start position, float32 rows [n, hidden]), set at construction:
    # fed instead of the token embeddings there, at every (re)computation.
    embeds: tuple[tuple[int, torch.Tensor], ...] = ()

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
        """Pages this sequence must hold to store `total_tokens` tokens."""
        return -(-total_tokens // page_size)


def prefix_salt(cache_salt: str, adapter_uid: int | None) -> str:
    """A sequence's prefix salt: base-model sequences share by cache_salt; an adapter's load
    keys its own."""
    if adapter_uid is None:
        return cache_salt
    return f"{cache_salt}\x00lora\x00{adapter_uid}"
