"""The scheduler's settings (plain values; the service's flags build them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine import defaults
from engine.errors import InvalidRequestError


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = defaults.MAX_BATCH_SIZE
    max_chunk_size: int = defaults.MAX_CHUNK_SIZE
    prefill_while_decoding: int = defaults.PREFILL_WHILE_DECODING  # prompt tokens beside decode steps
    prompt_reserve: float = defaults.PROMPT_RESERVE  # budget share a long prompt leaves to those behind
    prefill_alone_ms: float = defaults.PREFILL_ALONE_MS  # prompt work of a forward no decode step is in
    max_q_size: int = defaults.MAX_QUEUE
    max_skips: int = 4
    prefix_cache: bool = True  # reuse full pages across jobs (off: every job computes its whole prompt)
    # Waiting jobs of one named tenant at once (tenant "", authentication off, has only max_q_size);
    # None: a share of max_q_size (defaults.tenant_queue_cap).
    max_q_per_tenant: int | None = None
    priority_aging: float = defaults.PRIORITY_AGING  # priority levels a waiting job gains per second
    tenant_weights: tuple[tuple[str, float], ...] = ()  # (tenant, weight) of its fair share; default 1

    @property
    def tenant_queue_cap(self) -> int:
        """Waiting jobs one named tenant may have."""
        if self.max_q_per_tenant is None:
            return defaults.tenant_queue_cap(self.max_q_size)
        return self.max_q_per_tenant

    def __post_init__(self) -> None:
        for name in (
            "max_batch_size",
            "max_chunk_size",
            "prefill_while_decoding",
            "max_q_size",
            "tenant_queue_cap",
        ):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_skips < 0:
            raise InvalidRequestError(f"max_skips must be >= 0, got {self.max_skips}")
        if not 0.0 <= self.prompt_reserve < 1.0:
            raise InvalidRequestError(f"prompt_reserve must be in [0, 1), got {self.prompt_reserve}")
        if self.prefill_alone_ms < 0 or not math.isfinite(self.prefill_alone_ms):
            raise InvalidRequestError(f"prefill_alone_ms must be >= 0, got {self.prefill_alone_ms}")
        if self.priority_aging < 0 or not math.isfinite(self.priority_aging):
            raise InvalidRequestError(f"priority_aging must be >= 0, got {self.priority_aging}")
        for tenant, weight in self.tenant_weights:
            if not (weight > 0 and math.isfinite(weight)):
                raise InvalidRequestError(f"tenant {tenant!r}: weight must be > 0, got {weight}")
