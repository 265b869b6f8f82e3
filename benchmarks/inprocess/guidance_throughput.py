"""W1 with 8 of its 64 jobs guided (classifier-free guidance) against plain W1, same process,
runs alternating.

Every 8th job carries a negative prompt (a chat prompt of its own) at scale 1.5: its negative
sequence is a second row in every forward, never sampled, so the guided run computes 72 rows
for 64 jobs' tokens. Two guided rows: the batch holding all 72 rows at once, and the default
64 rows (the last jobs wait for room, as they would on a server left at its defaults).

`python -m benchmarks guidance [--repeat N]`
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.inprocess.throughput import RunResult, run_dyngen
from benchmarks.table import Row, render
from benchmarks.workloads import load_workloads
from engine import defaults
from engine.model.loader import WeightDtype, load_model
from engine.model.quantization import QuantMode
from engine.model.shipped_model import default_model_path
from engine.model.tokenizer import ChatMessage
from engine.prompt.guidance import Guidance
from kernels.cpu_features import cpu_features

NEGATIVE = "Answer in as few and as plain words as you can."
SCALE = 1.5
EVERY = 8


def run(workloads: Path | None, repeats: int = 2) -> str:
    w = load_workloads(workloads)["W1"]
    loaded = load_model(default_model_path(), WeightDtype.AUTO, progress=False, quant=QuantMode.AUTO)
    prompts = [tuple(loaded.tokenizer.encode_chat([ChatMessage("user", m)])) for m in w["user_messages"]]
    negative = tuple(loaded.tokenizer.encode_chat([ChatMessage("user", NEGATIVE)]))
    guidance = Guidance(SCALE, negative)
    guided_jobs = len(range(0, len(prompts), EVERY))
    rows = len(prompts) + guided_jobs
    plans: dict[str, tuple[Guidance | None, int]] = {
        "plain W1": (None, defaults.MAX_BATCH_SIZE),
        f"{guided_jobs} guided, {rows} rows": (guidance, rows),
        f"{guided_jobs} guided, {defaults.MAX_BATCH_SIZE} rows": (guidance, defaults.MAX_BATCH_SIZE),
    }
    best: dict[str, RunResult] = {}
    for _ in range(repeats):  # alternating, each keeps its best round
        for label, (g, batch) in plans.items():
            r = run_dyngen(
                loaded,
                prompts,
                w["max_new_tokens"],
                w["ignore_eos"],
                guidance=g,
                guided_every=EVERY,
                max_batch_size=batch,
            )
            if label not in best or r.seconds < best[label].seconds:
                best[label] = r
    notes = {
        "plain W1": f"{len(prompts)} jobs, batch {defaults.MAX_BATCH_SIZE}",
        f"{guided_jobs} guided, {rows} rows": f"every {EVERY}th job at scale {SCALE}; all rows in one batch",
        f"{guided_jobs} guided, {defaults.MAX_BATCH_SIZE} rows": "the default batch: the last jobs wait for rows",
    }
    table = [Row(label, "auto", best[label].tokens_per_second, "plain W1", notes[label]) for label in plans]
    return "\n".join(
        [
            render(
                f"W1 with guided jobs ({len(prompts)} x {w['max_new_tokens']} new tokens, best of {repeats}, "
                "alternating)",
                "tok/s",
                table,
            ),
            "",
            f"CPU: {cpu_features().summary()}",
            f"dyngen: {loaded.model.describe()}",
        ]
    )
