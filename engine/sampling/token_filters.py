"""Steps 5-9 of the sampler's order (see engine/sampling/sampler.py) and the draw: temperature, top_k ties,
top_p, min_p and typical on one group of rows' candidate logits, then one inverse-CDF draw per
row with its job's uniform for the position (SampleRequest.uniform)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling.sample_request import SampleRequest
from engine.sampling.sampler_state import NEG_INF
from kernels.native.draw import inverse_cdf, top_p_

_F32_MAX = torch.finfo(torch.float32).max
_F32_TINY = torch.finfo(torch.float32).tiny

FinalProb = tuple[
    float, tuple[tuple[int, float], ...]
]  # the chosen token's final probability, top after filters


def filter_and_draw(
    vals: torch.Tensor,
    ids: torch.Tensor | None,
    nucleus_probs: torch.Tensor | None,
    rows: list[int],
    reqs: Sequence[SampleRequest],
    tokens: list[int],
    probs: torch.Tensor | None,
    finals: dict[int, FinalProb],
    vocab_size: int,
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
    temps = temperatures(rows, reqs)
    s = (vals - vals.amax(dim=-1, keepdim=True)) / temps

    if any(st.top_p < 1.0 for st in settings):
        p = nucleus_probs if nucleus_probs is not None else torch.softmax(s, dim=-1)
        top_p_(s, p, [st.top_p for st in settings])  # s is this function's own tensor

    if any(st.min_p > 0.0 for st in settings):
        p = torch.softmax(s, dim=-1)
        min_p = torch.tensor([[st.min_p] for st in settings], dtype=torch.float32)
        s = s.masked_fill(p < min_p * p.amax(dim=-1, keepdim=True), NEG_INF)

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
        s = s.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), NEG_INF)

    final = torch.softmax(s, dim=-1)
    if probs is not None:
        dense = final if ids is None else torch.zeros(len(rows), vocab_size).scatter_(-1, ids, final)
        probs[rows] = dense
        return
    pos = inverse_cdf(final, [reqs[i].uniform() for i in rows])
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


def take_rows(x: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """x's rows (a copy), or x itself when that is all of them in order."""
    if len(rows) == x.shape[0] and all(i == j for i, j in enumerate(rows)):
        return x
    return x.index_select(0, torch.tensor(rows))


def temperatures(rows: Sequence[int], reqs: Sequence[SampleRequest]) -> torch.Tensor:
    """Per-row temperature as a float32 [n, 1] column (1 for greedy rows), clamped into float32's
    normal range: a temperature that rounds to 0 or inf would turn s = (x - max) / T into NaN."""
    temps = [min(max(reqs[i].state.settings.temperature or 1.0, _F32_TINY), _F32_MAX) for i in rows]
    return torch.tensor(temps, dtype=torch.float32).unsqueeze(-1)
