"""The dynamic generator's sampler: one SamplerState per job, one Sampler for the whole batch.

Processing order (fixed; transformers' generate() order, whose bias-before-penalties vLLM keeps
too). Given a row of raw logits x:

1. logit bias (x += bias; a -inf bias bans the token, +inf is clamped to 1e30 so it forces the token);
2. repetition penalty over prompt + output tokens (HF RepetitionPenaltyLogitsProcessor:
   x > 0 is divided by the penalty, x < 0 multiplied);
3. frequency and presence penalties over output tokens (OpenAI:
   x -= count * frequency_penalty + presence_penalty for every token already emitted);
4. bans: the job's banned_token_ids and the request's banned_extra are set to -inf;
5. temperature: s = (x - max(x)) / T (the shift keeps extreme temperatures free of inf - inf);
   T = 0 is greedy: argmax of the row after step 4, ties to the lowest id (torch.argmax);
6. top_k (ties at the k-th value are kept, as HF's TopKLogitsWarper does);
7. top_p (keeps a token iff the mass of the tokens ranked strictly above it is < top_p);
8. min_p (drops tokens whose probability is < min_p * the top probability);
9. typical (HF's TypicalLogitsWarper).

Steps 6-9 shape sampled rows only (greedy rows ignore them); each keeps at least
one token. The draw is by inverse CDF: one uniform u per sampled row, a function of the
job's seed and the token's output position (positioned_uniform.py), CDF accumulated in
float64 in vocabulary order, token = first id whose CDF exceeds u * total. So a seeded
job's tokens depend on its logits and its seed only, whatever shares the batch or came
before (a job re-created at a position draws the same; speculative verification samples each
draft position with its own uniform, so drafts change nothing).

Input logits are assumed finite. Rows are grouped by the candidates their filters need:
top_k rows work on their k best tokens (topk, not a sort of the vocabulary); top_p-only
rows first look for the nucleus among a set of at most TOP_P_CANDIDATES of their largest
probabilities that holds top_p of the mass (kernels/native/draw.py: two bucket passes over
the row, no sort); the rest work on the whole row. top_p's cut ranks the candidates by a
stable sort (a native radix sort where built), and the draw's float64 CDF is one native pass:
the same tokens as torch's sort, cumsum and searchsorted, at a fraction of their time (W1
with top_p 0.95 sampling: 1180 -> 1650 tok/s; greedy 1810-2000). All-greedy batches with
nothing to apply are one argmax.

Logprobs are log_softmax(s) after step 5 (T = 1 for greedy rows), before the
truncation filters: the model's distribution as this job reshaped it, so
alternatives cut by top_k/top_p still report a finite value.

Batched and threaded paths give the same bits because every tensor op used on a
row is row-invariant on CPU (elementwise ops, softmax, log_softmax, cumsum, sort,
topk, argmax, searchsorted); float reductions such as sum() are avoided since they
split differently for one row than for many.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType

import torch

from engine import defaults
from engine.jobs import TokenLogprob
from engine.sampling.logit_processors import apply_grammar_masks, fallback_row, penalize_bias_ban
from engine.sampling.sample_request import SampleRequest, SampleResult
from engine.sampling.sampler_state import NEG_INF, SamplerState
from engine.sampling.token_filters import FinalProb, filter_and_draw, take_rows, temperatures
from kernels.native.argmax import argmax_rows
from kernels.native.draw import top_mass

__all__ = [
    "DEFAULT_SAMPLER_MODE",
    "TOP_P_CANDIDATES",
    "SampleRequest",
    "SampleResult",
    "Sampler",
    "SamplerMode",
    "SamplerState",
]

# top_p without top_k: look for the nucleus among this many best tokens before sorting the whole row.
TOP_P_CANDIDATES = 1024


class SamplerMode(enum.Enum):
    """Where sampled rows are processed (engine.defaults.SAMPLER_MODE says which serves by default, and why).

    BATCHED: every row of the batch in one set of tensor ops on the engine's thread.
    THREADED: one task per sampled job on the sampler's thread pool; greedy rows stay batched.
    """

    BATCHED = "batched"
    THREADED = "threaded"


DEFAULT_SAMPLER_MODE = SamplerMode(defaults.SAMPLER_MODE)


@dataclass
class _Block:
    tokens: list[int]
    logprobs: list[TokenLogprob | None]
    probs: torch.Tensor | None  # [n, vocab] when asked for the distributions instead of tokens


class Sampler:
    """Samples one token per row for a batch of jobs, batched or on its thread pool (SamplerMode);
    both give identical tokens. The pool's threads start with the first threaded call."""

    def __init__(
        self,
        vocab_size: int,
        num_threads: int = defaults.SAMPLING_THREADS,
        mode: SamplerMode = DEFAULT_SAMPLER_MODE,
    ) -> None:
        if vocab_size < 1 or num_threads < 1:
            raise ValueError("vocab_size and num_threads must be >= 1")
        self.vocab_size = vocab_size
        self.num_threads = num_threads
        self.mode = mode
        self._pool: ThreadPoolExecutor | None = None
        self._extra_cache: dict[frozenset[int], torch.Tensor] = {}

    # -- public API ---------------------------------------------------------------------------

    def sample(
        self, logits: torch.Tensor, requests: Sequence[SampleRequest], overwrite: bool = False
    ) -> list[SampleResult]:
        """One token per row; row i of logits (float32 [N, vocab]) belongs to requests[i].

        Each sampled row draws its job's uniform for the row's position (a job may have one row per
        position: speculative verification samples each draft position). Logits are not modified,
        unless `overwrite`: then the rows with a grammar mask get it in place (no copy of the batch).
        """
        self._check(logits, requests)
        if len({id(r.state) for r in requests}) != len(requests) and (
            any(r.position is None for r in requests)
            or len({(id(r.state), r.position) for r in requests}) != len(requests)
        ):
            # Positioned draws are keyed by their position; unpositioned ones come in turn.
            raise ValueError(
                "a job may have several rows in one sample call only at distinct output positions"
            )
        logits = apply_grammar_masks(logits, requests, overwrite)
        if all(r.plain_greedy for r in requests):
            return [SampleResult(t) for t in argmax_rows(logits).tolist()]
        block = self._dispatch(logits, requests, draw=True)
        return [SampleResult(t, lp) for t, lp in zip(block.tokens, block.logprobs, strict=True)]

    def processed_probs(self, logits: torch.Tensor, requests: Sequence[SampleRequest]) -> torch.Tensor:
        """The distributions sample() draws from, float32 [N, vocab]; one-hot for greedy rows.

        Uses no randomness; what tests compare with reference distributions.
        """
        self._check(logits, requests)
        probs = self._dispatch(apply_grammar_masks(logits, requests), requests, draw=False).probs
        assert probs is not None
        return probs

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> Sampler:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- dispatch -----------------------------------------------------------------------------

    def _check(self, logits: torch.Tensor, requests: Sequence[SampleRequest]) -> None:
        if logits.dim() != 2 or logits.shape[0] != len(requests) or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits must be [{len(requests)}, {self.vocab_size}], got {list(logits.shape)}")
        if logits.dtype != torch.float32:
            raise ValueError(f"logits must be float32, got {logits.dtype}")

    def _dispatch(self, logits: torch.Tensor, requests: Sequence[SampleRequest], draw: bool) -> _Block:
        n = len(requests)
        sampled = [i for i, r in enumerate(requests) if not r.state.settings.greedy]
        if self.mode is SamplerMode.BATCHED or not sampled:
            return self._run_block(logits, requests, draw)

        # One task per sampled job; greedy rows stay batched on this thread meanwhile.
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="sampler")
        pool = self._pool
        futures: list[Future[_Block]] = [
            pool.submit(self._run_block, logits[i : i + 1], [requests[i]], draw) for i in sampled
        ]
        parts: list[tuple[list[int], _Block]] = []
        greedy = [i for i, r in enumerate(requests) if r.state.settings.greedy]
        if greedy:
            rows = logits.index_select(0, torch.tensor(greedy))
            parts.append((greedy, self._run_block(rows, [requests[i] for i in greedy], draw)))
        parts.extend(([i], f.result()) for i, f in zip(sampled, futures, strict=True))

        tokens = [0] * n
        logprobs: list[TokenLogprob | None] = [None] * n
        probs = None if draw else torch.empty(n, self.vocab_size)
        for rows_of, block in parts:
            for j, i in enumerate(rows_of):
                tokens[i] = block.tokens[j]
                logprobs[i] = block.logprobs[j]
            if probs is not None and block.probs is not None:
                probs[rows_of] = block.probs
        return _Block(tokens, logprobs, probs)

    # -- one block of rows (the whole batch, or one job on a pool thread) -------------------

    def _run_block(self, logits: torch.Tensor, reqs: Sequence[SampleRequest], draw: bool) -> _Block:
        n = len(reqs)
        x = self._apply_processors(logits, reqs)
        tokens = [0] * n
        probs = None if draw else torch.zeros(n, self.vocab_size)

        greedy = [i for i, r in enumerate(reqs) if r.state.settings.greedy]
        if greedy:
            gx = take_rows(x, greedy)
            best = gx.argmax(dim=-1)
            if probs is not None:
                probs[greedy, best] = 1.0
            for i, t in zip(greedy, best.tolist(), strict=True):
                tokens[i] = t
        sampled = [i for i, r in enumerate(reqs) if not r.state.settings.greedy]
        finals: dict[int, FinalProb] = {
            i: (1.0, ((tokens[i], 1.0),) if reqs[i].top_n else ()) for i in greedy if reqs[i].want_logprobs
        }
        if sampled:
            self._sample_rows(x, sampled, reqs, tokens, probs, finals)

        logprobs: list[TokenLogprob | None] = [None] * n
        if draw:
            self._logprobs(x, reqs, tokens, logprobs, finals)
        return _Block(tokens, logprobs, probs)

    def _apply_processors(self, logits: torch.Tensor, reqs: Sequence[SampleRequest]) -> torch.Tensor:
        """Steps 1-4 on a copy (the caller's logits stay as they are); untouched rows cost nothing."""
        extra = [self._extra_ids(r.banned_extra) for r in reqs]
        if not any(r.state.needs_processing or e is not None for r, e in zip(reqs, extra, strict=True)):
            return logits
        x = logits.clone()
        penalize_bias_ban(x, list(range(len(reqs))), [r.state for r in reqs], extra)
        # A row can be left without a finite maximum only by bans and -inf biases covering the vocabulary
        # or by extreme values; only such rows pay for the check, and fail over in fallback_row.
        risky = [
            i
            for i, r in enumerate(reqs)
            if r.state.extreme or r.state.n_neg_inf + len(r.banned_extra) >= self.vocab_size
        ]
        if risky:
            maxima = take_rows(x, risky).amax(dim=-1)
            for j in (~torch.isfinite(maxima)).nonzero().flatten().tolist():
                i = risky[j]
                x[i] = fallback_row(logits[i], reqs[i].state, extra[i])
        return x

    def _extra_ids(self, extra: frozenset[int]) -> torch.Tensor | None:
        if not extra:
            return None
        ids = self._extra_cache.get(extra)
        if ids is None:
            if len(self._extra_cache) > 4096:
                self._extra_cache.clear()
            ids = torch.tensor(sorted(extra), dtype=torch.long)
            self._extra_cache[extra] = ids
        return ids

    def _sample_rows(
        self,
        x: torch.Tensor,
        rows: list[int],
        reqs: Sequence[SampleRequest],
        tokens: list[int],
        probs: torch.Tensor | None,
        finals: dict[int, FinalProb],
    ) -> None:
        """Group sampled rows by the candidate set their filters need, then filter and draw per group."""
        vocab = self.vocab_size
        by_k: dict[int, list[int]] = {}
        nucleus: list[int] = []
        dense: list[int] = []
        for i in rows:
            s = reqs[i].state.settings
            if 0 < s.top_k < vocab:
                by_k.setdefault(s.top_k, []).append(i)
            elif s.top_p < 1.0 and s.typical == 1.0 and vocab > TOP_P_CANDIDATES:
                nucleus.append(i)
            else:
                dense.append(i)

        for k, group in by_k.items():
            # top_k candidates; k+1 to see ties at the boundary, which HF keeps (then the row goes dense).
            vals, ids = take_rows(x, group).topk(k + 1, dim=-1)
            tied = (vals[:, k] == vals[:, k - 1]).tolist()
            keep = [j for j, t in enumerate(tied) if not t]
            dense.extend(group[j] for j, t in enumerate(tied) if t)
            if keep:
                if len(keep) < len(group):
                    sel = torch.tensor(keep)
                    vals, ids = vals.index_select(0, sel), ids.index_select(0, sel)
                filter_and_draw(
                    vals[:, :k],
                    ids[:, :k],
                    None,
                    [group[j] for j in keep],
                    reqs,
                    tokens,
                    probs,
                    finals,
                    vocab,
                )

        if nucleus:
            # The nucleus is usually within the best few hundred tokens: find a set of the largest
            # probabilities (under the full distribution) that holds top_p of the mass; only rows
            # where none of at most TOP_P_CANDIDATES tokens does work on the whole vocabulary.
            xs = take_rows(x, nucleus)
            temps = temperatures(nucleus, reqs)
            full = torch.softmax((xs - xs.amax(dim=-1, keepdim=True)) / temps, dim=-1)
            top_p = [reqs[i].state.settings.top_p for i in nucleus]
            found = top_mass(full, top_p, TOP_P_CANDIDATES)
            if found is None:  # no native kernel: the TOP_P_CANDIDATES best tokens
                vals, ids = xs.topk(TOP_P_CANDIDATES, dim=-1)
                cand_probs = full.gather(-1, ids)
                fits = [True] * len(nucleus)
            else:
                # The set's ids, then padding ids outside it, masked off (-inf logit, no mass).
                ids, count = found
                pad = torch.arange(ids.shape[1]) >= count.clamp(min=0).unsqueeze(-1)
                vals = xs.gather(-1, ids).masked_fill_(pad, NEG_INF)
                cand_probs = full.gather(-1, ids).masked_fill_(pad, 0.0)
                fits = (count >= 0).tolist()
            # The candidates' mass summed as filter_and_draw sums it (largest first), so a row kept
            # here has its whole nucleus among them.
            ranked = cand_probs.sort(dim=-1, descending=True).values
            mass = ranked.cumsum(dim=-1, dtype=torch.float64)[:, -1].tolist()
            held = [fits[j] and mass[j] >= top_p[j] for j in range(len(nucleus))]
            keep = [j for j, h in enumerate(held) if h]
            dense.extend(i for i, h in zip(nucleus, held, strict=True) if not h)
            if keep:
                sel = torch.tensor(keep)
                filter_and_draw(
                    vals.index_select(0, sel),
                    ids.index_select(0, sel),
                    cand_probs.index_select(0, sel),
                    [nucleus[j] for j in keep],
                    reqs,
                    tokens,
                    probs,
                    finals,
                    vocab,
                )

        if dense:
            xs = take_rows(x, dense)
            # Rows with a tie at the top_k boundary: keep everything >= the k-th value.
            for j, i in enumerate(dense):
                k = reqs[i].state.settings.top_k
                if 0 < k < vocab:
                    if xs is x:
                        xs = x.clone()  # x may be the caller's logits
                    kth = xs[j].topk(k).values[-1]
                    xs[j] = xs[j].masked_fill(xs[j] < kth, NEG_INF)
            filter_and_draw(xs, None, None, dense, reqs, tokens, probs, finals, vocab)

    def _logprobs(
        self,
        x: torch.Tensor,
        reqs: Sequence[SampleRequest],
        tokens: list[int],
        out: list[TokenLogprob | None],
        finals: dict[int, FinalProb],
    ) -> None:
        rows = [i for i, r in enumerate(reqs) if r.want_logprobs]
        if not rows:
            return
        xs = take_rows(x, rows)
        temps = temperatures(rows, reqs)
        lp = torch.log_softmax((xs - xs.amax(dim=-1, keepdim=True)) / temps, dim=-1)
        chosen = lp.gather(-1, torch.tensor([[tokens[i]] for i in rows])).squeeze(-1).tolist()
        top_n = max(reqs[i].top_n for i in rows)
        top_vals: list[list[float]] = [[] for _ in rows]
        top_ids: list[list[int]] = [[] for _ in rows]
        if top_n > 0:
            tv, ti = lp.topk(min(top_n, self.vocab_size), dim=-1)
            top_vals, top_ids = tv.tolist(), ti.tolist()
        for j, i in enumerate(rows):
            n_alt = reqs[i].top_n
            alts = [
                (t, v) for t, v in zip(top_ids[j][:n_alt], top_vals[j][:n_alt], strict=True) if v != NEG_INF
            ]
            alts.sort(key=lambda a: (-a[1], a[0]))
            final_prob, final_top = finals.get(i, (None, ()))
            out[i] = TokenLogprob(tokens[i], chosen[j], tuple(alts), final_prob, final_top)
