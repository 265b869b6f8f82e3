"""One job's sampling state (engine.sampling.sampler's SamplerState): its settings, its random draws
(keyed by its seed and the output position: positioned_uniform.py) and the token ids its penalties count. Written by the job's token intake (accept, rewind); read by the
sampler's logit processors."""

from __future__ import annotations

import math
import secrets
from array import array
from collections.abc import Sequence

import torch

from engine.jobs import SamplingSettings
from engine.sampling.positioned_uniform import SEQUENTIAL_STREAM, positioned_uniform, seed_key

NEG_INF = float("-inf")
MAX_BIAS = 1e30  # a +inf bias is clamped to this, so it forces the token without making inf - inf
# Settings within these bounds cannot overflow float32 on logits of magnitude < 1e18.
_SANE_LO, _SANE_HI = 1e-20, 1e20


class SamplerState:
    """One job's sampling state: its settings, its random draws, the tokens its penalties count.

    Owned by exactly one job and never shared: two unseeded jobs with equal settings still
    draw from two streams.
    """

    def __init__(self, settings: SamplingSettings, prompt_ids: Sequence[int], vocab_size: int) -> None:
        self.settings = settings
        self.vocab_size = vocab_size
        # An unseeded job still gets its own stream, seeded from the OS so jobs never share draws.
        raw_seed = settings.seed if settings.seed is not None else secrets.randbits(64)
        self.seed = raw_seed % (1 << 64)
        self._key = seed_key(self.seed)
        self._unpositioned = 0  # draws made without a position so far
        self.num_output_tokens = 0

        self.tracks_seen = settings.repetition_penalty != 1.0
        self.tracks_output = settings.frequency_penalty != 0.0 or settings.presence_penalty != 0.0
        self._prompt_ids = frozenset(prompt_ids) if self.tracks_seen else frozenset()
        self._seen: set[int] = set(self._prompt_ids)
        self._seen_ids = array("q", sorted(self._seen))
        self._seen_tensor: torch.Tensor | None = None
        self._out_pos: dict[int, int] = {}
        self._out_ids = array("q")
        self._out_counts = array("f")
        self._out_tensors: tuple[torch.Tensor, torch.Tensor] | None = None

        bias = dict(settings.logit_bias)  # one per token (SamplingSettings.validate)
        ids = sorted(t for t, b in bias.items() if b != 0.0 and not math.isnan(b))
        self.bias_ids = torch.tensor(ids, dtype=torch.long) if ids else None
        self.bias_values = torch.tensor([min(bias[t], MAX_BIAS) for t in ids], dtype=torch.float32)
        # Whether steps 1-4 could leave this row without a finite maximum (then it is checked):
        # -inf biases and bans covering the vocabulary, or values far beyond any real logit's scale.
        self.n_neg_inf = len(settings.banned_token_ids) + sum(bias[t] == NEG_INF for t in ids)
        self.extreme = (
            not (_SANE_LO <= settings.repetition_penalty <= _SANE_HI)
            or abs(settings.frequency_penalty) > _SANE_HI
            or abs(settings.presence_penalty) > _SANE_HI
            or any(abs(bias[t]) > _SANE_HI for t in ids)
        )
        banned = sorted(settings.banned_token_ids)
        self.banned_ids = torch.tensor(banned, dtype=torch.long) if banned else None
        # Greedy rows that need no work beyond argmax.
        self.plain_greedy = (
            settings.greedy
            and not self.tracks_seen
            and not self.tracks_output
            and self.bias_ids is None
            and self.banned_ids is None
        )

    def uniform(self, position: int | None = None, stream: int = 0) -> float:
        """The job's uniform in [0, 1) for output `position`: a function of (seed, position, stream)
        alone, so a job re-created at a position draws what it would have drawn there. `stream`
        tells a position's draws apart (0 the token; k its k-th redraw). None: the next of a
        sequence of its own (callers that track no position)."""
        if position is None:
            position, stream = self._unpositioned, SEQUENTIAL_STREAM
            self._unpositioned += 1
        return positioned_uniform(self._key, position, stream)

    def accept(self, token_id: int) -> None:
        """Record an emitted token (call once per token, also for accepted draft tokens)."""
        self.num_output_tokens += 1
        if self.tracks_seen and token_id not in self._seen:
            self._seen.add(token_id)
            self._seen_ids.append(token_id)
            self._seen_tensor = None
        if self.tracks_output:
            pos = self._out_pos.get(token_id)
            if pos is None:
                self._out_pos[token_id] = len(self._out_ids)
                self._out_ids.append(token_id)
                self._out_counts.append(1.0)
            else:
                self._out_counts[pos] += 1.0
            self._out_tensors = None

    def rewind(self, output: Sequence[int]) -> None:
        """Forget the output tokens past `output` (what the job keeps after a rewind); O(output),
        for the rare rewind only."""
        self.num_output_tokens = 0
        self._seen = set(self._prompt_ids)
        self._seen_ids = array("q", sorted(self._seen))
        self._seen_tensor = None
        self._out_pos, self._out_ids, self._out_counts = {}, array("q"), array("f")
        self._out_tensors = None
        for token in output:
            self.accept(token)

    @property
    def num_seen(self) -> int:
        return len(self._seen_ids)

    @property
    def num_output_ids(self) -> int:
        return len(self._out_ids)

    @property
    def needs_processing(self) -> bool:
        """Whether step 1-4 can change this job's logits (ignoring a request's banned_extra)."""
        return (
            (self.tracks_seen and len(self._seen_ids) > 0)
            or (self.tracks_output and len(self._out_ids) > 0)
            or self.bias_ids is not None
            or self.banned_ids is not None
        )

    def seen_ids(self) -> torch.Tensor:
        """Distinct prompt + output ids (int64), for the repetition penalty."""
        if self._seen_tensor is None:
            self._seen_tensor = _from_array(self._seen_ids, torch.long)
        return self._seen_tensor

    def output_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Distinct output ids (int64) and how often each was emitted (float32)."""
        if self._out_tensors is None:
            self._out_tensors = (
                _from_array(self._out_ids, torch.long),
                _from_array(self._out_counts, torch.float32),
            )
        return self._out_tensors


def _from_array(values: array[int] | array[float], dtype: torch.dtype) -> torch.Tensor:
    if len(values) == 0:
        return torch.empty(0, dtype=dtype)
    # clone(): the array must not stay exported, or accept() could not grow it.
    return torch.frombuffer(values, dtype=dtype).clone()
