"""The folder the engine saves its tokenizer to, made whole for a gateway that tokenizes itself.

Besides the tokenizer's own files (tokenizer.json, tokenizer_config.json with the chat template), it
gets the two files a Hugging Face model folder carries that a tokenizer loader reads end-of-sequence
ids and the model's kind from: config.json and generation_config.json. The front end tokenizes from
this folder, and serves it zipped to a gateway (the worker contract's GetTokenizer), so a gateway
renders chats and stops at EOS exactly as the engine does, without a copy of the model.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path

from engine.model.config import ModelConfig


def write_model_files(
    folder: Path, config: ModelConfig, eos_token_ids: Collection[int], context: int
) -> None:
    eos = sorted(eos_token_ids)
    model = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "max_position_embeddings": context,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos,
    }
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": eos}
    (folder / "config.json").write_text(json.dumps(model, indent=2) + "\n", encoding="utf-8")
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
