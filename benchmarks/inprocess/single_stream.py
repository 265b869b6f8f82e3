"""Single-stream decode speed: dyngen's paged forward vs transformers `generate`, same weights.

Both are timed the same way: wall time to generate N+1 tokens minus wall time to
generate 1 token (the prefill and first token), over N. Greedy, EOS ignored.

`python -m benchmarks quant` times the quantized linears instead: matmul milliseconds
per decode step for each linear kind at 1, 8 and 64 rows, and dyngen's decode speed
for each --quant mode, with the CPU's feature line.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, assert_never

import torch

from benchmarks.inprocess.throughput import OneJob
from benchmarks.table import Row, render
from benchmarks.workloads import load_workloads
from engine.model.gguf_source import GGUFSource
from engine.model.llama import LlamaModel
from engine.model.loader import WeightDtype, load_model
from engine.model.quantization import LinearPlan, QuantMode
from engine.model.shipped_model import default_model_path
from engine.model.tokenizer import ChatMessage
from kernels.cpu_features import cpu_features
from kernels.linear.int4_groups import Int4Groups
from kernels.linear.make_linear import Linear, LinearKind
from kernels.native.native_library import PeakRates, native_library


def decode_rate(run: Callable[[int], None], new_tokens: int) -> float:
    run(2)  # warm-up
    t0 = time.perf_counter()
    run(1)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    run(new_tokens + 1)
    total = time.perf_counter() - t0
    return new_tokens / (total - first)


def run(new_tokens: int = 128, workloads: Path | None = None) -> str:
    user = load_workloads(workloads)["W1"]["user_messages"][0]
    path = default_model_path()
    rows: list[Row] = []
    for dtype in (WeightDtype.FLOAT32, WeightDtype.BFLOAT16):
        loaded = load_model(path, dtype, progress=False)
        prompt = loaded.tokenizer.encode_chat([ChatMessage("user", user)])
        ours = OneJob(loaded, prompt)
        rows.append(Row("dyngen", dtype.value, decode_rate(ours, new_tokens), "transformers"))
        ours.close()
        del loaded, ours

        import transformers

        # from_pretrained returns the model in eval mode.
        ref: Any = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype.torch
        )
        ids = torch.tensor([prompt])

        def theirs(n: int, ref: Any = ref, ids: torch.Tensor = ids) -> None:
            with torch.inference_mode():
                ref.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=2,
                )

        rows.append(Row("transformers", dtype.value, decode_rate(theirs, new_tokens), ""))
        del ref
    title = f"Single-stream decode, SmolLM2-135M Q4_1 GGUF dequantized, {new_tokens} tokens, {torch.get_num_threads()} threads"
    return render(title, "tok/s", rows)


# --- quantized linears: per-step matmul time per kind, and decode speed per --quant mode ---

MATMUL_ROWS = (1, 8, 64)


def _step_linears(
    kind: LinearKind, tensors: dict[str, torch.Tensor], stored: dict[str, Int4Groups]
) -> list[Linear]:
    """One decode step's linears of the shipped model (30 layers' QKV, O, gate/up, down, and the head)."""
    config = GGUFSource(default_model_path()).config
    model = LlamaModel(config, tensors, plan=LinearPlan.uniform(kind), stored_int4=stored)
    out: list[Linear] = []
    for layer in model.layers:
        out += [layer.qkv, layer.o, layer.gate_up, layer.down]
    return [*out, model.lm_head]


def _time_step(linears: list[Linear], inputs: dict[int, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for lin in linears:
        lin(inputs[lin.in_features])
    return time.perf_counter() - t0


def matmul_table(rounds: int = 5) -> str:
    """Milliseconds of matmul per decode step at 1, 8 and 64 rows, best of `rounds` (kinds take turns)."""
    source = GGUFSource(default_model_path())
    tensors = dict(source.tensors())
    stored = {n: g for n, t in tensors.items() if t.dim() == 2 and (g := source.stored_int4(n)) is not None}
    # The CPU kinds (TRITON_Q4 is a GPU kernel).
    kinds = {
        kind: _step_linears(kind, tensors, stored) for kind in LinearKind if kind is not LinearKind.TRITON_Q4
    }
    labels = {k: f"{k.value} ({lins[0].describe()}; head {lins[-1].describe()})" for k, lins in kinds.items()}
    widths = {lin.in_features for lin in kinds[LinearKind.FLOAT]}
    best: dict[tuple[str, int], float] = {}
    runs_by_label: list[tuple[str, list[Linear], int]] = []
    for rows in MATMUL_ROWS:
        inputs = {w: torch.randn(rows, w) for w in widths}
        bf16 = {w: x.to(torch.bfloat16) for w, x in inputs.items()}
        runs: list[tuple[str, list[Linear], dict[int, torch.Tensor]]] = [
            (labels[k], lins, inputs) for k, lins in kinds.items()
        ]
        # The same kernels fed bfloat16 directly: what the cast inside costs.
        for k in (LinearKind.INT8_WEIGHT, LinearKind.INT4):
            runs.append((f"{labels[k]}, bf16 input (no cast)", kinds[k], bf16))
        runs_by_label += [(label, lins, rows) for label, lins, _ in runs]
        for _label, lins, xs in runs:
            _time_step(lins, xs)  # warm-up
        for _ in range(rounds):
            for label, lins, xs in runs:
                t = _time_step(lins, xs)
                best[(label, rows)] = min(best.get((label, rows), t), t)
    peaks = _peaks()
    bandwidth = _read_bandwidth()
    lines = [
        f"### Matmul time per decode step (30 layers + head), ms, best of {rounds} rounds",
        "",
        f"CPU: {cpu_features().summary()}",
        "",
        "Against this machine's measured peaks, all threads: " + _peak_line(peaks, bandwidth) + ". At M=1 a "
        "step is bound by streaming the weights: GB/s of weight bytes against the read bandwidth; at "
        "M=8 and 64, G ops/s (2 per multiply-add) against the peak of the arithmetic the kind runs.",
        "",
        "| kind | " + " | ".join(f"M={m} ms | {'GB/s' if m == 1 else 'G ops/s'}" for m in MATMUL_ROWS) + " |",
        "| --- |" + " ---: | ---: |" * len(MATMUL_ROWS),
    ]
    by_label = {label: lins for label, lins, _ in runs_by_label}
    for label in dict.fromkeys(label for label, _ in best):
        lins = by_label[label]
        macs = sum(lin.in_features * lin.out_features for lin in lins)
        weight_bytes = sum(lin.weight_bytes() for lin in lins)
        peak = _kind_peak(lins[0].kind, peaks)
        cells = []
        for m in MATMUL_ROWS:
            t = best[(label, m)]
            if m == 1:
                rate = weight_bytes / t / 1e9
                cells += [f"{t * 1e3:.1f}", f"{rate:.0f} ({rate * 1e9 / bandwidth:.0%})"]
            else:
                ops = 2 * macs * m / t
                share = f" ({ops / peak:.0%})" if peak > 0 else ""
                cells += [f"{t * 1e3:.1f}", f"{ops / 1e9:.0f}{share}"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _peaks() -> PeakRates | None:
    lib = native_library()
    return None if lib is None else lib.peak_rates()


def _read_bandwidth(mib: int = 256, rounds: int = 5) -> float:
    """Bytes per second of a sum over `mib` MiB of float32 (all threads)."""
    x = torch.ones(mib * 2**18)
    best = math.inf
    for _ in range(rounds):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def _peak_line(peaks: PeakRates | None, bandwidth: float) -> str:
    parts = [f"read bandwidth {bandwidth / 1e9:.0f} GB/s"]
    if peaks is not None:
        parts += [
            f"int8 {peaks.int8_ops / 1e9:.0f} G ops/s",
            f"float32 FMA {peaks.float32_flops / 1e9:.0f} GFLOP/s",
            f"bf16 dot {peaks.bf16_flops / 1e9:.0f} GFLOP/s" if peaks.bf16_flops > 0 else "no bf16 dot",
        ]
    return ", ".join(parts)


def _kind_peak(kind: LinearKind, peaks: PeakRates | None) -> float:
    """The peak of the arithmetic a kind's inner loop runs (0: unknown)."""
    if peaks is None:
        return 0.0
    match kind:
        case LinearKind.FLOAT:
            return peaks.float32_flops
        case LinearKind.INT8_WEIGHT | LinearKind.INT4:  # bfloat16 inside
            return peaks.bf16_flops or peaks.float32_flops
        case LinearKind.INT8_DYNAMIC | LinearKind.INT4_Q8 | LinearKind.INT8_Q8:
            return peaks.int8_ops
        case LinearKind.TRITON_Q4:  # a GPU kernel: no CPU peak applies
            return 0.0
        case _:
            assert_never(kind)


def quant_decode_table(new_tokens: int = 128, workloads: Path | None = None, rounds: int = 3) -> str:
    """Single-stream decode tok/s of the engine per --quant mode, best of `rounds` (modes take turns)."""
    user = load_workloads(workloads)["W1"]["user_messages"][0]
    path = default_model_path()
    cpu = cpu_features()
    runs: list[tuple[str, Callable[[int], None], str]] = []
    for mode in QuantMode:
        t0 = time.perf_counter()
        loaded = load_model(path, WeightDtype.FLOAT32, progress=False, quant=mode)
        load_s = time.perf_counter() - t0
        prompt = loaded.tokenizer.encode_chat([ChatMessage("user", user)])
        ours = OneJob(loaded, prompt)  # with the KV cache `serve` gives this mode
        label = mode.value
        runs.append((label, ours, f"load {load_s:.1f} s; {loaded.model.describe()}"))
    best: dict[str, float] = {}
    for _ in range(rounds):
        for label, fn, _note in runs:
            best[label] = max(best.get(label, 0.0), decode_rate(fn, new_tokens))
    rows = [
        Row(f"dyngen --quant {label}", "float32", best[label], "dyngen --quant none", note)
        for label, _, note in runs
    ]
    title = (
        f"Single-stream decode per --quant, SmolLM2-135M Q4_1 GGUF, {new_tokens} tokens, best of {rounds} "
        f"rounds\n\nCPU: {cpu.summary()}\n"
    )
    return render(title, "tok/s", rows)
