"""The dynamic generator's sampler: one SamplerState per job, one Sampler for the whole batch.

Processing order (fixed; HF/vLLM order). Given a row of raw logits x:

1. repetition penalty over prompt + output tokens (HF RepetitionPenaltyLogitsProcessor:
   x > 0 is divided by the penalty, x < 0 multiplied);
2. frequency and presence penalties over output tokens (OpenAI:
   x -= count * frequency_penalty + presence_penalty for every token already emitted);
3. logit bias (x += bias; a -inf bias bans the token, +inf is clamped to 1e30 so it forces the token);
4. bans: the job's banned_token_ids and the request's banned_extra are set to -inf;
5. temperature: s = (x - max(x)) / T (the shift keeps extreme temperatures free of inf - inf);
   T = 0 is greedy: argmax of the row after step 4, ties to the lowest id (torch.argmax);
6. top_k (ties at the k-th value are kept, as HF's TopKLogitsWarper does);
7. top_p (keeps a token iff the mass of the tokens ranked strictly above it is < top_p);
8. typical (HF's TypicalLogitsWarper);
9. min_p (drops tokens whose probability is < min_p * the top probability).

Steps 6-9 shape sampled rows only (greedy rows ignore them); each keeps at least
one token. The draw is by inverse CDF: one uniform u from the job's own generator
per sampled row per call, CDF accumulated in float64 in vocabulary order, token =
first id whose CDF exceeds u * total. So a seeded job's tokens depend on its logits
and its seed only, whatever shares the batch, and `draw(processed_probs(...)[i])`
picks what `sample` picks.

Input logits are assumed finite. Rows are grouped by the candidates their filters need:
top_k rows work on their k best tokens (topk, not a sort of the vocabulary); top_p-only
rows first look for the nucleus among the TOP_P_CANDIDATES best tokens; the rest sort
the whole row. All-greedy batches with nothing to apply are one argmax.

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
import math
import secrets
from array import array
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType

import torch
import torch.nn.functional as F

from engine.jobs import SamplingSettings, TokenLogprob
from kernels.native.argmax import argmax_rows

__all__ = [
    "DEFAULT_MIN_SAMPLING_THREADS",
    "TOP_P_CANDIDATES",
    "SampleRequest",
    "SampleResult",
    "Sampler",
    "SamplerMode",
    "SamplerState",
]

# benchmarks/inprocess/sampler_bench.py on the 2-core CPU (vocab 49152, top_k 50 / top_p 0.9 / rep. penalty 1.1):
# the pool was 1.3x (1 job) to 3-5x (8-64 jobs) slower than the batched path: per-job work is ~40 small
# torch calls whose Python overhead holds the GIL, and the workers' OpenMP teams oversubscribe 2 cores.
# So AUTO never hands rows to the pool by default; min_sampling_threads / THREADED remain for other machines.
DEFAULT_MIN_SAMPLING_THREADS = 1 << 30

# top_p without top_k: look for the nucleus among this many best tokens before sorting the whole row.
TOP_P_CANDIDATES = 1024

_NEG_INF = float("-inf")
_MAX_BIAS = 1e30
_F32_MAX = torch.finfo(torch.float32).max
_F32_TINY = torch.finfo(torch.float32).tiny
# Settings within these bounds cannot overflow float32 on logits of magnitude < 1e18.
_SANE_LO, _SANE_HI = 1e-20, 1e20


class SamplerMode(enum.Enum):
    AUTO = "auto"  # batched, or the pool from min_sampling_threads sampled rows up
    BATCHED = "batched"
    THREADED = "threaded"


class SamplerState:
    """One job's sampling state: its settings, its own RNG, the tokens its penalties count.

    Owned by exactly one job and never shared: two jobs with equal settings still
    draw from two generators.
    """

    def __init__(self, settings: SamplingSettings, prompt_ids: Sequence[int], vocab_size: int) -> None:
        self.settings = settings
        self.vocab_size = vocab_size
        # An unseeded job still gets its own generator, seeded from the OS so jobs never share draws.
        raw_seed = settings.seed if settings.seed is not None else secrets.randbits(64)
        self.seed = raw_seed % (1 << 64)  # manual_seed takes [0, 2**64)
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(self.seed)
        self.num_output_tokens = 0

        self._track_seen = settings.repetition_penalty != 1.0
        self._track_output = settings.frequency_penalty != 0.0 or settings.presence_penalty != 0.0
        self._prompt_ids = frozenset(prompt_ids) if self._track_seen else frozenset()
        self._seen: set[int] = set(self._prompt_ids)
        self._seen_ids = array("q", sorted(self._seen))
        self._seen_tensor: torch.Tensor | None = None
        self._out_pos: dict[int, int] = {}
        self._out_ids = array("q")
        self._out_counts = array("f")
        self._out_tensors: tuple[torch.Tensor, torch.Tensor] | None = None

        bias: dict[int, float] = {}
        for token, value in settings.logit_bias:  # duplicates add up, in order
            bias[token] = bias.get(token, 0.0) + value
        ids = sorted(t for t, b in bias.items() if b != 0.0 and not math.isnan(b))
        self.bias_ids = torch.tensor(ids, dtype=torch.long) if ids else None
        self.bias_values = torch.tensor([min(bias[t], _MAX_BIAS) for t in ids], dtype=torch.float32)
        # Whether steps 1-4 could leave this row without a finite maximum (then it is checked):
        # -inf biases and bans covering the vocabulary, or values far beyond any real logit's scale.
        self._n_neg_inf = len(settings.banned_token_ids) + sum(bias[t] == _NEG_INF for t in ids)
        self._extreme = (
            not (_SANE_LO <= settings.repetition_penalty <= _SANE_HI)
            or abs(settings.frequency_penalty) > _SANE_HI
            or abs(settings.presence_penalty) > _SANE_HI
            or any(abs(bias[t]) > _SANE_HI for t in ids)
        )
        banned = sorted(settings.banned_token_ids)
        self.banned_ids = torch.tensor(banned, dtype=torch.long) if banned else None
        # Greedy rows that need no work beyond argmax.
        self.plain_greedy = (
            settings.greedy
            and not self._track_seen
            and not self._track_output
            and self.bias_ids is None
            and self.banned_ids is None
        )

    def accept(self, token_id: int) -> None:
        """Record an emitted token (call once per token, also for accepted draft tokens)."""
        self.num_output_tokens += 1
        if self._track_seen and token_id not in self._seen:
            self._seen.add(token_id)
            self._seen_ids.append(token_id)
            self._seen_tensor = None
        if self._track_output:
            pos = self._out_pos.get(token_id)
            if pos is None:
                self._out_pos[token_id] = len(self._out_ids)
                self._out_ids.append(token_id)
                self._out_counts.append(1.0)
            else:
                self._out_counts[pos] += 1.0
            self._out_tensors = None

    def rewind(self, output: Sequence[int]) -> None:
        """Forget the output tokens past `output` (what the job keeps after a rewind); O(output),
        for the rare rewind only."""
        self.num_output_tokens = 0
        self._seen = set(self._prompt_ids)
        self._seen_ids = array("q", sorted(self._seen))
        self._seen_tensor = None
        self._out_pos, self._out_ids, self._out_counts = {}, array("q"), array("f")
        self._out_tensors = None
        for token in output:
            self.accept(token)

    @property
    def needs_processing(self) -> bool:
        """Whether step 1-4 can change this job's logits (ignoring a request's banned_extra)."""
        return (
            (self._track_seen and len(self._seen_ids) > 0)
            or (self._track_output and len(self._out_ids) > 0)
            or self.bias_ids is not None
            or self.banned_ids is not None
        )

    def seen_ids(self) -> torch.Tensor:
        """Distinct prompt + output ids (int64), for the repetition penalty."""
        if self._seen_tensor is None:
            self._seen_tensor = _from_array(self._seen_ids, torch.long)
        return self._seen_tensor

    def output_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Distinct output ids (int64) and how often each was emitted (float32)."""
        if self._out_tensors is None:
            self._out_tensors = (
                _from_array(self._out_ids, torch.long),
                _from_array(self._out_counts, torch.float32),
            )
        return self._out_tensors


def _from_array(values: array[int] | array[float], dtype: torch.dtype) -> torch.Tensor:
    if len(values) == 0:
        return torch.empty(0, dtype=dtype)
    # clone(): the array must not stay exported, or accept() could not grow it.
    return torch.frombuffer(values, dtype=dtype).clone()


@dataclass(frozen=True)
class SampleRequest:
    """One row of a sample call. banned_extra: ids the engine suppresses now (e.g. EOS below min_new_tokens)."""

    state: SamplerState
    banned_extra: frozenset[int] = frozenset()
    want_logprobs: bool = False
    top_n: int = 0  # alternatives to report with the logprob
    # The job's grammar: int32 bitmask [ceil(vocab / 32)], bit t set = token t allowed (None: all).
    allowed: torch.Tensor | None = None

    @property
    def plain_greedy(self) -> bool:
        return self.state.plain_greedy and not self.banned_extra and not self.want_logprobs


@dataclass(frozen=True)
class SampleResult:
    token_id: int
    # log_softmax of the logits after penalties, bias, bans and temperature (T = 1 for greedy),
    # before top_k/top_p/typical/min_p; top holds up to top_n finite alternatives, most likely first.
    logprob: TokenLogprob | None = None


_Final = tuple[
    float, tuple[tuple[int, float], ...]
]  # the chosen token's final probability, top after filters


@dataclass
class _Block:
    tokens: list[int]
    logprobs: list[TokenLogprob | None]
    probs: torch.Tensor | None  # [n, vocab] when asked for the distributions instead of tokens


class Sampler:
    """Samples one token per row for a batch of jobs.

    AUTO uses the batched tensor path unless at least min_sampling_threads rows are
    sampled (not greedy), then the thread pool. Both give identical tokens.
    """

    def __init__(
        self,
        vocab_size: int,
        num_threads: int = 2,
        min_sampling_threads: int = DEFAULT_MIN_SAMPLING_THREADS,
        mode: SamplerMode = SamplerMode.AUTO,
    ) -> None:
        if vocab_size < 1 or num_threads < 1 or min_sampling_threads < 1:
            raise ValueError("vocab_size, num_threads and min_sampling_threads must be >= 1")
        self.vocab_size = vocab_size
        self.num_threads = num_threads
        self.min_sampling_threads = min_sampling_threads
        self.mode = mode
        self._pool: ThreadPoolExecutor | None = None
        self._extra_cache: dict[frozenset[int], torch.Tensor] = {}

    # -- public API ---------------------------------------------------------------------------

    def sample(
        self, logits: torch.Tensor, requests: Sequence[SampleRequest], overwrite: bool = False
    ) -> list[SampleResult]:
        """One token per row; row i of logits (float32 [N, vocab]) belongs to requests[i].

        Each sampled row draws one uniform from its job's generator. Logits are not modified,
        unless `overwrite`: then the rows with a grammar mask get it in place (no copy of the batch).
        """
        self._check(logits, requests)
        if len({id(r.state) for r in requests}) != len(requests):
            raise ValueError("a job may have only one row per sample call (its RNG draws would interleave)")
        logits = _constrained(logits, requests, overwrite)
        if all(r.plain_greedy for r in requests):
            return [SampleResult(t) for t in argmax_rows(logits).tolist()]
        block = self._dispatch(logits, requests, draw=True)
        return [SampleResult(t, lp) for t, lp in zip(block.tokens, block.logprobs, strict=True)]

    def processed_probs(self, logits: torch.Tensor, requests: Sequence[SampleRequest]) -> torch.Tensor:
        """The distributions sample() draws from, float32 [N, vocab]; one-hot for greedy rows.

        Uses no randomness; for speculative decoding's rejection sampling.
        """
        self._check(logits, requests)
        probs = self._dispatch(_constrained(logits, requests), requests, draw=False).probs
        assert probs is not None
        return probs

    def draw(self, probs_row: torch.Tensor, state: SamplerState) -> int:
        """A token from a distribution (a row of processed_probs, or a residual; need not be normalized),
        with the job's RNG: one uniform, as sample() draws. Greedy jobs take the argmax and draw nothing.
        """
        row = probs_row.reshape(1, -1).to(torch.float32)
        if not float(row.sum()) > 0:
            raise ValueError("draw needs a distribution with positive mass")
        if state.settings.greedy:
            return int(row.argmax(dim=-1).item())
        return int(_inverse_cdf(row, [state])[0].item())

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

    def _use_pool(self, n_sampled: int) -> bool:
        if self.mode is SamplerMode.THREADED:
            return n_sampled > 0
        if self.mode is SamplerMode.BATCHED:
            return False
        return n_sampled >= self.min_sampling_threads

    def _dispatch(self, logits: torch.Tensor, requests: Sequence[SampleRequest], draw: bool) -> _Block:
        n = len(requests)
        sampled = [i for i, r in enumerate(requests) if not r.state.settings.greedy]
        if not self._use_pool(len(sampled)):
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
            gx = _take_rows(x, greedy)
            best = gx.argmax(dim=-1)
            if probs is not None:
                probs[greedy, best] = 1.0
            for i, t in zip(greedy, best.tolist(), strict=True):
                tokens[i] = t
        sampled = [i for i, r in enumerate(reqs) if not r.state.settings.greedy]
        finals: dict[int, _Final] = {
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
        _penalize_bias_ban(x, list(range(len(reqs))), [r.state for r in reqs], extra)
        # A row can be left without a finite maximum only by bans and -inf biases covering the vocabulary
        # or by extreme values; only such rows pay for the check, and fail over in _fallback_row.
        risky = [
            i
            for i, r in enumerate(reqs)
            if r.state._extreme or r.state._n_neg_inf + len(r.banned_extra) >= self.vocab_size
        ]
        if risky:
            maxima = _take_rows(x, risky).amax(dim=-1)
            for j in (~torch.isfinite(maxima)).nonzero().flatten().tolist():
                i = risky[j]
                x[i] = _fallback_row(logits[i], reqs[i].state, extra[i])
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
        finals: dict[int, _Final],
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
            vals, ids = _take_rows(x, group).topk(k + 1, dim=-1)
            tied = (vals[:, k] == vals[:, k - 1]).tolist()
            keep = [j for j, t in enumerate(tied) if not t]
            dense.extend(group[j] for j, t in enumerate(tied) if t)
            if keep:
                if len(keep) < len(group):
                    sel = torch.tensor(keep)
                    vals, ids = vals.index_select(0, sel), ids.index_select(0, sel)
                self._finish(
                    vals[:, :k], ids[:, :k], None, [group[j] for j in keep], reqs, tokens, probs, finals
                )

        if nucleus:
            # The nucleus is usually within the best few hundred tokens: find its mass among the
            # candidates under the full distribution; only rows where it falls short sort the vocabulary.
            xs = _take_rows(x, nucleus)
            temps = _temperatures(nucleus, reqs)
            full = torch.softmax((xs - xs.amax(dim=-1, keepdim=True)) / temps, dim=-1)
            vals, ids = xs.topk(TOP_P_CANDIDATES, dim=-1)
            cand_probs = full.gather(-1, ids)
            mass = cand_probs.cumsum(dim=-1, dtype=torch.float64)[:, -1].tolist()
            keep = [j for j, i in enumerate(nucleus) if mass[j] >= reqs[i].state.settings.top_p]
            dense.extend(i for j, i in enumerate(nucleus) if mass[j] < reqs[i].state.settings.top_p)
            if keep:
                sel = torch.tensor(keep)
                self._finish(
                    vals.index_select(0, sel),
                    ids.index_select(0, sel),
                    cand_probs.index_select(0, sel),
                    [nucleus[j] for j in keep],
                    reqs,
                    tokens,
                    probs,
                    finals,
                )

        if dense:
            xs = _take_rows(x, dense)
            # Rows with a tie at the top_k boundary: keep everything >= the k-th value.
            for j, i in enumerate(dense):
                k = reqs[i].state.settings.top_k
                if 0 < k < vocab:
                    if xs is x:
                        xs = x.clone()  # x may be the caller's logits
                    kth = xs[j].topk(k).values[-1]
                    xs[j] = xs[j].masked_fill(xs[j] < kth, _NEG_INF)
            self._finish(xs, None, None, dense, reqs, tokens, probs, finals)

    def _finish(
        self,
        vals: torch.Tensor,
        ids: torch.Tensor | None,
        nucleus_probs: torch.Tensor | None,
        rows: list[int],
        reqs: Sequence[SampleRequest],
        tokens: list[int],
        probs: torch.Tensor | None,
        finals: dict[int, _Final],
    ) -> None:
        """Steps 5-9 and the draw for one group. vals: [n, W] logits after 1-4 (and top_k);
        ids: their token ids ([n, W]), or None when W is the whole vocabulary (column = id)."""
        width = vals.shape[1]
        # Canonical order (by token id) so the CDF runs in vocabulary order, as draw() on a dense row does.
        if ids is not None:
            ids, perm = ids.sort(dim=-1)
            vals = vals.gather(-1, perm)
            if nucleus_probs is not None:
                nucleus_probs = nucleus_probs.gather(-1, perm)
        settings = [reqs[i].state.settings for i in rows]
        temps = _temperatures(rows, reqs)
        s = (vals - vals.amax(dim=-1, keepdim=True)) / temps

        if any(st.top_p < 1.0 for st in settings):
            p = nucleus_probs if nucleus_probs is not None else torch.softmax(s, dim=-1)
            order = s.sort(dim=-1, descending=True, stable=True).indices
            p_sorted = p.gather(-1, order)
            cum = p_sorted.cumsum(dim=-1, dtype=torch.float64)
            above = F.pad(cum[:, :-1], (1, 0))  # mass of the tokens ranked strictly above
            top_p = torch.tensor([[st.top_p] for st in settings], dtype=torch.float64)
            active = torch.tensor([[st.top_p < 1.0] for st in settings])
            drop_sorted = (above >= top_p) & active
            s = s.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), _NEG_INF)

        if any(st.typical < 1.0 for st in settings):
            # HF TypicalLogitsWarper; the entropy is a cumsum's last entry (sum() is not row-invariant).
            logp = torch.log_softmax(s, dim=-1)
            p = logp.exp()
            plogp = torch.where(p > 0, logp * p, torch.zeros_like(p))
            entropy = -plogp.cumsum(dim=-1)[:, -1:]
            shifted = (-logp - entropy).abs()
            sorted_scores, order = shifted.sort(dim=-1, stable=True)
            cum = torch.softmax(s.gather(-1, order), dim=-1).cumsum(dim=-1)
            mass = torch.tensor([[st.typical] for st in settings], dtype=torch.float32)
            last = (cum < mass).sum(dim=-1, keepdim=True).clamp_(max=width - 1)
            drop_sorted = sorted_scores > sorted_scores.gather(-1, last)
            drop_sorted[:, 0] = False
            drop_sorted &= torch.tensor([[st.typical < 1.0] for st in settings])
            s = s.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), _NEG_INF)

        if any(st.min_p > 0.0 for st in settings):
            p = torch.softmax(s, dim=-1)
            min_p = torch.tensor([[st.min_p] for st in settings], dtype=torch.float32)
            s = s.masked_fill(p < min_p * p.amax(dim=-1, keepdim=True), _NEG_INF)

        final = torch.softmax(s, dim=-1)
        if probs is not None:
            dense = final if ids is None else torch.zeros(len(rows), self.vocab_size).scatter_(-1, ids, final)
            probs[rows] = dense
            return
        pos = _inverse_cdf(final, [reqs[i].state for i in rows])
        chosen = pos if ids is None else ids.gather(-1, pos.unsqueeze(-1)).squeeze(-1)
        for i, t in zip(rows, chosen.tolist(), strict=True):
            tokens[i] = t
        wanted = [j for j, i in enumerate(rows) if reqs[i].want_logprobs]
        for j in wanted:  # the drawn-from distribution, for the callers who asked
            i = rows[j]
            n_top = min(reqs[i].top_n, width)
            tv, ti = final[j].topk(n_top) if n_top else (final[j][:0], pos[:0])
            top_ids = (ti if ids is None else ids[j].gather(0, ti)).tolist()
            top = sorted(
                ((t, v) for t, v in zip(top_ids, tv.tolist(), strict=True) if v > 0),
                key=lambda a: (-a[1], a[0]),
            )
            finals[i] = (float(final[j, pos[j]]), tuple(top))

    def _logprobs(
        self,
        x: torch.Tensor,
        reqs: Sequence[SampleRequest],
        tokens: list[int],
        out: list[TokenLogprob | None],
        finals: dict[int, _Final],
    ) -> None:
        rows = [i for i, r in enumerate(reqs) if r.want_logprobs]
        if not rows:
            return
        xs = _take_rows(x, rows)
        temps = _temperatures(rows, reqs)
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
                (t, v) for t, v in zip(top_ids[j][:n_alt], top_vals[j][:n_alt], strict=True) if v != _NEG_INF
            ]
            alts.sort(key=lambda a: (-a[1], a[0]))
            final_prob, final_top = finals.get(i, (None, ()))
            out[i] = TokenLogprob(tokens[i], chosen[j], tuple(alts), final_prob, final_top)


_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)
_NEG_INF_BITS = -8388608  # 0xFF800000 as int32: float32 -inf


def _constrained(
    logits: torch.Tensor, requests: Sequence[SampleRequest], overwrite: bool = False
) -> torch.Tensor:
    """The logits with each grammar's disallowed tokens at -inf (a copy, or the input itself with
    `overwrite`: a copy of a 64-row batch costs more than the masks, ~1.7 ms per step).

    Applied first, like a ban: penalties, temperature and truncation then see only allowed tokens.
    """
    rows = [i for i, r in enumerate(requests) if r.allowed is not None]
    if not rows:
        return logits
    out = logits if overwrite else logits.clone()
    vocab = logits.shape[1]
    masks = torch.stack([m for r in requests if (m := r.allowed) is not None])
    bits = (masks.unsqueeze(-1) >> _BIT_SHIFTS) & 1
    # An additive mask built in integers: bit 1 -> 0x00000000 (+0.0), bit 0 -> 0xFF800000 (-inf).
    # x + 0.0 is x exactly, so one add per row does what masked_fill does, ~3x faster on the CPU
    # (W1 with 32 constrained jobs: 6.7 ms of every step went here).
    bias = ((bits - 1) & _NEG_INF_BITS).view(torch.float32).reshape(len(rows), -1)[:, :vocab]
    with torch.inference_mode(out.is_inference()):  # the forward's logits are inference tensors
        for j, i in enumerate(rows):
            out[i].add_(bias[j])
    return out


def _take_rows(x: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """x's rows (a copy), or x itself when that is all of them in order."""
    if len(rows) == x.shape[0] and all(i == j for i, j in enumerate(rows)):
        return x
    return x.index_select(0, torch.tensor(rows))


def _temperatures(rows: Sequence[int], reqs: Sequence[SampleRequest]) -> torch.Tensor:
    """Per-row temperature as a float32 [n, 1] column (1 for greedy rows), clamped into float32's
    normal range: a temperature that rounds to 0 or inf would turn s = (x - max) / T into NaN."""
    temps = [min(max(reqs[i].state.settings.temperature or 1.0, _F32_TINY), _F32_MAX) for i in rows]
    return torch.tensor(temps, dtype=torch.float32).unsqueeze(-1)


def _inverse_cdf(probs: torch.Tensor, states: Sequence[SamplerState]) -> torch.Tensor:
    """Per row: the first column whose float64 CDF exceeds u * total, u from that row's job."""
    u = torch.cat([torch.rand(1, generator=st.generator, dtype=torch.float32) for st in states])
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    target = u.to(torch.float64).unsqueeze(-1) * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=probs.shape[1] - 1)


def _rows_and_cols(rows: Sequence[int], cols: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([len(c) for c in cols])
    return torch.repeat_interleave(torch.tensor(rows), lengths), torch.cat(list(cols))


def _per_element(values: Sequence[float], cols: Sequence[torch.Tensor]) -> torch.Tensor:
    lengths = torch.tensor([len(c) for c in cols])
    return torch.repeat_interleave(torch.tensor(values, dtype=torch.float32), lengths)


def _penalize_bias_ban(
    x: torch.Tensor,
    rows: Sequence[int],
    states: Sequence[SamplerState],
    extra: Sequence[torch.Tensor | None],
    use_bias: bool = True,
    use_penalties: bool = True,
) -> None:
    """Steps 1-4, in place on x's given rows, touching only the listed token ids of each row."""
    penalized = list(zip(rows, states, strict=True)) if use_penalties else []
    rep = [(i, st) for i, st in penalized if st._track_seen and len(st._seen_ids)]
    if rep:
        cols = [st.seen_ids() for _, st in rep]
        r, c = _rows_and_cols([i for i, _ in rep], cols)
        pen = _per_element([st.settings.repetition_penalty for _, st in rep], cols)
        v = x[r, c]
        x[r, c] = torch.where(v < 0, v * pen, v / pen)

    out = [(i, st) for i, st in penalized if st._track_output and len(st._out_ids)]
    if out:
        pairs = [st.output_counts() for _, st in out]
        cols = [ids for ids, _ in pairs]
        r, c = _rows_and_cols([i for i, _ in out], cols)
        freq = _per_element([st.settings.frequency_penalty for _, st in out], cols)
        pres = _per_element([st.settings.presence_penalty for _, st in out], cols)
        counts = torch.cat([n for _, n in pairs])
        x[r, c] = x[r, c] - (counts * freq + pres)

    biased = [(i, st) for i, st in zip(rows, states, strict=True) if use_bias and st.bias_ids is not None]
    if biased:
        cols = [st.bias_ids for _, st in biased if st.bias_ids is not None]
        r, c = _rows_and_cols([i for i, _ in biased], cols)
        x[r, c] = x[r, c] + torch.cat([st.bias_values for _, st in biased])

    ban_rows: list[int] = []
    ban_cols: list[torch.Tensor] = []
    for i, st, e in zip(rows, states, extra, strict=True):
        for ids in (st.banned_ids, e):
            if ids is not None:
                ban_rows.append(i)
                ban_cols.append(ids)
    if ban_rows:
        r, c = _rows_and_cols(ban_rows, ban_cols)
        x[r, c] = _NEG_INF


def _fallback_row(raw: torch.Tensor, state: SamplerState, extra: torch.Tensor | None) -> torch.Tensor:
    """A row that steps 1-4 left without a finite maximum: clamp +inf, then drop, in turn, the engine's
    extra bans, the job's biases and its penalties. The job's own bans alone always leave a token
    (SamplingSettings.validate), so banned_token_ids are never sampled while the raw logits are finite."""
    for use_extra, use_bias, use_penalties in ((True, True, True), (False, True, True), (False, False, True)):
        row = raw.unsqueeze(0).clone()
        _penalize_bias_ban(row, [0], [state], [extra if use_extra else None], use_bias, use_penalties)
        row.clamp_(max=_F32_MAX)
        if bool(torch.isfinite(row.amax())):
            return row[0]
    row = raw.unsqueeze(0).clone()
    _penalize_bias_ban(row, [0], [state], [None], use_bias=False, use_penalties=False)
    row.clamp_(max=_F32_MAX)
    return row[0] if bool(torch.isfinite(row.amax())) else torch.zeros_like(raw)
