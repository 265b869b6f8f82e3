"""Sequences in, logits out: the one place a forward batch is built and the model called.

The generator (its scheduled chunks), the draft-model drafter (catch-up and proposal
steps) and the tests' reference loop (tests/reference_generate.py) all run the model
through a `ModelRunner`, so batch building, device placement and the row of each
sequence's logits are written once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.cache.kv_cache import PagedKVCache
from engine.forward_batch import ForwardBatch, SequenceInput
from engine.model.llama import LlamaModel


@dataclass(frozen=True)
class ForwardResult:
    logits: torch.Tensor  # [rows, vocab] float32: the wanted positions of every sequence, in order
    first_rows: tuple[int, ...]  # per sequence, its first row in `logits` (-1: it wanted none)
    num_tokens: int  # tokens run through the model


class ModelRunner:
    """Runs batches of sequences through one model over one paged cache."""

    def __init__(self, model: LlamaModel, cache: PagedKVCache) -> None:
        self.model = model
        self.cache = cache
        self.forwarded_tokens = 0  # since start

    def run(self, seqs: Sequence[SequenceInput]) -> ForwardResult:
        batch = ForwardBatch.build(seqs, self.cache.page_size, self.model.device)
        # Looked up on each call (not bound once): tests and benchmarks wrap the model's forward.
        logits = self.model.forward(batch, self.cache)
        if logits.device.type != "cpu":
            # The sampler, the grammar masks and the text work on the host: one copy of this step's
            # logits rows (the only synchronisation in the step).
            logits = logits.to("cpu")
        self.forwarded_tokens += batch.num_tokens
        first_rows = []
        row = 0
        for s in seqs:
            if s.want_logits:
                first_rows.append(row)
                row += s.logit_positions
            else:
                first_rows.append(-1)
        return ForwardResult(logits, tuple(first_rows), batch.num_tokens)
