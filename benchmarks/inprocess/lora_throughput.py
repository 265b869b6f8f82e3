"""W1 with LoRA adapters against plain W1, same process, runs alternating.

Four random adapters in PEFT's format (what `peft` saves: adapter_config.json and
adapter_model.safetensors), rank 8 and 16 on every projection of every layer (the most work an
adapter adds), spread round-robin over W1's 64 jobs. A third row runs W1 with one rank-1 adapter
on a single projection on every job: it pays for leaving the fused native decode layer and for
almost no delta, so it splits the adapters' cost into the two parts.

`python -m benchmarks lora [--repeat N]`
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.inprocess.throughput import RunResult, run_dyngen
from benchmarks.table import Row, render
from benchmarks.workloads import load_workloads
from engine.model.config import ModelConfig
from engine.model.loader import WeightDtype, load_model
from engine.model.quantization import QuantMode
from engine.model.shipped_model import default_model_path
from engine.model.tokenizer import ChatMessage
from kernels.cpu_features import cpu_features

_SHAPES = {  # module -> (group, in, out) as functions of the config
    "q_proj": ("self_attn", "h", "q"),
    "k_proj": ("self_attn", "h", "kv"),
    "v_proj": ("self_attn", "h", "kv"),
    "o_proj": ("self_attn", "q", "h"),
    "gate_proj": ("mlp", "h", "i"),
    "up_proj": ("mlp", "h", "i"),
    "down_proj": ("mlp", "i", "h"),
}


def write_adapter(
    folder: Path,
    config: ModelConfig,
    rank: int,
    modules: list[str],
    layers: range,
    seed: int,
    scale: float = 0.02,
) -> Path:
    """A random LoRA adapter in PEFT's format for `config`'s model (A and B entries ~ N(0, scale^2))."""
    size = {"h": config.hidden_size, "q": config.q_size, "kv": config.kv_size, "i": config.intermediate_size}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in layers:
        for module in modules:
            group, fan_in, fan_out = _SHAPES[module]
            key = f"base_model.model.model.layers.{layer}.{group}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, size[fan_in], generator=g) * scale
            tensors[f"{key}.lora_B.weight"] = torch.randn(size[fan_out], rank, generator=g) * scale
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    settings = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": modules,
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(settings))
    return folder


def run(workloads: Path | None, repeats: int = 2) -> str:
    w = load_workloads(workloads)["W1"]
    loaded = load_model(default_model_path(), WeightDtype.AUTO, progress=False, quant=QuantMode.AUTO)
    config = loaded.model.config
    prompts = [tuple(loaded.tokenizer.encode_chat([ChatMessage("user", m)])) for m in w["user_messages"]]
    every = list(_SHAPES)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        four = [
            (f"a{i}", write_adapter(root / f"a{i}", config, rank, every, range(config.num_layers), i))
            for i, rank in enumerate((8, 8, 16, 16))
        ]
        tiny = [("aside", write_adapter(root / "aside", config, 1, ["o_proj"], range(1), 9))]
        plans: dict[str, list[tuple[str, Path]]] = {
            "plain W1": [],
            "4 adapters": four,
            "fused layer left": tiny,
        }
        best: dict[str, RunResult] = {}
        for _ in range(repeats):  # alternating, each keeps its best round
            for label, adapters in plans.items():
                r = run_dyngen(loaded, prompts, w["max_new_tokens"], w["ignore_eos"], adapters=adapters)
                if label not in best or r.seconds < best[label].seconds:
                    best[label] = r
    notes = {
        "plain W1": "no adapter",
        "4 adapters": "ranks 8/8/16/16 on all 7 projections of every layer, 16 jobs each",
        "fused layer left": "rank 1 on layer 0's o_proj only, every job: the per-op decode path, no real delta",
    }
    rows = [Row(label, "auto", best[label].tokens_per_second, "plain W1", notes[label]) for label in plans]
    return "\n".join(
        [
            render(
                f"W1 with LoRA adapters (64 x 128 new tokens, best of {repeats}, alternating)", "tok/s", rows
            ),
            "",
            f"CPU: {cpu_features().summary()}",
            f"dyngen: {loaded.model.describe()}",
        ]
    )
