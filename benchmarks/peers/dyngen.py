"""dyngen's column of the peers benchmark, run as a child like the peers (one engine per process).

    python -m benchmarks.peers.dyngen PROMPTS.json DTYPE QUANT

W1 and W2 are timed by throughput.run_dyngen and the single stream by single_stream.decode_rate,
the functions behind dyngen's own `python -m benchmarks w1|w2|single` figures.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

from benchmarks.inprocess.single_stream import decode_rate
from benchmarks.inprocess.throughput import OneJob, run_dyngen
from benchmarks.peers.process import answer_parts
from benchmarks.peers.prompts import PeerPrompts, Workload
from engine.jobs import SamplingSettings
from engine.model.loader import LoadedModel, WeightDtype, load_model
from engine.model.quantization import QuantMode
from engine.model.shipped_model import default_model_path
from kernels.cpu_features import cpu_features


def all_at_once(loaded: LoadedModel, w: Workload) -> Mapping[str, object]:
    # A new generator per run: its prefix cache starts cold, as W2 asks.
    sampling = SamplingSettings(temperature=w.temperature, top_p=w.top_p) if w.sampled else None
    run = run_dyngen(loaded, w.prompts, w.max_new_tokens, w.ignore_eos, prefix_cache=True, sampling=sampling)
    return {"seconds": run.seconds, "tokens": run.new_tokens, "tok_s": run.tokens_per_second}


def single(loaded: LoadedModel, w: Workload) -> Mapping[str, object]:
    job = OneJob(loaded, w.prompts[0])
    try:
        return {"tok_s": decode_rate(job, w.max_new_tokens)}
    finally:
        job.close()


def main() -> None:
    prompts_path, dtype, quant = sys.argv[1:]
    prompts = PeerPrompts.read(Path(prompts_path))
    loaded = load_model(default_model_path(), WeightDtype(dtype), progress=False, quant=QuantMode(quant))
    # Warm-up, untimed: the shapes each part will use.
    run_dyngen(loaded, prompts.w1.prompts, 4, True)
    run_dyngen(loaded, prompts.w2.prompts[:2], 4, True)
    answer_parts(
        {
            "version": f"--dtype {dtype} --quant {quant}",
            "detail": loaded.model.describe(),
            "cpu": cpu_features().summary(),
        },
        {
            "w1": lambda: all_at_once(loaded, prompts.w1),
            "w1s": lambda: all_at_once(loaded, prompts.w1s),
            "single": lambda: single(loaded, prompts.single),
            "w2": lambda: all_at_once(loaded, prompts.w2),
        },
    )


if __name__ == "__main__":
    main()
