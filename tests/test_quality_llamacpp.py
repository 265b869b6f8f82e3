"""The quality benchmark reads llama-perplexity's KL-divergence summary (benchmarks/quality/llamacpp.py)."""

from __future__ import annotations

import pytest

from benchmarks.peers.process import PeerError
from benchmarks.quality.llamacpp import parse

SUMMARY = """
chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p
====== Perplexity statistics ======
Mean PPL(Q)                   :  14.406114 ±   0.536033
Mean PPL(base)                :  14.388270 ±   0.535631
Cor(ln(PPL(Q)), ln(PPL(base))):  99.95%
Mean ln(PPL(Q)/PPL(base))     :   0.001239 ±   0.001123
Mean PPL(Q)/PPL(base)         :   1.001240 ±   0.001125
Mean PPL(Q)-PPL(base)         :   0.017844 ±   0.016174

====== KL divergence statistics ======
Mean    KLD:   0.002857 ±   0.000035
Maximum KLD:   0.409001
====== Token probability statistics ======
Same top p: 96.627 ± 0.253 %
"""


def test_the_summary_figures_are_read() -> None:
    q = parse(SUMMARY)
    assert (q.ppl, q.ppl_ratio, q.kld) == (14.406114, 1.00124, 0.002857)
    assert abs(q.top1 - 0.96627) < 1e-9


def test_a_summary_without_them_is_an_error() -> None:
    with pytest.raises(PeerError, match="KLD"):
        parse(SUMMARY.replace("Mean    KLD", "Median  KLD"))
