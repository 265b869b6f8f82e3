"""The front end's tokenizer, loaded while the first engine starts.

Prompts are tokenized here, with the tokenizer the engine saved and named in its READY. Loading it
then took ~0.18 s of a ~1.8 s warm start (2-core Zen 4), with this process idle through the engine's
imports before it. A GGUF model's converted tokenizer is kept between starts (derived_files.py) and
the engine copies that folder into the one it names: the kept folder is loaded here at once, on a
thread, and taken on READY only if it holds the engine's tokenizer files byte for byte
(tokenizer_folder.same_tokenizer); otherwise the engine's folder is loaded, as without a preload.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from pathlib import Path

from engine.errors import DyngenError
from engine.model.derived_files import DerivedFiles
from engine.model.shipped_model import default_model_path
from engine.model.tokenizer import preload_tokenizer_code
from service.frontend.prompts import PromptTokenizer, saved_tokenizer_class
from service.tokenizer_folder import same_tokenizer

_Preloaded = tuple[Path, PromptTokenizer] | None


def kept_tokenizer(model: Path | None) -> Path | None:
    """The folder a GGUF model's converted tokenizer is kept in, if there is one that loads by a named
    class (a folder naming none would load through AutoTokenizer, which imports torch)."""
    try:
        path = model if model is not None else default_model_path()
        if not path.is_file():
            return None  # a Hugging Face folder: the engine saves its tokenizer anew
        folder = DerivedFiles.of(path).tokenizer
    except (OSError, DyngenError):
        return None  # no such model: the engine says why
    return folder if saved_tokenizer_class(folder) is not None else None


class TokenizerPreload:
    """Loads `model`'s kept tokenizer on a thread from construction (after importing transformers'
    tokenizer code, which any load needs); `take` hands the engine's tokenizer over once it is ready.
    `load=False`: nothing preloaded, `take` loads the engine's folder."""

    def __init__(self, model: Path | None, load: bool = True) -> None:
        self._done: Future[_Preloaded] = Future()
        if load:
            threading.Thread(target=self._run, args=(model,), name="tokenizer-preload", daemon=True).start()
        else:
            self._done.set_result(None)

    def _run(self, model: Path | None) -> None:
        found: _Preloaded = None
        try:
            preload_tokenizer_code()
            folder = kept_tokenizer(model)
            if folder is not None:
                found = (folder, PromptTokenizer.load(folder))
        except Exception:  # any failure only means loading on READY, as without a preload
            found = None
        self._done.set_result(found)

    async def take(self, served: Path) -> PromptTokenizer:
        """The tokenizer of `served`, the engine's folder: the preloaded one if its files are the same."""
        preloaded = await asyncio.wrap_future(self._done)
        if preloaded is not None:
            kept, prompts = preloaded
            if same_tokenizer(kept, served):
                return prompts
            prompts.close()
        return await asyncio.get_running_loop().run_in_executor(None, PromptTokenizer.load, served)
