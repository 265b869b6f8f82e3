"""Greedy tokens and per-step logits against Hugging Face transformers on the same GGUF."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.model.loader import LoadedModel
from engine.model.tokenizer import ChatMessage
from tests.conftest import PARITY_PROMPTS, Reference
from tests.reference_generate import GenerationSettings, generate_batch

pytestmark = pytest.mark.slow

NEW_TOKENS = 48
LOGIT_TOLERANCE = 2e-3


def reference_greedy(ref: Reference, prompt_ids: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    model: Any = ref.model
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.int64),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
            eos_token_id=None,  # run all NEW_TOKENS steps, past the end of the answer
            pad_token_id=2,
        )
    tokens = [int(t) for t in out.sequences[0, len(prompt_ids) :]]
    return tokens, [step[0].float() for step in out.logits]


def test_chat_prompt_rendering_matches_reference(smollm: LoadedModel, reference: Reference) -> None:
    tok: Any = reference.tokenizer
    for text in PARITY_PROMPTS:
        ours = smollm.tokenizer.encode_chat([ChatMessage("user", text)])
        theirs = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        if isinstance(theirs, dict) or hasattr(theirs, "input_ids"):
            theirs = theirs["input_ids"]
        assert ours == list(theirs)


@pytest.mark.parametrize("text", PARITY_PROMPTS)
def test_greedy_tokens_and_logits_match_reference(
    smollm: LoadedModel, reference: Reference, text: str
) -> None:
    prompt = smollm.tokenizer.encode_chat([ChatMessage("user", text)])
    ref_tokens, ref_logits = reference_greedy(reference, prompt)
    cache = smollm.model.new_cache(num_pages=8, page_size=16)
    settings = GenerationSettings(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    (ours,) = generate_batch(smollm.model, cache, [prompt], settings, keep_logits=True)
    assert len(ref_tokens) == NEW_TOKENS
    assert list(ours.token_ids) == ref_tokens
    for step, (a, b) in enumerate(zip(ours.step_logits, ref_logits, strict=True)):
        diff = float((a - b).abs().max())
        assert diff < LOGIT_TOLERANCE, f"step {step}: max abs logit difference {diff}"
