"""Per-token probabilities after every truncating filter (final_prob / final_top), beside the
log-probabilities before them, computed from the logits by hand."""

from __future__ import annotations

import math

import pytest
import torch

from engine.jobs import SamplingSettings
from engine.sampling.sampler import Sampler, SampleRequest, SamplerMode, SamplerState

V = 300


@pytest.fixture(params=[SamplerMode.BATCHED, SamplerMode.THREADED])
def sampler(request: pytest.FixtureRequest) -> Sampler:
    return Sampler(V, num_threads=2, mode=request.param)


def _request(settings: SamplingSettings, top_n: int = 5) -> SampleRequest:
    return SampleRequest(SamplerState(settings, (1, 2), V), want_logprobs=True, top_n=top_n)


def test_top_k_final_probs_are_the_renormalised_top_k(sampler: Sampler) -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1)) * 3
    reqs = [_request(SamplingSettings(temperature=0.7, top_k=4, seed=s), top_n=6) for s in range(3)]
    results = sampler.sample(logits, reqs)
    for row, r in zip(logits, results, strict=True):
        lp = r.logprob
        assert lp is not None and lp.final_prob is not None
        top = torch.softmax(row / 0.7, -1).topk(4)
        renorm = top.values / top.values.sum()
        want = dict(zip(top.indices.tolist(), renorm.tolist(), strict=True))
        assert lp.final_prob == pytest.approx(want[r.token_id], rel=1e-5)
        assert [t for t, _ in lp.final_top] == top.indices.tolist()  # only 4 survive, most likely first
        assert sum(p for _, p in lp.final_top) == pytest.approx(1.0, rel=1e-5)
        # Before the filter: the plain tempered log-softmax.
        assert lp.logprob == pytest.approx(float(torch.log_softmax(row / 0.7, -1)[r.token_id]), abs=1e-5)


def test_top_p_and_min_p_truncate_the_final_distribution(sampler: Sampler) -> None:
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(2)) * 4
    reqs = [
        _request(SamplingSettings(temperature=1.0, top_p=0.5, seed=7), top_n=V),
        _request(SamplingSettings(temperature=1.0, min_p=0.2, seed=8), top_n=V),
    ]
    for row, r, keep in zip(logits, sampler.sample(logits, reqs), ("top_p", "min_p"), strict=True):
        lp = r.logprob
        assert lp is not None and lp.final_prob is not None
        p = torch.softmax(row, -1)
        if keep == "top_p":
            sp, order = p.sort(descending=True)
            n = int((sp.cumsum(0) - sp < 0.5).sum())
            kept = order[:n]
        else:
            kept = (p >= 0.2 * p.max()).nonzero().flatten()
        assert sorted(t for t, _ in lp.final_top) == sorted(kept.tolist())
        assert lp.final_prob == pytest.approx(float(p[r.token_id] / p[kept].sum()), rel=1e-4)
        assert math.isclose(sum(v for _, v in lp.final_top), 1.0, rel_tol=1e-4)


def test_greedy_final_prob_is_one(sampler: Sampler) -> None:
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(3))
    (r,) = sampler.sample(logits, [_request(SamplingSettings(), top_n=2)])
    assert r.logprob is not None and r.logprob.final_prob == 1.0
    assert r.logprob.final_top == ((r.token_id, 1.0),)
    (r0,) = sampler.sample(logits, [_request(SamplingSettings(), top_n=0)])
    assert r0.logprob is not None and r0.logprob.final_top == ()
