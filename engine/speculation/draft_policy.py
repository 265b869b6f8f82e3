"""How many draft tokens each speculating job verifies in the next step: adaptive, per job.

Two measured things decide it:

- **Each job's acceptance.** A draft token is kept only if every draft token before it was, so
  a job whose drafts are kept with probability p per token gets its i-th draft token with
  probability p**i. p is estimated from the job's own verifications as kept / tried, where a
  verification that kept m of d drafts counts m successes and, when m < d, one failure; older
  verifications fade (`FADE` per verification). A long run of kept drafts raises p at once and one
  rejection lowers it by a single trial, so p rises fast and falls slowly. A new job starts from
  the acceptance of every job so far (`prior`).
- **The step's cost against its rows and its keys** (`StepCost`): a table of seconds against rows,
  measured on this machine at warm-up on short sequences, at a server's first start and kept for
  later ones (`step_cost_store`; on a 2-core CPU one row costs about as much as the weights' read
  up to a few rows, and each row past that adds about its share of a full step), plus seconds per
  cached key the step's sequences read. A draft row adds a row but
  no keys: it reads its sequence's K/V, which the sequence's own row reads anyway. At 24
  sequences of 500 tokens (Intel AMX part, int8 cache) 16 draft rows added 0.44 ms each and 16
  more sequences 0.89 ms each; a table of rows alone, its points learnt from steps whose
  contexts grew, priced a row past 24 at 2 ms and let no draft through. Every later decode
  step's time moves both toward what steps cost now (`observe`: the error split between the
  keys' term and the table by their shares of the prediction, the table's part shared by the
  two row counts around it, `OBSERVE_RATE` of it), so a start on a busy machine and the
  memory's real rate are corrected by the steps themselves.

A drafter may also say, per draft token, which class of evidence it has for it (the n-gram
drafter: how many earlier places continued the matched n-gram and how many of them agree up to
that token). Once drafted, a draft is verified only as far as its tokens pay (`trim`): token i's
chance is the product of its class's kept rate and those of the tokens before it, each class's
rate learned from verifications like a job's (`CLASS_FADE`), and a class a trim passes over drifts
toward the prior (`RELAX`), so that it is tried again. The job's budget stays the upper bound.

Draft tokens are then handed out one at a time, each to the job whose next draft token is the
most likely to be kept, while it raises the step's expected tokens per second: the step makes n
tokens (one per decoding job) plus the expected kept drafts, in the time of its rows, up to
`max_draft_tokens` a job and, where other streams share the step, `step_draft_tokens` over it (so
drafts lengthen no other stream's step by more than that many rows, whatever the table says a row
costs; a job decoding alone delays only itself). At batch 1
a draft kept with p = 0.3 pays; at batch 64 on 2 cores even a near-certain one barely does, so
speculation switches itself off under load with no setting. A job whose drafts stop paying
drafts nothing; its estimate drifts back toward the prior while it does not draft (`RELAX` per
step it could have), so it is probed again now and then. When not even a certain draft token
would pay for its row (a full batch), a step costs no per-job work at all. Every `PROBE_EVERY`
steps the likeliest job verifies one draft token more than it pays for: a table that overstates
what a larger step costs would otherwise never see a step that shows it wrong.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from engine.jobs import JobId

FADE = 0.7  # weight of a job's earlier verifications at each new one
PRIOR_FADE = 0.98  # the same for the acceptance of all jobs (the prior a new job starts from)
PRIOR_WEIGHT = 2.0  # trials the prior counts as in a new job's estimate
RELAX = 0.02  # share of the way back to the prior a job's estimate goes per step without drafts
INITIAL_PRIOR = 0.5
OBSERVE_RATE = 0.05  # share of a decode step's timing error its neighbouring table points take
PROBE_EVERY = 64  # steps between two probes (a draft token more than pays, for the likeliest job)
PROBE_RATE = 0.5  # OBSERVE_RATE for a probe's step: its row count is rarely run otherwise
OUTLIER = 0.5  # the most a step's timing error counts for, as a share of its prediction
# The rate decode attention reads a cached key's K/V (every layer's, scales included) at first,
# before steps correct it: ~12 GB/s for an int8 cache's scattered 4 KiB runs on the 2-core Intel
# AMX part (docs/ARCHITECTURE.md, Serving benchmark).
KV_READ_BYTES_PER_SECOND = 12e9
CLASS_FADE = 0.99  # weight of an evidence class's earlier verified tokens at each new one


@dataclass(frozen=True)
class StepCost:
    """Seconds of one step against the rows it carries (from steps timed at warm-up: linear
    between measured row counts, the last segment's slope past the largest) and the cached keys
    its sequences read (`per_key` each: a sequence's rows read its keys once)."""

    rows: tuple[int, ...]  # ascending, distinct, >= 1
    seconds: tuple[float, ...]
    per_key: float = 0.0  # seconds per cached key read (summed over the step's sequences)

    def __post_init__(self) -> None:
        if (
            len(self.rows) < 2
            or len(self.rows) != len(self.seconds)
            or list(self.rows) != sorted(set(self.rows))
        ):
            raise ValueError(f"StepCost needs >= 2 ascending row counts with a time each, got {self.rows}")
        if not self.per_key >= 0.0:
            raise ValueError(f"StepCost's seconds per key must be >= 0, got {self.per_key}")

    def at(self, rows: int, keys: int = 0) -> float:
        """Seconds of a step of `rows` rows whose sequences read `keys` cached keys in all."""
        r, s = self.rows, self.seconds
        i = min(max(bisect.bisect_left(r, rows), 1), len(r) - 1)
        slope = max((s[i] - s[i - 1]) / (r[i] - r[i - 1]), 0.0)
        return max(s[i - 1] + slope * (rows - r[i - 1]), 1e-6) + self.per_key * keys

    def observed(self, rows: int, seconds: float, rate: float = OBSERVE_RATE, keys: int = 0) -> StepCost:
        """The cost after a step of `rows` rows and `keys` keys took `seconds`: `rate` of the
        prediction's error, split between the keys' term and the table by their shares of the
        prediction; the table's part goes to the two row counts around `rows` in proportion to
        their weight in it (one step of least squares on the interpolation), the times kept
        non-decreasing."""
        r, s = self.rows, list(self.seconds)
        # A step the OS or a garbage collection held up (108 ms for a 6-row step predicted at
        # 5) moves the table no more than one OUTLIER of its prediction off would: unclipped, that
        # one step raised the 4- and 8-row points by 2.5 ms and kept those sizes unrun, and so
        # uncorrected, for the rest of the run.
        predicted = self.at(rows, keys)
        error = min(max(seconds - predicted, -OUTLIER * predicted), OUTLIER * predicted)
        # A uniformly slower machine scales both terms alike; a keys' rate that is off shows as
        # errors that grow with the keys, which the keys' share then takes.
        key_share = self.per_key * keys / predicted
        per_key = max(self.per_key + rate * error * key_share / keys, 0.0) if keys > 0 else self.per_key
        error *= 1.0 - key_share
        if rows <= r[0]:
            shares = [(0, 1.0)]
        elif rows >= r[-1]:
            shares = [(len(r) - 1, 1.0)]
        else:
            i = bisect.bisect_left(r, rows)
            w = (rows - r[i - 1]) / (r[i] - r[i - 1])
            shares = [(i - 1, 1.0 - w), (i, w)]
        for j, share in shares:
            s[j] = max(s[j] + rate * share * error, 1e-6)
        # Non-decreasing again, trusting the points just moved: a step cheaper than a smaller
        # row count's entry pulls that entry down, a dearer one pushes the larger ones up.
        low = shares[0][0]
        for j in range(low - 1, -1, -1):
            s[j] = min(s[j], s[j + 1])
        for j in range(low + 1, len(s)):
            s[j] = max(s[j], s[j - 1])
        return StepCost(r, tuple(s), per_key)


@dataclass
class _Acceptance:
    kept: float
    tried: float
    idle: bool = False  # asked for a budget since its last verification

    @property
    def p(self) -> float:
        return self.kept / self.tried if self.tried > 0 else 0.0

    def add(self, kept: float, tried: float, fade: float) -> None:
        """A new observation of `tried` trials, `kept` of them kept; earlier ones weigh `fade`."""
        self.kept = self.kept * fade + kept
        self.tried = self.tried * fade + tried

    def relax(self, prior: float) -> None:
        """RELAX of the way back toward `prior`, the trials' weight kept."""
        self.kept += (prior * self.tried - self.kept) * RELAX


@dataclass(frozen=True)
class DraftWant:
    """A decoding job that may speculate, and at most how many draft tokens it can use."""

    job_id: JobId
    most: int


class DraftPolicy:
    def __init__(self, cost: StepCost, max_draft_tokens: int, step_draft_tokens: int) -> None:
        self.cost = cost
        self.max_draft_tokens = max_draft_tokens  # per job
        self.step_draft_tokens = step_draft_tokens  # over all jobs of a step
        self._jobs: dict[JobId, _Acceptance] = {}
        self._prior = _Acceptance(INITIAL_PRIOR * PRIOR_WEIGHT, PRIOR_WEIGHT)
        self._probe_in = PROBE_EVERY  # steps until the next probe
        self._probing = False  # the last budgets asked for a probe
        self._classes: dict[int, _Acceptance] = {}  # evidence class -> its tokens' kept rate

    def observe(self, rows: int, seconds: float, keys: int = 0) -> None:
        """A decode step (no prompt tokens) of `rows` rows, drafts included, whose sequences read
        `keys` cached keys, took `seconds`."""
        self.cost = self.cost.observed(rows, seconds, PROBE_RATE if self._probing else OBSERVE_RATE, keys)
        self._probing = False

    @property
    def prior(self) -> float:
        return self._prior.p

    def acceptance(self, job_id: JobId) -> float:
        a = self._jobs.get(job_id)
        return self.prior if a is None else a.p

    def budgets(self, wants: Sequence[DraftWant], rows: int, keys: int = 0) -> dict[JobId, int]:
        """Draft tokens per job for a step of `rows` rows before drafts (the running jobs' rows)
        whose sequences read `keys` cached keys (drafts add rows, not keys)."""
        out = {w.job_id: 0 for w in wants}
        if not wants:
            return out
        base = max(rows, 1)
        tokens, seconds = float(base), self.cost.at(base, keys)
        if (tokens + 1) / self.cost.at(base + 1, keys) <= tokens / seconds:
            # Not even a certain draft token pays for its row (a full batch): no per-job work.
            return self._probe(wants, out, rows)
        p = {w.job_id: self._relaxed(w.job_id) for w in wants}
        most = {w.job_id: min(w.most, self.max_draft_tokens) for w in wants}
        # The next draft token of each job, most likely to be kept first (a heap of -probability).
        heap = [(-p[w.job_id], w.job_id) for w in wants if most[w.job_id] > 0 and p[w.job_id] > 0]
        heapq.heapify(heap)
        added, bound = 0, self._step_bound(rows)
        while heap and added < bound:
            neg_q, job_id = heapq.heappop(heap)
            q = -neg_q
            more = self.cost.at(base + added + 1, keys)
            if (tokens + q) / more <= tokens / seconds:
                break  # the likeliest draft token left does not pay for its row: none after it does
            tokens, seconds, added = tokens + q, more, added + 1
            out[job_id] += 1
            if out[job_id] < most[job_id]:
                heapq.heappush(heap, (-q * p[job_id], job_id))
        return self._probe(wants, out, rows)

    def trim(self, evidence: Sequence[int], rows: int, keys: int = 0) -> int:
        """How many leading tokens of a draft whose tokens have these evidence classes are worth
        verifying in a step of `rows` rows without them (each row a token of its own) and `keys`
        keys: the length that makes the step's expected tokens per second highest."""
        base = max(rows, 1)
        tokens = float(base)
        best, best_rate = 0, tokens / self.cost.at(base, keys)
        chance = 1.0
        for i, c in enumerate(evidence):
            chance *= self._class_rate(c)
            tokens += chance
            rate = tokens / self.cost.at(base + i + 1, keys)
            if rate > best_rate:
                best, best_rate = i + 1, rate
        for c in evidence[best : best + 1]:  # the class that stopped it: back toward the prior
            a = self._classes.get(c)
            if a is not None:
                a.relax(self.prior)
        return best

    def _class_rate(self, c: int) -> float:
        a = self._classes.get(c)
        return self.prior if a is None else a.p

    def _step_bound(self, rows: int) -> int:
        """The most draft tokens a step of `rows` rows before drafts verifies: the step's bound
        protects the other running streams' next tokens; a job decoding alone (one row) delays no
        one but itself, and may use its per-job most."""
        return self.max_draft_tokens if rows <= 1 else self.step_draft_tokens

    def _probe(self, wants: Sequence[DraftWant], out: dict[JobId, int], rows: int) -> dict[JobId, int]:
        """`out`, or, every PROBE_EVERY steps, `out` with one more draft token for the likeliest
        job that can use it: the step's time then tells the table what one more row costs, which
        a table that overstates it would otherwise never learn (its rows are never run)."""
        self._probe_in -= 1
        if self._probe_in > 0:
            return out
        self._probe_in = PROBE_EVERY
        able = [w for w in wants if out[w.job_id] < min(w.most, self.max_draft_tokens)]
        if able and sum(out.values()) < self._step_bound(rows):
            out[max(able, key=lambda w: self.acceptance(w.job_id)).job_id] += 1
            self._probing = True
        return out

    def _relaxed(self, job_id: JobId) -> float:
        """The job's estimate, drifted RELAX of the way toward the prior if it did not draft since
        it was last asked."""
        a = self._jobs.get(job_id)
        if a is None:
            return self.prior
        if a.idle:
            a.relax(self.prior)
        a.idle = True  # until `verified` says it drafted
        return a.p

    def verified(self, job_id: JobId, drafted: int, kept: int, evidence: Sequence[int] = ()) -> None:
        """A verification of `drafted` draft tokens of which the first `kept` were kept (their
        evidence classes, if the drafter gave them)."""
        if drafted <= 0:
            return
        # Each token verified after kept ones was kept or not on its own evidence.
        for i, c in enumerate(evidence[: min(drafted, kept + 1)]):
            if c not in self._classes:
                self._classes[c] = self._from_prior()
            self._classes[c].add(float(i < kept), 1.0, CLASS_FADE)
        tried = kept + (1 if kept < drafted else 0)
        a = self._jobs.get(job_id)
        if a is None:
            a = self._jobs[job_id] = self._from_prior()
        a.add(kept, tried, FADE)
        a.idle = False
        self._prior.add(kept, tried, PRIOR_FADE)

    def _from_prior(self) -> _Acceptance:
        """A new estimate: the acceptance of all jobs so far, counted as PRIOR_WEIGHT trials."""
        return _Acceptance(self.prior * PRIOR_WEIGHT, PRIOR_WEIGHT)

    def forget(self, job_id: JobId) -> None:
        self._jobs.pop(job_id, None)

    def tracked_jobs(self) -> int:
        return len(self._jobs)
