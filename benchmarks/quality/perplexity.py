"""`python -m benchmarks quality`: what each quantized mode costs in model quality.

For each linear plan: perplexity of the shipped model on English prose, and, teacher-forced,
the mean KL divergence from the float32 path (the file's weights dequantized) and top-1
agreement with it; and llama.cpp's same figures on the same file and text
(quality_llamacpp.py) where the peers' llama.cpp build exists. The text ships
with Python itself: the prose paragraphs of the standard library's `pydoc_data.topics`
(the language reference's explanations, code examples and grammar left out), cut into
windows scored one forward each. A mode passes the gate, and may be chosen by
`--quant auto`, when its perplexity is within 1% of the float path's. The int8 KV cache
(`--kv-cache int8`, float linears) is held to the same gate.

It also shows that int4 runs the file's own Q4_0/Q4_1 weights: the groups read from
the file equal the gguf package's dequantization bit for bit, and so do the weights
the int4 kernel multiplies by when it computes in float32.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from benchmarks.quality import llamacpp as quality_llamacpp
from engine.cache.kv_cache import KVCacheKind
from engine.forward_batch import ForwardBatch, SequenceInput
from engine.ids import PageId
from engine.model.gguf_source import GGUFSource
from engine.model.llama import LlamaModel
from engine.model.quantization import LinearPlan, QuantMode, plan_for
from engine.model.shipped_model import default_model_path
from engine.model.tokenizer import HFTokenizer
from kernels.cpu_features import cpu_features
from kernels.linear.int4_groups import Int4Groups
from kernels.linear.int4_linear import Int4Linear
from kernels.linear.make_linear import LinearKind

GATE = 0.01  # relative perplexity increase a mode may cost
WINDOW = 512  # tokens per scored window (the first of each is context only)
PAGE_SIZE = 64
TEXT_SOURCE = "pydoc_data.topics (CPython 3.11 stdlib), prose paragraphs"


def prose() -> str:
    """Paragraphs of running English text from the stdlib's pydoc topics, in topic order."""
    from pydoc_data.topics import topics

    keep: list[str] = []
    for name in sorted(topics):
        for para in re.split(r"\n\s*\n", topics[name]):
            lines = para.split("\n")
            text = " ".join(line.strip() for line in lines)
            # Prose: unindented, long, mostly letters and ends a sentence; code and grammar are indented.
            if any(line.startswith("   ") for line in lines) or len(text) < 200 or not text.endswith("."):
                continue
            if sum(c.isalpha() or c == " " for c in text) < 0.85 * len(text):
                continue
            keep.append(text)
    return "\n\n".join(dict.fromkeys(keep))  # some topics repeat paragraphs


@dataclass
class Score:
    """One plan's running totals over the scored tokens."""

    nll_sum: float = 0.0
    kld_sum: float = 0.0  # KL(float path || this plan) per token, summed
    agree: int = 0  # tokens whose argmax equals the float path's
    tokens: int = 0
    # The same over each window's second half only: llama-perplexity's protocol (every scored
    # token has at least half a window of context), for its row.
    late_kld_sum: float = 0.0
    late_agree: int = 0
    late_tokens: int = 0

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.tokens)

    @property
    def kld(self) -> float:
        return self.kld_sum / self.tokens

    @property
    def top1(self) -> float:
        return self.agree / self.tokens

    @property
    def late(self) -> str:
        """KLD and top-1 over second halves, as a table cell."""
        return f"{self.late_kld_sum / self.late_tokens:.4f}, {self.late_agree / self.late_tokens * 100:.1f}%"


def windows(ids: list[int], tokens: int) -> Iterator[list[int]]:
    for start in range(0, tokens, WINDOW):
        yield ids[start : start + WINDOW]


class Scorer:
    """One plan's model and cache, scoring a window at a time (every plan sees each window in
    turn, so its log-probabilities meet the float path's without keeping all of them)."""

    def __init__(self, model: LlamaModel, kv: KVCacheKind = KVCacheKind.FLOAT) -> None:
        self.model = model
        self.cache = model.new_cache(num_pages=WINDOW // PAGE_SIZE, page_size=PAGE_SIZE, kind=kv)
        self.score = Score()
        self.seconds = 0.0

    def log_probs(self, window: list[int]) -> torch.Tensor:
        """[len(window) - 1, vocab]: position i's log-probabilities of token i + 1."""
        t0 = time.perf_counter()
        table = [PageId(p) for p in range(WINDOW // PAGE_SIZE)]
        seq = SequenceInput(window, 0, table, logit_positions=len(window))
        batch = ForwardBatch.build([seq], PAGE_SIZE, self.model.device)
        out = torch.log_softmax(self.model.forward(batch, self.cache)[:-1].float(), dim=-1)
        self.seconds += time.perf_counter() - t0
        return out

    def add(self, window: list[int], mine: torch.Tensor, reference: torch.Tensor) -> None:
        target = torch.tensor(window[1:])
        s = self.score
        s.nll_sum -= float(mine.gather(1, target[:, None]).sum())
        kld = (reference.exp() * (reference - mine)).sum(-1)
        same = mine.argmax(-1) == reference.argmax(-1)
        s.kld_sum += float(kld.sum())
        s.agree += int(same.sum())
        s.tokens += len(window) - 1
        half = (
            WINDOW // 2
        )  # as llama-perplexity: the rows from the window's middle on (row i predicts token i + 1)
        s.late_kld_sum += float(kld[half:].sum())
        s.late_agree += int(same[half:].sum())
        s.late_tokens += max(0, len(window) - 1 - half)


def exactness(source: GGUFSource, tensors: dict[str, torch.Tensor], stored: dict[str, Int4Groups]) -> str:
    same = sum(torch.equal(g.dequantize(), tensors[n]) for n, g in stored.items())
    layer0 = [n for n in stored if n.startswith("model.layers.0.")]
    kernel_same = 0
    worst_bf16 = 0.0
    for name in layer0:
        g = stored[name]
        exact = Int4Linear(g, compute_dtype=torch.float32)
        kernel_same += torch.equal(exact(torch.eye(g.shape[1])).t(), tensors[name])
        # The bfloat16 path's weights: scale and zero rounded to bfloat16.
        fast = Int4Linear(g)
        sz = fast.scale_zero.to(torch.float32)[:, : g.shape[0]].transpose(0, 1)  # [out, groups, 2]
        q = g.q.view(g.shape[0], -1, 32).to(torch.float32)
        w = ((q - 8) * sz[..., 0:1] + sz[..., 1:2]).view(g.shape)
        ref = tensors[name]
        worst_bf16 = max(worst_bf16, float((w - ref).norm() / ref.norm()))
    return (
        f"int4 exactness: groups read from the file equal its dequantized weights for {same}/{len(stored)} "
        f"Q4 tensors (bit for bit); the int4 kernel computing in float32 reproduces them bit for bit for "
        f"{kernel_same}/{len(layer0)} tensors of layer 0 (an identity activation); the default bfloat16 "
        f"path rounds scale and zero to bfloat16: weight relative RMS error {worst_bf16:.2e}."
    )


def run(tokens: int = 10 * 1024, auto: bool = True) -> str:
    path = default_model_path()
    source = GGUFSource(path)
    tensors = dict(source.tensors())
    stored = {n: g for n, t in tensors.items() if t.dim() == 2 and (g := source.stored_int4(n)) is not None}
    tokenizer = HFTokenizer(path, extra_eos=source.config.eos_token_ids)
    ids = tokenizer.encode(prose())
    if len(ids) < tokens:
        raise RuntimeError(f"the prose has only {len(ids)} tokens, fewer than {tokens}")
    cpu = cpu_features()
    i4 = LinearKind.INT4
    i8d = LinearKind.INT8_DYNAMIC
    float_kv, half_kv, int8_kv = KVCacheKind.FLOAT, KVCacheKind.FLOAT16, KVCacheKind.INT8
    bf16_kv = KVCacheKind.BFLOAT16
    plans: list[tuple[str, LinearPlan, KVCacheKind]] = [
        (f"--quant {m.value}", plan_for(m, cpu), float_kv)
        for m in (QuantMode.NONE, QuantMode.INT8, QuantMode.INT4)
    ]
    plans.insert(1, ("--kv-cache int8", plan_for(QuantMode.NONE, cpu), int8_kv))
    plans.insert(1, ("--kv-cache bfloat16", plan_for(QuantMode.NONE, cpu), bf16_kv))
    plans.insert(1, ("--kv-cache float16", plan_for(QuantMode.NONE, cpu), half_kv))
    plans += [
        ("dynamic int8 (fbgemm), all", LinearPlan.uniform(i8d), float_kv),
        ("int4 body, dynamic int8 head", LinearPlan(i4, i4, i4, i4, i8d), float_kv),
        ("int4 everywhere (head re-quantized)", LinearPlan.uniform(i4), float_kv),
    ]
    if auto:
        # The autotune picks by rows per call; these windows run in its 64-row bucket.
        plans.append(("--quant auto --kv-cache float", plan_for(QuantMode.AUTO, cpu), float_kv))
        plans.append(("--quant auto --kv-cache float16", plan_for(QuantMode.AUTO, cpu), half_kv))
        plans.append(("--quant auto --kv-cache bfloat16", plan_for(QuantMode.AUTO, cpu), bf16_kv))
        plans.append(("--quant auto --kv-cache int8", plan_for(QuantMode.AUTO, cpu), int8_kv))
    lines = [
        f"### Quality per linear plan: {tokens} tokens of {TEXT_SOURCE}, windows of {WINDOW}",
        "",
        f"CPU: {cpu.summary()}",
        "",
        "| plan | linears | perplexity | vs float | mean KL divergence | top-1 agreement "
        "| KLD, top-1 over second halves | gate (<= +1%) | seconds |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    scorers = [
        (label, Scorer(LlamaModel(source.config, tensors, plan=plan, stored_int4=stored), kv), kv)
        for label, plan, kv in plans
    ]
    for window in windows(ids, tokens):
        reference = scorers[0][1].log_probs(window)  # the float path, first in `plans`
        for _, scorer, _ in scorers:
            mine = reference if scorer is scorers[0][1] else scorer.log_probs(window)
            scorer.add(window, mine, reference)
    base = scorers[0][1].score.perplexity
    for label, scorer, kv in scorers:
        s = scorer.score
        rel = s.perplexity / base - 1
        gate = "pass" if rel <= GATE else "FAIL"
        what = scorer.model.describe() + ("" if kv is float_kv else f"; kv cache {kv.value}")
        lines.append(
            f"| {label} | {what} | {s.perplexity:.3f} | {rel * 100:+.2f}% | {s.kld:.4f} | {s.top1 * 100:.1f}% "
            f"| {s.late} | {gate} | {scorer.seconds:.0f} |"
        )
    lines.append(quality_llamacpp.row(path, prose(), tokens))
    lines += ["", exactness(source, tensors, stored)]
    return "\n".join(lines)
