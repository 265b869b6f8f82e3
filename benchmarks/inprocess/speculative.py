"""W3: one stream repeating a passage, greedy, with n-gram drafting, with a draft model, and without.

Outputs must be identical across the three; the table gives tok/s, the ratio to no
speculation, and the draft acceptance rate. transformers `generate` on the same
weights is the peer, plain and with its prompt-lookup (n-gram) decoding.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.workloads import load_workloads
from engine.generator import DynamicGenerator, GeneratorConfig
from engine.jobs import JobSpec
from engine.model.loader import LoadedModel, WeightDtype, load_model
from engine.model.shipped_model import default_model_path
from engine.model.tokenizer import ChatMessage
from engine.speculation.speculative import DrafterKind, SpeculationConfig

# Cheaper drafts that exist here: the shipped model cut to its first layers, and a bfloat16 copy.
DRAFTS: tuple[tuple[str, int | None, WeightDtype], ...] = (
    ("first 8 of 30 layers", 8, WeightDtype.FLOAT32),
    ("first 15 of 30 layers", 15, WeightDtype.FLOAT32),
    ("all 30 layers in bfloat16", None, WeightDtype.BFLOAT16),
)


def _ours(
    loaded: LoadedModel, spec: JobSpec, kind: DrafterKind, k: int, draft: LoadedModel | None
) -> tuple[float, tuple[int, ...], int, int]:
    config = GeneratorConfig(num_pages=32, speculation=SpeculationConfig(kind, num_draft_tokens=k))
    gen = DynamicGenerator(loaded.model, loaded.tokenizer, config, draft.model if draft else None)
    gen.warmup()
    t0 = time.perf_counter()
    result = gen.generate([spec])[0]
    seconds = time.perf_counter() - t0
    gen.close()
    f = result.finished
    return seconds, result.token_ids, f.accepted_draft_tokens, f.rejected_draft_tokens


def run(workloads: Path | None = None, dtype: WeightDtype = WeightDtype.FLOAT32, k: int = 4) -> str:
    w = load_workloads(workloads)["W3"]
    path = default_model_path()
    loaded = load_model(path, dtype, progress=False)
    prompt = tuple(loaded.tokenizer.encode_chat([ChatMessage("user", w["user_messages"][0])]))
    spec = JobSpec(prompt, max_new_tokens=w["max_new_tokens"], ignore_eos=w["ignore_eos"])
    lines = [
        f"### W3: one stream, repeat a passage, greedy, up to {w['max_new_tokens']} tokens, {dtype.value}, k={k}",
        "",
        "| engine | drafter | tok/s | vs no speculation | accepted / proposed | same output |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    base_s, base_tokens, _, _ = _ours(loaded, spec, DrafterKind.NONE, k, None)
    base_rate = len(base_tokens) / base_s
    lines.append(f"| dyngen | none | {base_rate:.1f} | 1.00x | - | - |")
    s, tokens, acc, rej = _ours(loaded, spec, DrafterKind.NGRAM, k, None)
    rate = len(tokens) / s
    lines.append(
        f"| dyngen | n-gram (max 4) | {rate:.1f} | {rate / base_rate:.2f}x | {acc}/{acc + rej} "
        f"({acc / max(1, acc + rej):.0%}) | {tokens == base_tokens} |"
    )
    for label, layers, draft_dtype in DRAFTS:
        draft = load_model(path, draft_dtype, progress=False, num_layers=layers)
        s, tokens, acc, rej = _ours(loaded, spec, DrafterKind.DRAFT_MODEL, k, draft)
        rate = len(tokens) / s
        lines.append(
            f"| dyngen | draft model ({label}) | {rate:.1f} | {rate / base_rate:.2f}x | "
            f"{acc}/{acc + rej} ({acc / max(1, acc + rej):.0%}) | {tokens == base_tokens} |"
        )
        del draft
        gc.collect()
    del loaded
    gc.collect()

    import transformers

    ref: Any = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype.torch
    )
    ids = torch.tensor([prompt])
    for label, extra in (("none", {}), ("prompt lookup (n-gram)", {"prompt_lookup_num_tokens": k})):
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = ref.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=w["max_new_tokens"],
                do_sample=False,
                pad_token_id=2,
                **extra,
            )
            seconds = time.perf_counter() - t0
        n = out.shape[1] - len(prompt)
        same = out[0, len(prompt) :].tolist()[: len(base_tokens)] == list(base_tokens)
        lines.append(
            f"| transformers | {label} | {n / seconds:.1f} | {n / seconds / base_rate:.2f}x of dyngen none | - "
            f"| {same} |"
        )
    return "\n".join(lines)
