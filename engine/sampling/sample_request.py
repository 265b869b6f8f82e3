"""The rows of one Sampler call: what the engine asks for each job (SampleRequest) and what it gets
back (SampleResult)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.jobs import TokenLogprob
from engine.sampling.sampler_state import SamplerState


@dataclass(frozen=True)
class SampleRequest:
    """One row of a sample call. banned_extra: ids the engine suppresses now (e.g. EOS below min_new_tokens)."""

    state: SamplerState
    banned_extra: frozenset[int] = frozenset()
    want_logprobs: bool = False
    top_n: int = 0  # alternatives to report with the logprob
    # The job's grammar: int32 bitmask [ceil(vocab / 32)], bit t set = token t allowed (None: all).
    allowed: torch.Tensor | None = None
    # Where the token goes: its output position and which draw there (SamplerState.uniform); None
    # draws the state's next unpositioned uniform.
    position: int | None = None
    attempt: int = 0

    def uniform(self) -> float:
        """This row's uniform for its inverse-CDF draw."""
        return self.state.uniform(self.position, self.attempt)

    @property
    def plain_greedy(self) -> bool:
        return self.state.plain_greedy and not self.banned_extra and not self.want_logprobs


@dataclass(frozen=True)
class SampleResult:
    token_id: int
    # log_softmax of the logits after penalties, bias, bans and temperature (T = 1 for greedy),
    # before top_k/top_p/min_p/typical; top holds up to top_n finite alternatives, most likely first.
    logprob: TokenLogprob | None = None
