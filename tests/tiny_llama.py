"""Tiny random-weight Llama models saved by transformers, for fast engine tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY_VOCAB = 320


def save_tiny_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over w0..w{N-4} plus <unk>, <s>, </s>: one token per word."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i + 3 for i in range(TINY_VOCAB - 3)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(str(folder))


def save_tiny_llama(folder: Path, with_tokenizer: bool = False, **overrides: Any) -> Any:
    """Save a seeded random LlamaForCausalLM (safetensors) to `folder`; returns the transformers model."""
    import transformers

    settings: dict[str, Any] = {
        "vocab_size": TINY_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "eos_token_id": 2,
        "bos_token_id": 1,
    }
    settings.update(overrides)
    torch.manual_seed(1234)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings)).eval()  # type: ignore[no-untyped-call]
    model.save_pretrained(str(folder), safe_serialization=True)
    if with_tokenizer:
        save_tiny_tokenizer(folder)
    return model
