"""A step's sampling: the token masks of its constrained jobs (computed beside the forward where a
core is spare), then one sampler call for every job whose chunk reached its last token.

If the batched call raises, each job is sampled alone to find whose it was; a job whose mask or
request cannot be made is reported (StepFailure), never the others.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

import torch

from engine.grammar.constraints import MaskWorker
from engine.jobs import JobId
from engine.output.token_intake import TokenIntake
from engine.sampling.sampler import Sampler, SampleRequest, SampleResult
from engine.step_failure import StepFailure
from engine.step_forward import Staged, StepOutput, logit_rows

logger = logging.getLogger(__name__)

Masks = dict[JobId, torch.Tensor]  # a constrained job's token bitmask for this step
Taken = list[tuple[StepOutput, SampleResult]]


class StepSampling:
    def __init__(self, sampler: Sampler, intake: TokenIntake, vocab_size: int) -> None:
        self._sampler = sampler
        self._intake = intake
        self._vocab_size = vocab_size
        self._masks: MaskWorker | None = None  # its thread starts with the first constrained job

    def start_masks(self, staged: Staged) -> Future[Masks] | None:
        """Start computing the token masks of the constrained jobs that sample after this forward."""
        jobs = [
            c.job
            for c, seq in staged
            if seq.want_logits and not c.draft and not c.negative and c.job.constraint is not None
        ]
        if not jobs:
            return None
        if self._masks is None:
            self._masks = MaskWorker(self._vocab_size)
        constraints = [j.constraint for j in jobs if j.constraint is not None]
        future = self._masks.start(constraints)
        result: Future[Masks] = Future()

        def done(f: Future[torch.Tensor]) -> None:
            exc = f.exception()
            if exc is not None:
                result.set_exception(exc)
            else:
                bitmask = f.result()
                result.set_result({j.job_id: bitmask[i] for i, j in enumerate(jobs)})

        future.add_done_callback(done)
        return result

    def sample(
        self, sampled: list[StepOutput], masks: Future[Masks] | None
    ) -> tuple[Taken, list[StepFailure]]:
        """The next token of every job in `sampled` (their masks from `masks`), and the jobs that failed."""
        failures: list[StepFailure] = []
        allowed: Masks = {}
        if masks is not None:
            try:
                allowed = masks.result()  # computed while the forward ran
            except Exception as exc:
                failures += [
                    StepFailure(o.chunk.job, "computing its grammar's token mask", exc)
                    for o in sampled
                    if o.chunk.job.constraint is not None
                ]
                sampled = [o for o in sampled if o.chunk.job.constraint is None]
        ready: list[tuple[StepOutput, SampleRequest]] = []
        for out in sampled:
            try:
                job = out.chunk.job
                ready.append((out, self._intake.sample_request(job, allowed=allowed.get(job.job_id))))
            except Exception as exc:
                failures.append(StepFailure(out.chunk.job, "preparing its sampling", exc))
        if not ready:
            return [], failures
        try:
            # overwrite: the masks go into the forward's own rows (a masked row stays right for a
            # rewind: the grammar is in the same state when that position is sampled again).
            results = self._sampler.sample(
                logit_rows([o for o, _ in ready]), [r for _, r in ready], overwrite=True
            )
            return list(zip((o for o, _ in ready), results, strict=True)), failures
        except Exception as exc:
            if len(ready) == 1:
                return [], [*failures, StepFailure(ready[0][0].chunk.job, "sampling", exc)]
            # A seeded sampled job whose uniform was already drawn in the failed call draws again:
            # still a valid sample, though not the one its seed gives alone.
            logger.warning(
                "sampling %d jobs failed (%s); sampling them one at a time", len(ready), type(exc).__name__
            )
        taken: Taken = []
        for out, request in ready:
            try:
                (result,) = self._sampler.sample(out.logits[out.row : out.row + 1], [request])
                taken.append((out, result))
            except Exception as exc:
                failures.append(StepFailure(out.chunk.job, "sampling", exc))
        return taken, failures

    def close(self) -> None:
        if self._masks is not None:
            self._masks.close()
