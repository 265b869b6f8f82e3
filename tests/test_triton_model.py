"""The parity prompts give the same greedy tokens with the Triton kernels (attention, fused norm, rotary).

The real model (SmolLM2-135M, 30 layers) runs with the kernels under the Triton
interpreter on the CPU, so the run is short: all six prompts in one batch, a chunk
budget that puts a prefill chunk beside other prompts' decode steps, a few tokens.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before kernels.triton_* is imported (see test_triton_attention)

import copy

import pytest

from engine.model.loader import LoadedModel
from engine.model.tokenizer import ChatMessage
from kernels.attention.backend import AttentionKind, select_attention
from kernels.attention.triton_attention import TritonPagedAttention, interpreted
from tests.conftest import PARITY_PROMPTS
from tests.reference_generate import GenerationSettings, generate_batch

pytestmark = pytest.mark.slow

NEW_TOKENS = 4
# 253 prompt tokens in all: the second forward holds the first prompts' decode steps
# beside the rest of the prefill.
CHUNK_TOKENS = 128


def test_parity_prompts_same_greedy_tokens_with_triton_attention(smollm: LoadedModel) -> None:
    assert interpreted()
    prompts = [smollm.tokenizer.encode_chat([ChatMessage("user", t)]) for t in PARITY_PROMPTS]
    settings = GenerationSettings(max_new_tokens=NEW_TOKENS, ignore_eos=True, max_chunk_tokens=CHUNK_TOKENS)

    triton_model = copy.copy(smollm.model)  # shares the weights; only the attention backend differs
    triton_model.attention = select_attention(AttentionKind.TRITON, triton_model.device)
    triton_model.fused = True  # as LlamaModel sets it for AttentionKind.TRITON: fused norm and rotary too
    assert isinstance(triton_model.attention, TritonPagedAttention)

    results = []
    for model in (smollm.model, triton_model):
        cache = model.new_cache(num_pages=24, page_size=16)
        results.append([c.token_ids for c in generate_batch(model, cache, prompts, settings)])
    torch_tokens, triton_tokens = results
    assert triton_tokens == torch_tokens
