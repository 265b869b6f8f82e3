"""The sampler's passes over whole rows: the inverse-CDF draw, top_p's cut and the nucleus's candidates.

The native kernels where they are built, torch elsewhere. The draw and the cut give the same
answer either way (both rank stably and add a row's values in order in float64). The candidate
set is the sampler's to check: torch has no single op for "the largest values holding top_p of
the mass", so without the native kernel the sampler takes its fixed number of best tokens (topk)
instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kernels.native.native_library import native_library


def inverse_cdf(probs: torch.Tensor, uniforms: Sequence[float]) -> torch.Tensor:
    """int64 [rows]: per row of probs (float32 [rows, w], >= 0), the first column whose float64
    running sum exceeds the row's uniform times its total (w - 1 if none does)."""
    u = torch.tensor(uniforms, dtype=torch.float32)
    lib = native_library()
    if lib is not None and probs.dtype == torch.float32 and probs.dim() == 2 and probs.shape[1] > 0:
        return lib.inverse_cdf(probs.contiguous(), u)
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    target = u.to(torch.float64).unsqueeze(-1) * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=probs.shape[1] - 1)


def top_mass(
    probs: torch.Tensor, top_p: Sequence[float], cap: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per row of probs (float32 [rows, n]): the ids of a set of the row's largest values (every
    value at or above an edge) that holds at least its top_p of the mass, in increasing id order,
    as int64 [rows, width] whose first count[row] entries are the set and the rest distinct ids
    outside it; count is -1 where the set would pass `cap` tokens. None without the native kernel."""
    lib = native_library()
    if lib is None or probs.dtype != torch.float32 or probs.dim() != 2 or not 0 < cap <= probs.shape[1]:
        return None
    ids, count = lib.top_mass(probs.contiguous(), torch.tensor(top_p, dtype=torch.float64), cap)
    width = max(1, int(count.max()))
    return ids[:, :width], count


def top_p_(s: torch.Tensor, p: torch.Tensor, top_p: Sequence[float]) -> None:
    """In place on s (float32 [rows, n]; p = softmax(s)): per row whose top_p is < 1, the tokens
    ranked (by s, descending, ties by lower id) after the mass above them reaches top_p get -inf."""
    cut = torch.tensor([t if t < 1.0 else math.inf for t in top_p], dtype=torch.float64)
    lib = native_library()
    if lib is not None and s.dtype == torch.float32 and p.dtype == torch.float32 and s.is_contiguous():
        lib.top_p_rows_(s, p.contiguous(), cut)
        return
    order = s.sort(dim=-1, descending=True, stable=True).indices
    cum = p.gather(-1, order).cumsum(dim=-1, dtype=torch.float64)
    above = F.pad(cum[:, :-1], (1, 0))  # mass of the tokens ranked strictly above
    drop_sorted = above >= cut.unsqueeze(-1)
    s.masked_fill_(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))
