"""Single-stream decode speed: dyngen's paged forward vs transformers `generate`, same weights.

Both are timed the same way: wall time to generate N+1 tokens minus wall time to
generate 1 token (the prefill and first token), over N. Greedy, EOS ignored.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.table import Row, render
from benchmarks.workloads import load_workloads
from engine.batch_generate import GenerationSettings, generate_batch
from engine.model.loader import WeightDtype, default_model_path, load_model
from engine.model.tokenizer import ChatMessage


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
        cache = loaded.model.new_cache(num_pages=2, page_size=256)

        def ours(n: int, loaded: Any = loaded, prompt: list[int] = prompt, cache: Any = cache) -> None:
            generate_batch(
                loaded.model, cache, [prompt], GenerationSettings(max_new_tokens=n, ignore_eos=True)
            )

        rows.append(Row("dyngen", dtype.value, decode_rate(ours, new_tokens), "transformers"))
        del loaded, cache

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
