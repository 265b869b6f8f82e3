"""Classifier-free guidance in the engine: a guided job's negative sequence (its second row) and the
mix of the two rows' logits (engine/prompt/guidance.py holds the request's part, torch-free).

The negative sequence is the negative prompt, then (as they come) the job's output tokens: a row of
the job (a SequenceState, not a job of its own), run with the job's adapter and cache salt and never
sampled; the job is admitted, preempted and finished with both rows. After the forward the
job's row is replaced, in place, by log_softmax(uncond) + scale * (log_softmax(cond) -
log_softmax(uncond)), so every later step (masks, penalties, kept rows for rewinds) sees the mix.
"""

from __future__ import annotations

import torch

from engine.job_state import JobState
from engine.jobs import JobSpec, JobStage
from engine.sampling.logit_processors import mix_guided
from engine.sequence import SequenceState, prefix_salt
from engine.step_failure import StepFailure
from engine.step_forward import StepOutput


def negative_sequence(spec: JobSpec, adapter_uid: int | None) -> SequenceState:
    """A guided job's second row: its negative prompt, under the job's cache salt and adapter."""
    assert spec.guidance is not None
    ids = spec.guidance.negative_prompt_ids
    return SequenceState(
        prompt_len=len(ids), prefix_salt=prefix_salt(spec.cache_salt, adapter_uid), tokens=list(ids)
    )


def guide(
    sampled: list[StepOutput], negatives: dict[JobState, StepOutput]
) -> tuple[list[StepOutput], list[StepFailure]]:
    """Each guided job's logits row replaced by its mix with its negative sequence's row (`negatives`:
    job -> that row), in place; the outputs to sample and the guided jobs that failed."""
    guided: list[tuple[StepOutput, StepOutput]] = []
    scales: list[float] = []
    kept: list[StepOutput] = []
    failures: list[StepFailure] = []
    for out in sampled:
        job = out.chunk.job
        if job.negative is None or job.spec.guidance is None:
            kept.append(out)
        elif job.stage is JobStage.FINISHED:  # failed with its negative sequence's share
            continue
        elif (negative := negatives.get(job)) is None:
            error = RuntimeError("its negative sequence's logits are not in the same forward")
            failures.append(StepFailure(job, "guiding its sampling", error))
        else:
            guided.append((out, negative))
            scales.append(job.spec.guidance.scale)
    if not guided:
        return kept, failures
    try:
        cond = torch.stack([o.logits[o.row] for o, _ in guided])
        uncond = torch.stack([n.logits[n.row] for _, n in guided])
        mixed = mix_guided(cond, uncond, torch.tensor(scales))
        inference = guided[0][0].logits.is_inference()  # the forward's logits are inference tensors
        with torch.inference_mode(inference):
            for i, (o, _) in enumerate(guided):
                o.logits[o.row].copy_(mixed[i])
    except Exception as exc:
        return kept, failures + [StepFailure(o.chunk.job, "guiding its sampling", exc) for o, _ in guided]
    return kept + [o for o, _ in guided], failures
