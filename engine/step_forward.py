"""One forward of a step's staged chunks, and each chunk's share of its logits.

If the batched forward raises, each chunk runs alone to find whose it was: only the jobs whose
chunk fails are reported (StepFailure), the others' outputs stand. Nothing is committed before a
forward returns (`computed` advances after it), so a chunk can simply run again; K/V a failed
forward wrote past `computed` is overwritten later.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.forward_batch import SequenceInput
from engine.runner import ModelRunner
from engine.scheduled_chunk import ScheduledChunk
from engine.step_failure import StepFailure

logger = logging.getLogger(__name__)

Staged = list[tuple[ScheduledChunk, SequenceInput]]


@dataclass(frozen=True)
class StepOutput:
    """One chunk's share of a forward: its logits start at `row` of `logits`."""

    chunk: ScheduledChunk
    seq: SequenceInput
    logits: torch.Tensor
    row: int


def run_forward(runner: ModelRunner, staged: Staged) -> tuple[list[StepOutput], list[StepFailure]]:
    """The step's forward; on a fault, each chunk alone."""
    try:
        return _run(runner, staged), []
    except Exception as exc:
        if len(staged) == 1:
            return [], [StepFailure(staged[0][0].job, "running the model", exc)]
        logger.warning(
            "a forward of %d jobs failed (%s); running them one at a time", len(staged), type(exc).__name__
        )
    outputs: list[StepOutput] = []
    failures: list[StepFailure] = []
    for item in staged:
        try:
            outputs.extend(_run(runner, [item]))
        except Exception as exc:
            failures.append(StepFailure(item[0].job, "running the model", exc))
    return outputs, failures


def _run(runner: ModelRunner, staged: Staged) -> list[StepOutput]:
    result = runner.run([seq for _, seq in staged])
    return [
        StepOutput(c, seq, result.logits, row)
        for (c, seq), row in zip(staged, result.first_rows, strict=True)
    ]


def logit_rows(outputs: list[StepOutput]) -> torch.Tensor:
    """The logits row of each output, stacked in order (no copy when they are the whole forward's)."""
    first = outputs[0].logits
    if all(o.logits is first for o in outputs):
        if len(outputs) == first.shape[0]:
            return first
        return first[[o.row for o in outputs]]
    return torch.cat([o.logits[o.row : o.row + 1] for o in outputs])
