"""Classifier-free guidance: a job steered away from a negative prompt.

A guided job runs a second sequence beside its own: the negative prompt followed by the job's
output tokens, with its own pages (prefix-shared like any other sequence), prefilled and decoded
in the same forwards as everything else and never sampled. The job samples from
`uncond + scale * (cond - uncond)` over the two rows' log-softmaxes (the rule of transformers'
`guidance_scale` with `negative_prompt_ids`), before penalties, masks and the other filters:
scale 1 is the job alone, scale 0 the negative prompt alone, larger scales push further from it.
The mixing itself is the sampler's first step (engine/sampling/logit_processors.py `mix_guided`); this file
stays free of torch, for the front end's checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_GUIDANCE_SCALE = 100.0


@dataclass(frozen=True)
class Guidance:
    scale: float  # how far past the negative prompt's distribution the job's is pushed
    negative_prompt_ids: tuple[int, ...]  # the unconditional sequence's prompt (then the output follows)

    def problem(self, vocab_size: int) -> str | None:
        """What is wrong with these settings (naming the field), or None."""
        if not (math.isfinite(self.scale) and 0.0 <= self.scale <= MAX_GUIDANCE_SCALE):
            return f"guidance.scale must be finite and in [0, {MAX_GUIDANCE_SCALE:g}], got {self.scale}"
        if not self.negative_prompt_ids:
            return "guidance needs a negative prompt of at least one token"
        if not all(0 <= t < vocab_size for t in self.negative_prompt_ids):
            return f"guidance negative prompt token ids must be in [0, {vocab_size})"
        return None
