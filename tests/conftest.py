"""Shared fixtures: the shipped model (ours and the reference's), loaded once per session."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from engine.model.loader import LoadedModel, WeightDtype, load_model
from engine.model.shipped_model import default_model_path
from tests.tiny_generator import tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.manual_seed(0)
# CI must not flake: hypothesis draws the same examples on every run (print_blob helps reproduce).
settings.register_profile("dyngen", derandomize=True, print_blob=True)
settings.load_profile("dyngen")

# Six chat prompts of different lengths and topics for parity and batch tests.
PARITY_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three fruits that are red.",
    "Translate 'good morning' into Spanish and German, and say which language each is.",
    "What is 17 times 23? Show your working step by step, then give the final answer.",
)


@dataclass(frozen=True)
class Reference:
    """Hugging Face transformers on the same GGUF weights."""

    model: object
    tokenizer: object


@pytest.fixture(scope="session")
def shipped_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def smollm(shipped_path: Path) -> LoadedModel:
    return load_model(shipped_path, WeightDtype.FLOAT32, progress=False)


@pytest.fixture(scope="session")
def reference(shipped_path: Path) -> Iterator[Reference]:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    tok = transformers.AutoTokenizer.from_pretrained(str(shipped_path.parent), gguf_file=shipped_path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(shipped_path.parent), gguf_file=shipped_path.name, dtype=torch.float32
    )
    model.eval()
    yield Reference(model, tok)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny random-weight model the generator tests share (tests/tiny_generator.py); modules with a
    tiny model of their own define their own `tiny`."""
    return tiny_model(tmp_path_factory.mktemp("tiny"))
