"""Loop detection: does a job's output end with one pattern repeated over and over?

A job with `stop_on_loop = LoopStop(window, min_repetitions)` ends (StopReason.LOOP) as soon as its
output tokens end with some pattern of 1 to `window` tokens repeated at least `min_repetitions`
times in a row: "la femme au roi, la femme au roi, la femme au roi," is the pattern of five tokens
three times. Small models fall into such loops and would otherwise run to max_new_tokens.

Checked after every accepted token, on the output only (the prompt may repeat itself freely).
A period p is verified only when the newest token equals the one p back, so a token costs
O(window) comparisons while no loop forms.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_WINDOW = 256
MAX_REPETITIONS = 64


@dataclass(frozen=True)
class LoopStop:
    window: int  # longest repeating pattern looked for, in tokens
    min_repetitions: int  # consecutive copies of it that make a loop (>= 2)

    def problem(self) -> str | None:
        if not 1 <= self.window <= MAX_WINDOW:
            return f"stop_on_loop.window must be in [1, {MAX_WINDOW}], got {self.window}"
        if not 2 <= self.min_repetitions <= MAX_REPETITIONS:
            return (
                f"stop_on_loop.min_repetitions must be in [2, {MAX_REPETITIONS}], got {self.min_repetitions}"
            )
        return None


def loop_period(tokens: Sequence[int], start: int, rule: LoopStop) -> int | None:
    """The shortest period p <= rule.window such that the last p * min_repetitions tokens of the
    output `tokens[start:]` are one p-token pattern repeated; None if there is none (no copy made)."""
    n = len(tokens)
    reps = rule.min_repetitions
    if n <= start:
        return None
    last = tokens[-1]
    for p in range(1, min(rule.window, (n - start) // reps) + 1):
        if tokens[n - 1 - p] != last:
            continue
        if all(tokens[i] == tokens[i + p] for i in range(n - p * reps, n - p)):
            return p
    return None
