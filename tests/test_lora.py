"""LoRA adapters on a tiny random model: read from peft's files, applied per row in one forward
beside other adapters and the base model, each row equal to peft's own forward."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.errors import InvalidRequestError, ModelNotFoundError
from engine.forward_batch import ForwardBatch, SequenceInput
from engine.ids import PageId
from engine.model.loader import LoadedModel, WeightDtype, load_model
from engine.model.lora_adapter import AdapterError, LoraAdapter
from engine.model.quantization import QuantMode
from tests.lora_adapters import save_peft_adapter
from tests.tiny_llama import save_tiny_llama

PAGE = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    folder = tmp_path_factory.mktemp("tiny")
    return folder, save_tiny_llama(folder, with_tokenizer=True)


@pytest.fixture(scope="module")
def adapters(tiny: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    _, hf = tiny
    root = tmp_path_factory.mktemp("adapters")
    return {
        "attn": (
            root / "attn",
            save_peft_adapter(hf, root / "attn", 8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], 1),
        ),
        "mlp": (
            root / "mlp",
            save_peft_adapter(
                hf, root / "mlp", 4, 32, ["gate_proj", "down_proj", "v_proj"], 2, use_rslora=True
            ),
        ),
        "pattern": (
            root / "pattern",
            save_peft_adapter(
                hf, root / "pattern", 6, 8, ["q_proj", "up_proj"], 3, alpha_pattern={"up_proj": 24}
            ),
        ),
    }


def _forward(
    loaded: LoadedModel, prompts: list[list[int]], which: list[LoraAdapter | None]
) -> list[torch.Tensor]:
    """Every prompt prefilled in one forward; each one's logits at every position."""
    model = loaded.model
    pages_each = max(len(p) for p in prompts) // PAGE + 1
    cache = model.new_cache(1 + pages_each * len(prompts), PAGE)
    seqs = [
        SequenceInput(
            p,
            0,
            [PageId(1 + i * pages_each + j) for j in range(pages_each)],
            logit_positions=len(p),
            adapter=a,
        )
        for i, (p, a) in enumerate(zip(prompts, which, strict=True))
    ]
    logits = model.forward(ForwardBatch.build(seqs, PAGE, torch.device("cpu")), cache)
    sizes = [len(p) for p in prompts]
    return [logits[sum(sizes[:i]) : sum(sizes[: i + 1])] for i in range(len(sizes))]


def _reference(model: Any, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(torch.tensor([prompt])).logits[0].to(torch.float32)
    return out


def test_one_forward_mixes_adapters_and_the_base_model(
    tiny: tuple[Path, Any], adapters: dict[str, tuple[Path, Any]]
) -> None:
    folder, hf = tiny
    loaded = load_model(folder, WeightDtype.FLOAT32, progress=False)
    loras = {n: LoraAdapter.load(n, p, loaded.model.config) for n, (p, _) in adapters.items()}
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (11, 5, 23, 9, 14)]
    which = [loras["attn"], None, loras["mlp"], loras["attn"], loras["pattern"]]
    refs = [adapters["attn"][1], hf, adapters["mlp"][1], adapters["attn"][1], adapters["pattern"][1]]
    got = _forward(loaded, prompts, which)
    for prompt, out, ref in zip(prompts, got, refs, strict=True):
        want = _reference(ref, prompt)
        assert torch.allclose(out, want, atol=2e-4, rtol=1e-4), (out - want).abs().max()
    # The adapters change the output: the test would fail if they were not applied.
    base = _reference(hf, prompts[0])
    assert (got[0] - base).abs().max() > 1e-2


def test_decode_steps_with_adapters_leave_the_fused_layer(
    tiny: tuple[Path, Any], adapters: dict[str, tuple[Path, Any]]
) -> None:
    """One new token per sequence (a decode step) with an adapter runs the per-op path."""
    folder, _ = tiny
    loaded = load_model(folder, WeightDtype.FLOAT32, progress=False, quant=QuantMode.INT4)
    lora = LoraAdapter.load("mlp", adapters["mlp"][0], loaded.model.config)
    prompts = [[5], [9]]
    with_lora = _forward(loaded, prompts, [lora, None])
    base = _forward(loaded, prompts, [None, None])
    assert torch.equal(with_lora[1], base[1])  # the base row is untouched
    assert (with_lora[0] - base[0]).abs().max() > 1e-3


def test_refused_adapters_say_why(
    tiny: tuple[Path, Any], adapters: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    folder, _ = tiny
    config = load_model(folder, WeightDtype.FLOAT32, progress=False).model.config
    with pytest.raises(ModelNotFoundError):
        LoraAdapter.load("x", tmp_path / "missing", config)
    source = adapters["attn"][0]
    for change, words in (
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "biases"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"lora_alpha": 0}, "lora_alpha"),
    ):
        bad = tmp_path / str(len(list(tmp_path.iterdir())))
        bad.mkdir()
        (bad / "adapter_model.safetensors").write_bytes((source / "adapter_model.safetensors").read_bytes())
        settings = json.loads((source / "adapter_config.json").read_text()) | change
        (bad / "adapter_config.json").write_text(json.dumps(settings))
        with pytest.raises(AdapterError, match=words):
            LoraAdapter.load("x", bad, config)
    save_tiny_llama(tmp_path / "wide", with_tokenizer=True, hidden_size=96)
    other = load_model(tmp_path / "wide", WeightDtype.FLOAT32, progress=False).model.config
    with pytest.raises(AdapterError, match="do not fit"):
        LoraAdapter.load("x", source, other)
    assert issubclass(AdapterError, InvalidRequestError)
