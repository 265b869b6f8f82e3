"""W1 with half the jobs held to a JSON schema, against plain W1, in the same run.

    python -m benchmarks.inprocess.structured [--rounds N]

The masks of the constrained jobs are computed on the mask worker while the forward runs
(engine/grammar/constraints.py); this prints both throughputs, their ratio, and where the time
went: mask time per step on the worker beside forward time per step.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.workloads import load_workloads
from engine.generator import DynamicGenerator, GeneratorConfig
from engine.grammar import constraints
from engine.grammar.constraints import MaskOverlap, ResponseFormat
from engine.jobs import JobSpec
from engine.model.loader import LoadedModel, WeightDtype, load_model
from engine.model.quantization import QuantMode
from engine.model.shipped_model import default_model_path
from engine.model.tokenizer import ChatMessage
from engine.scheduler import SchedulerConfig
from kernels.cpu_features import cpu_features

# A simple schema that keeps a job writing for the whole token budget, as the free jobs do
# (ignore_eos): its one string must be longer than 128 tokens can spell, so the comparison
# is per token, not cut short by completed outputs.
SCHEMA = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 1000}},
    "required": ["story"],
    "additionalProperties": False,
}


@dataclass
class _Clock:
    seconds: float = 0.0
    calls: int = 0

    def wrap(self, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def timed(*args: object) -> torch.Tensor:
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        return timed


@dataclass(frozen=True)
class Run:
    seconds: float
    tokens: int
    steps: int
    forward_s: float
    mask_s: float
    masks: int

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def run(
    loaded: LoadedModel,
    prompts: list[tuple[int, ...]],
    new_tokens: int,
    constrained: bool,
    overlap: MaskOverlap = MaskOverlap.AUTO,
) -> Run:
    pages = sum(-(-(len(p) + new_tokens) // 64) for p in prompts) + 8
    gen = DynamicGenerator(
        loaded.model,
        loaded.tokenizer,
        GeneratorConfig(
            64,
            pages,
            scheduler=SchedulerConfig(max_batch_size=64, max_chunk_size=2048),
            mask_overlap=overlap,
        ),
    )
    gen.warmup()
    fmt = ResponseFormat.json_schema(json.dumps(SCHEMA))
    specs = [
        JobSpec(
            p,
            max_new_tokens=new_tokens,
            ignore_eos=True,
            response_format=fmt if constrained and i % 2 else None,
        )
        for i, p in enumerate(prompts)
    ]
    forward, masks = _Clock(), _Clock()
    model_forward = loaded.model.forward
    fill = constraints.MaskWorker._fill
    loaded.model.forward = forward.wrap(model_forward)  # type: ignore[method-assign]
    constraints.MaskWorker._fill = masks.wrap(fill)  # type: ignore[method-assign]
    try:
        t0 = time.perf_counter()
        results = gen.generate(specs)
        seconds = time.perf_counter() - t0
    finally:
        loaded.model.forward = model_forward  # type: ignore[method-assign]
        constraints.MaskWorker._fill = fill  # type: ignore[method-assign]
        gen.close()
    if constrained:
        for r, s in zip(results, specs, strict=True):
            if s.response_format is not None and r.finished.stop_reason.value == "grammar":
                json.loads(r.text)  # a completed constrained output is JSON
    return Run(
        seconds,
        sum(len(r.token_ids) for r in results),
        forward.calls,
        forward.seconds,
        masks.seconds,
        masks.calls,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds; each keeps its best")
    args = parser.parse_args()
    w = load_workloads()["W1"]
    loaded = load_model(default_model_path(), WeightDtype.AUTO, progress=False, quant=QuantMode.AUTO)
    prompts = [tuple(loaded.tokenizer.encode_chat([ChatMessage("user", m)])) for m in w["user_messages"]]
    runs: dict[str, tuple[bool, MaskOverlap]] = {
        "all free": (False, MaskOverlap.AUTO),
        "half constrained, masks beside the forward": (True, MaskOverlap.BESIDE),
        "half constrained, masks before the forward": (True, MaskOverlap.BEFORE),
    }
    best: dict[str, Run] = {}
    for _ in range(args.rounds):
        for name, (constrained, overlap) in runs.items():
            r = run(loaded, prompts, int(w["max_new_tokens"]), constrained, overlap)
            if name not in best or r.tok_s > best[name].tok_s:
                best[name] = r
    free = best["all free"]
    auto = MaskOverlap.AUTO.resolve()
    print(f"CPU: {cpu_features().summary()}")
    print(f"dyngen: {loaded.model.describe()}")
    print()
    print("### W1 (64 chat prompts x 128 new tokens, EOS ignored), half the jobs held to a JSON schema")
    print()
    print("| run | tok/s | wall s | tokens | forward ms/step | mask ms/step (worker) | masks | vs free |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in best.items():
        picked = " (auto's pick here)" if runs[name][0] and runs[name][1] is auto else ""
        print(
            f"| {name}{picked} | {r.tok_s:.1f} | {r.seconds:.2f} | {r.tokens} "
            f"| {r.forward_s / r.steps * 1e3:.1f} | {r.mask_s / r.steps * 1e3:.2f} | {r.masks} "
            f"| {r.tok_s / free.tok_s:.2f}x |"
        )
    print()
    print(
        f"best of {args.rounds} alternating rounds each; {torch.get_num_threads()} torch threads. Beside the "
        "forward, the worker's thread shares the cores with the forward's; auto puts it there only "
        "with a core to spare."
    )


if __name__ == "__main__":
    main()
