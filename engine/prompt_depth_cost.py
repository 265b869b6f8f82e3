"""What a prompt token costs a forward at a depth, in prompt tokens at depth 0.

A prompt token's linears cost the same at any position, but its attention reads every key
before it: a slice of n prompt tokens starting at depth d costs n * (a + b * (d + n / 2)). On a
2-core Zen 4 a 128-token slice beside four decoding streams took 68 ms at depth 0 and 385 ms at
depth 7400, so a slice bounded in tokens alone stalled the running streams 5.6x longer at the end
of a long prompt than at its start. Priced in depth-0 tokens, a slice costs
n * (1 + (d + n / 2) / parity), where parity = a / b is the depth at which a token's attention
costs as much as the rest of its forward (timed at warm-up: engine/prompt_depth_timing.py). The
scheduler lets no slice beside decode steps cost more than `prefill_while_decoding` tokens from
depth 0, and no forward more than `max_chunk_size` tokens from depth 0.

The same timing gives a depth-0 prompt token's seconds (`token_seconds`), by which a forward with no
decode step is held to `prefill_alone_ms` of prompt work (`alone_tokens`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PromptDepthCost:
    parity: float = math.inf  # keys; inf: depth is free (not timed)
    token_seconds: float | None = None  # a depth-0 prompt token's seconds in a timed slice; None: not timed

    def __post_init__(self) -> None:
        if not self.parity > 0:
            raise ValueError(f"a parity depth must be > 0, got {self.parity}")
        if self.token_seconds is not None and not (0 < self.token_seconds < math.inf):
            raise ValueError(f"a token's seconds must be > 0, got {self.token_seconds}")

    def alone_tokens(self, milliseconds: float, at_least: int, at_most: int) -> int:
        """Depth-0 prompt tokens a forward with no decode step may carry: what `milliseconds` of
        them take (0, or untimed: `at_most`), at least `at_least`, and never more than `at_most`."""
        if milliseconds <= 0 or self.token_seconds is None:
            return at_most
        return min(at_most, max(at_least, math.floor(milliseconds / 1000 / self.token_seconds)))

    def slice_cost(self, tokens: int, depth: int) -> float:
        """Depth-0 tokens that `tokens` prompt tokens starting at `depth` cost."""
        return tokens * (1.0 + (depth + tokens / 2) / self.parity)

    def tokens_within(self, units: float, depth: int) -> int:
        """The most prompt tokens from `depth` on whose slice costs at most `units` (may be 0)."""
        if units <= 0:
            return 0
        if math.isinf(self.parity):
            return math.floor(units)
        # n^2 / (2 p) + n (1 + d / p) - units <= 0, for its positive root.
        p, lead = self.parity, 1.0 + depth / self.parity
        n = math.floor(p * (math.sqrt(lead * lead + 2.0 * units / p) - lead))
        while n > 0 and self.slice_cost(n, depth) > units:  # the root's rounding
            n -= 1
        return n

    def describe(self, beside_decoding: int, alone: int) -> str:
        """How prompts are sliced beside decode steps and chunked alone, for logs."""
        if math.isinf(self.parity):
            return (
                f"{beside_decoding} prompt tokens a forward beside decode steps, {alone} alone, at any depth"
            )

        def at(tokens: int) -> str:
            units = self.slice_cost(tokens, 0)
            deep = ", ".join(f"{self.tokens_within(units, d)} from depth {d}" for d in (1024, 4096))
            return f"{tokens} from depth 0 ({deep})"

        return (
            f"prompt tokens a forward beside decode steps: {at(beside_decoding)}; alone: {at(alone)}; "
            f"a token at depth d costs 1 + d/{self.parity:.0f} of one at depth 0"
        )
