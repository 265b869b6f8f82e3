"""Token intake: what becomes of each token a job samples, on the generator thread.

A sampled token is taken (the stop token and EOS checks, the grammar, the text stream with its
stop strings and held text), streamed as TokensGenerated with the text it completes, or held
while it may still start a banned string; a banned string that completes rewinds the job past
its first token, bans that token at that position and samples the position again from its
kept logits row. Token intake writes the job's tokens and output state, and returns what the
generator must do next as an Outcome (the job stops; its K/V past a rewind are no longer valid):
it calls back into nothing, so a step reads schedule -> run -> sample -> intake -> apply.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.cache.prefix_hash import common_prefix_len
from engine.errors import InvalidRequestError
from engine.grammar.constraints import token_bitmask
from engine.job_state import HeldToken, JobState
from engine.jobs import JobEvent, JobStage, StopReason, TokenLogprob, TokensGenerated
from engine.output.loop_detector import loop_period
from engine.output.text_stream import BannedMatch
from engine.output.token_healing import TokenHealer
from engine.sampling.sampler import Sampler, SampleRequest

# A job whose banned strings keep matching gives up (StopReason.ERROR) after this many rewinds:
# each costs a sampler call, and a model set on a banned string could otherwise loop for long.
MAX_REWINDS = 256


@dataclass(frozen=True)
class Stop:
    """Why and how a job ends: its JobFinished's reason, stop token, stop string and final text."""

    reason: StopReason
    token: int | None = None
    stop_string: str | None = None
    text: str = ""


@dataclass(frozen=True)
class Outcome:
    """What the generator does after a job took its tokens: end it (`stop`), and before that take its
    K/V back to its first `keep` tokens (a banned-string rewind took tokens back)."""

    stop: Stop | None = None
    keep: int | None = None


CARRY_ON = Outcome()


class TokenIntake:
    def __init__(self, sampler: Sampler, healer: TokenHealer, eos: frozenset[int], vocab_size: int) -> None:
        self._sampler = sampler
        self._healer = healer
        self._eos = eos
        self._vocab_size = vocab_size

    def follow_output(self, job: JobState) -> int | None:
        """Give a guided job's negative sequence the job's output tokens (taking back what a rewind
        took back from the job); the number of its tokens whose K/V stay valid if fewer than computed."""
        negative = job.negative
        if negative is None or job.stage is JobStage.FINISHED:
            return None
        output = job.tokens[job.prompt_len :]
        base = negative.prompt_len
        same = common_prefix_len(negative.tokens[base:], output)
        keep = None
        if base + same < len(negative.tokens):
            if negative.computed > base + same:
                keep = base + same
            del negative.tokens[base + same :]
        negative.tokens.extend(output[same:])
        return keep

    def resume(self, job: JobState, output: Sequence[int]) -> None:
        """Re-create a job's output state from the tokens an earlier engine delivered: its grammar,
        penalty counts, token healing and text stream as they were after the last of them, with
        nothing streamed again. Its first prefill then computes the K/V of prompt and output."""
        for at, token in enumerate(output):
            if job.constraint is not None and not job.constraint.try_accept(token):
                raise InvalidRequestError(f"resume_output[{at}]: token {token} breaks the response_format")
            job.tokens.append(token)
            job.sampler.accept(token)
            if job.healing:
                job.healing = self._healer.remaining(job.healing, (token,))
            if job.text.push([token]).banned is not None:
                raise InvalidRequestError(f"resume_output[{at}]: token {token} completes a banned string")
        job.text.commit()
        self.follow_output(job)

    def sample_request(
        self, job: JobState, ahead: int = 0, allowed: torch.Tensor | None = None
    ) -> SampleRequest:
        """The request for the job's next token (`ahead` tokens further on, when verifying drafts);
        `allowed`: its grammar's token mask."""
        spec = job.spec
        position = job.new_tokens + ahead
        banned: frozenset[int] = frozenset()
        if position < spec.min_new_tokens:
            banned = spec.stop_token_ids | (frozenset() if spec.ignore_eos else self._eos)
        # A redraw after a rewind takes the position's next uniform: the first one chose the token banned now.
        bans = job.position_bans.get(position, frozenset()) if job.position_bans else frozenset()
        banned |= bans
        if job.constraint is not None and allowed is None:
            raise RuntimeError("a constrained job must not sample without its token mask")
        if job.healing:
            if ahead:
                raise RuntimeError("a job still healing its prompt's last word must not verify drafts")
            allowed = self._healer.mask(job.healing)
        return SampleRequest(
            job.sampler, banned, spec.return_logprobs, spec.top_logprobs, allowed, position, len(bans)
        )

    def accept(
        self,
        job: JobState,
        token: int,
        logprob: TokenLogprob | None,
        events: list[JobEvent],
        logits: torch.Tensor | None = None,
    ) -> Outcome:
        """Take one new token of the job (`logits`: the row it was sampled from): stream its text,
        stop the job on a stop condition, or rewind past a banned string and take another."""
        keep: int | None = None
        step = self._take(job, token, logprob, logits, events)
        while isinstance(step, _Again):
            keep = step.keep if keep is None else min(keep, step.keep)
            step = self._take(job, step.token, step.logprob, step.row, events)
        return CARRY_ON if step is None and keep is None else Outcome(step, keep)

    def _take(
        self,
        job: JobState,
        token: int,
        logprob: TokenLogprob | None,
        logits: torch.Tensor | None,
        events: list[JobEvent],
    ) -> Stop | _Again | None:
        """`accept` for one token: the job's stop, the token sampled again after a rewind, or None."""
        spec = job.spec
        now = time.perf_counter()
        if job.first_token_at is None:
            job.first_token_at = now
        if token in spec.stop_token_ids or (not spec.ignore_eos and token in self._eos):
            reason = StopReason.STOP_TOKEN if token in spec.stop_token_ids else StopReason.EOS
            return self._stop_releasing(job, reason, token, events)
        if job.constraint is not None:
            job.constraint.accept(token)
        job.tokens.append(token)
        job.sampler.accept(token)
        if job.healing:
            job.healing = self._healer.remaining(job.healing, (token,))
        delta = job.text.push([token])
        if delta.banned is not None:
            return self._rewind(job, delta.banned, token, logits)
        # Tokens are streamed with their text: the stream releases the oldest `released` of the
        # tokens it holds (this one included, unless it may be the start of a banned string).
        if not job.held and delta.released == 1:  # nothing held back: the usual case
            logprobs = () if logprob is None else (logprob,)
            events.append(TokensGenerated(job.job_id, spec.identifier, delta.text, (token,), logprobs))
        else:
            # A token that may start a banned string keeps its logits row, to be sampled again.
            kept = logits if job.text.held > 0 else None
            job.held.append(HeldToken(token, logprob, None if kept is None else kept.clone()))
            out = job.held[: delta.released]
            del job.held[: delta.released]
            if out or delta.text:
                events.append(self._released(job, delta.text, out))
        if delta.stop_string is not None:
            return Stop(StopReason.STOP_STRING, None, delta.stop_string, "")
        if job.constraint is not None and job.constraint.complete:
            return self._stop_releasing(job, StopReason.GRAMMAR, None, events)
        if job.new_tokens >= spec.max_new_tokens:
            return self._stop_releasing(job, StopReason.MAX_NEW_TOKENS, None, events)
        if spec.stop_on_loop is not None and loop_period(job.tokens, job.prompt_len, spec.stop_on_loop):
            return self._stop_releasing(job, StopReason.LOOP, None, events)
        return None

    def _stop_releasing(
        self, job: JobState, reason: StopReason, token: int | None, events: list[JobEvent]
    ) -> Stop:
        """Stop a job that no stop string ended: its held text, and held tokens, are final now.
        A stop string that text completes after all ends the job as a stop string would."""
        text = job.text.finish()
        stop = job.text.finish_stop
        if stop is not None:
            reason, token = StopReason.STOP_STRING, None
        if job.held:
            held, job.held = job.held, []
            events.append(self._released(job, text, held))
            text = ""
        return Stop(reason, token, stop, text)

    @staticmethod
    def _released(job: JobState, text: str, held: list[HeldToken]) -> TokensGenerated:
        """The event streaming held tokens with the text they complete."""
        logprobs = tuple(h.logprob for h in held if h.logprob is not None)
        return TokensGenerated(job.job_id, job.spec.identifier, text, tuple(h.token for h in held), logprobs)

    def _rewind(self, job: JobState, match: BannedMatch, token: int, logits: torch.Tensor | None) -> _Again:
        """A banned string completed: take the job back to before output token `match.token`, ban
        that token at that position, and sample the position again from its kept logits row."""
        if job.rewinds >= MAX_REWINDS:
            raise InvalidRequestError(
                f"banned strings: gave up after {MAX_REWINDS} rewinds (the model keeps writing "
                f"{match.string!r}); remove the ban or change the prompt"
            )
        job.rewinds += 1
        position = match.token
        # The stream holds job.held plus `token` (pushed last, not in job.held yet).
        k = position - (job.new_tokens - len(job.held) - 1)
        if k == len(job.held):
            first, row = token, logits
        else:
            first, row = job.held[k].token, job.held[k].logits
        if row is None:
            raise RuntimeError("a banned string matched at a token sampled without its logits row")
        keep = job.prompt_len + position
        dropped = len(job.tokens) - keep
        job.text.rewind(position)
        del job.held[k:]
        del job.tokens[keep:]
        job.sampler.rewind(job.tokens[job.prompt_len :])
        if job.heal is not None:
            job.healing = self._healer.remaining(job.heal.removed, job.tokens[job.prompt_len :])
        if job.constraint is not None:
            job.constraint.rollback(dropped)
        # Bans further on were made after another prefix: they no longer apply.
        bans = {p: b for p, b in job.position_bans.items() if p < position}
        bans[position] = job.position_bans.get(position, frozenset()) | {first}
        job.position_bans = bans
        allowed = None
        if job.constraint is not None:
            allowed = token_bitmask([job.constraint], self._vocab_size)[0]
        request = self.sample_request(job, allowed=allowed)
        (result,) = self._sampler.sample(row.unsqueeze(0), [request])
        t = result.token_id
        # With every token banned or masked, the sampler falls back past the bans (or to token 0).
        if t in bans[position] or (
            request.allowed is not None and not int(request.allowed[t // 32]) >> (t % 32) & 1
        ):
            raise InvalidRequestError(
                f"banned strings leave no token to write at output position {position} "
                f"(every allowed token starts {match.string!r})"
            )
        return _Again(result.token_id, result.logprob, row, keep)


@dataclass(frozen=True)
class _Again:
    """A rewind's token, sampled again from the kept row; the K/V past `keep` tokens are invalid."""

    token: int
    logprob: TokenLogprob | None
    row: torch.Tensor
    keep: int
