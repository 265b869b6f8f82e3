"""What one served request measured: when it was sent, when each streamed chunk came, how many tokens."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestTiming:
    sent: float  # perf_counter when the request went out
    chunks: tuple[float, ...]  # perf_counter of each streamed chunk that carried tokens
    tokens: int  # generated tokens, as the server counted them
    wanted: int  # output tokens the trace asked for
    error: str | None

    @property
    def ok(self) -> bool:
        return self.error is None and self.tokens == self.wanted and bool(self.chunks)

    @property
    def ttft(self) -> float:
        return self.chunks[0] - self.sent

    @property
    def gaps(self) -> list[float]:
        """Between consecutive chunks: how long a reader's stream stood still. A chunk carrying
        several tokens (a verified draft) is one gap, not several small ones."""
        return [b - a for a, b in zip(self.chunks, self.chunks[1:], strict=False)]

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first."""
        return (self.chunks[-1] - self.chunks[0]) / max(1, self.tokens - 1)
