"""The folder the engine saves its tokenizer to, made whole for a gateway that tokenizes itself.

Besides the tokenizer's own files (tokenizer.json, tokenizer_config.json with the chat template), it
gets the two files a Hugging Face model folder carries that a tokenizer loader reads end-of-sequence
ids and the model's kind from: config.json and generation_config.json. The front end tokenizes from
this folder, and serves it zipped to a gateway (the worker contract's GetTokenizer), so a gateway
renders chats and stops at EOS exactly as the engine does, without a copy of the model.

Written by the engine process, read by the front end: the front end may tokenize from a kept copy
of a GGUF file's converted tokenizer instead, loaded while the engine starts, when that copy holds
the same tokenizer files byte for byte (`same_tokenizer`).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path

from engine.model.config import ModelConfig
from engine.model.folder_tokenizer import BACKEND, FACTS

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
MODEL_FILES = frozenset({CONFIG, GENERATION_CONFIG})  # the model's files, not the tokenizer's


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
    (folder / CONFIG).write_text(json.dumps(model, indent=2) + "\n", encoding="utf-8")
    (folder / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")


def same_tokenizer(kept: Path, served: Path) -> bool:
    """Whether `kept` (a converted tokenizer kept between starts, derived_files.py) holds exactly the
    tokenizer files of `served` (the folder the engine saved): the same names, each with the same
    bytes, leaving out the model's files there and the engine's own facts here. False if either
    cannot be read."""
    try:
        ours = {p.name for p in kept.iterdir()} - {FACTS, BACKEND}
        theirs = {p.name for p in served.iterdir()} - MODEL_FILES
        return ours == theirs and all((kept / n).read_bytes() == (served / n).read_bytes() for n in ours)
    except OSError:
        return False
