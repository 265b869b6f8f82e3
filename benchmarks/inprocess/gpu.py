"""dyngen on a CUDA GPU (issue 25): W1 and single stream per --quant mode, and how much of the
GPU's memory bandwidth a batch-1 decode step achieves.

`python -m benchmarks gpu` (needs a CUDA device). The bandwidth fraction is the weight bytes a
decode step streams (every projection's chosen kind at one row, and the head) times the tokens
per second, over the device's own copy rate (read + write of a 1 GiB buffer): what bounds batch 1
when the device is busy. Beside it, from torch's profiler over a single stream's decode steps: the
kernel launches a step makes and the device's busy time a step against the step's time, which
tell a host-bound step (the device idle between launches) from a device-bound one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.inprocess.single_stream import decode_rate
from benchmarks.inprocess.throughput import OneJob, run_dyngen
from benchmarks.table import Row, render
from benchmarks.workloads import load_workloads
from engine.device import describe_device
from engine.model.llama import LlamaModel
from engine.model.loader import WeightDtype, load_model
from engine.model.quantization import QuantMode
from engine.model.shipped_model import default_model_path
from engine.model.tokenizer import ChatMessage
from kernels.linear.linear_autotune import TunedLinear
from kernels.linear.make_linear import Linear

MODES = (QuantMode.NONE, QuantMode.INT4, QuantMode.AUTO)


def copy_bandwidth(device: torch.device, size: int = 1 << 30) -> float:
    """Bytes per second the device moves copying a buffer (read + write counted), best of 5."""
    a = torch.empty(size, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * size / best


@dataclass(frozen=True)
class StepProfile:
    launches: float  # kernel launches a decode step
    busy_ms: float  # the device's kernel time a decode step


def step_profile(one: OneJob, steps: int = 32) -> StepProfile:
    """Launches and device time per decode step of a single stream (its prefill step counted in:
    one of `steps` + 1)."""
    from torch.profiler import ProfilerActivity, profile

    one(2)  # warm
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        one(steps + 1)
    events = prof.key_averages()
    # cudaLaunchKernel (torch's kernels) and cuLaunchKernel / cuLaunchKernelEx (Triton's)
    launches = sum(e.count for e in events if "LaunchKernel" in e.key)
    busy_us = sum(e.self_device_time_total for e in events)
    return StepProfile(launches / (steps + 1), busy_us / 1e3 / (steps + 1))


def step_weight_bytes(model: LlamaModel) -> int:
    """Weight bytes one decode step at batch 1 streams."""

    def one(lin: Linear) -> int:
        return (lin.for_rows(1) if isinstance(lin, TunedLinear) else lin).weight_bytes()

    layers = sum(one(x.qkv) + one(x.o) + one(x.gate_up) + one(x.down) for x in model.layers)
    return layers + one(model.lm_head)


def run(workloads: Path | None, new_tokens: int = 128) -> str:
    if not torch.cuda.is_available():
        return "no CUDA device: `python -m benchmarks gpu` measures dyngen on a GPU"
    device = torch.device("cuda")
    w = load_workloads(workloads)["W1"]
    peak = copy_bandwidth(device)
    rows: list[Row] = []
    lines: list[str] = []
    for mode in MODES:
        loaded = load_model(default_model_path(), WeightDtype.AUTO, progress=False, quant=mode, device=device)
        prompts = [tuple(loaded.tokenizer.encode_chat([ChatMessage("user", m)])) for m in w["user_messages"]]
        one = OneJob(loaded, prompts[0])
        single = decode_rate(one, new_tokens)
        prof = step_profile(one)
        one.close()
        w1 = run_dyngen(loaded, prompts, w["max_new_tokens"], w["ignore_eos"])
        fraction = step_weight_bytes(loaded.model) * single / peak
        dtype = str(loaded.model.dtype).removeprefix("torch.")
        note = (
            f"{fraction:.1%} of copy bandwidth; {prof.launches:.0f} launches a step, the device busy "
            f"{prof.busy_ms:.2f} of {1e3 / single:.2f} ms"
        )
        rows.append(Row(f"single stream, --quant {mode.value}", dtype, single, "", note))
        rows.append(Row(f"W1, --quant {mode.value}", dtype, w1.tokens_per_second, ""))
        lines.append(f"--quant {mode.value}: {loaded.model.describe()}")
        del loaded
        torch.cuda.empty_cache()
    return "\n".join(
        [
            render(
                f"dyngen on {describe_device(device)} (W1: 64 x {w['max_new_tokens']} tokens)", "tok/s", rows
            ),
            "",
            f"device copy bandwidth: {peak / 1e9:.0f} GB/s (read + write)",
            *lines,
        ]
    )
