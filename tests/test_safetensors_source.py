"""A tiny random-weight Llama saved by transformers as safetensors loads and matches its logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.model.llama import LlamaModel
from engine.model.loader import open_weight_source
from tests.reference_generate import GenerationSettings, generate_batch
from tests.tiny_llama import save_tiny_llama

CASES: dict[str, dict[str, Any]] = {
    "untied": {},
    "tied": {"tie_word_embeddings": True},
    "attention_bias": {"attention_bias": True},
    "llama3_rope": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
    "linear_rope": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "mha": {"num_key_value_heads": 8},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_tiny_llama_matches_transformers(tmp_path: Path, case: str) -> None:
    ref = save_tiny_llama(tmp_path, **CASES[case])
    if case == "attention_bias":
        # Random init leaves biases at zero; make them count.
        with torch.no_grad():
            for layer in ref.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_()
        ref.save_pretrained(str(tmp_path), safe_serialization=True)
    ours = LlamaModel.from_source(open_weight_source(tmp_path), progress=False)
    prompt = [int(t) for t in torch.randint(3, 320, (37,), generator=torch.Generator().manual_seed(7))]
    cache = ours.new_cache(num_pages=16, page_size=16)
    settings = GenerationSettings(max_new_tokens=24, ignore_eos=True)
    (result,) = generate_batch(ours, cache, [prompt], settings, keep_logits=True)
    full = torch.tensor([prompt + list(result.token_ids)])
    with torch.inference_mode():
        ref_logits = ref(full).logits[0].float()
    # Our step i's logits follow token len(prompt) - 1 + i.
    for i, ours_logits in enumerate(result.step_logits):
        theirs = ref_logits[len(prompt) - 1 + i]
        assert int(torch.argmax(theirs)) == result.token_ids[i]
        assert float((ours_logits - theirs).abs().max()) < 1e-4
