"""The model's own tokenizer and chat template, through Hugging Face tokenizers.

A GGUF file carries its vocabulary, merges and chat template in its metadata; a
Hugging Face folder carries tokenizer.json and tokenizer_config.json. Both are read
by transformers' AutoTokenizer, so encoding and chat rendering match the reference
exactly; dyngen hand-writes none of it.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from engine.errors import InvalidRequestError, ModelFormatError

# transformers is a lazy package, and its first imports are not safe from two threads at once: a
# name asked for while another thread is importing it can come back missing ("cannot import name
# 'AutoTokenizer' from 'transformers'", seen when a restarted engine's tokenizer load met the
# preload thread). Every import of its tokenizer code, and every load that may import more of
# it, holds this lock.
TRANSFORMERS_IMPORT = threading.RLock()


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    def render_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str: ...

    def encode_chat(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True
    ) -> list[int]: ...

    def backend_json(self) -> str:
        """The tokenizer as the Hugging Face tokenizers library serializes it (for the grammar engine)."""
        ...


class HFTokenizer:
    """A Tokenizer backed by transformers (fast tokenizers under the hood)."""

    def __init__(self, model_path: Path, extra_eos: Sequence[int] = ()) -> None:
        logging.getLogger("transformers").setLevel(logging.ERROR)
        with TRANSFORMERS_IMPORT:
            # transformers is imported here, not at module top, so importing the engine stays cheap.
            from transformers import AutoTokenizer

            try:
                if model_path.is_file():
                    self._tok = AutoTokenizer.from_pretrained(
                        str(model_path.parent), gguf_file=model_path.name, local_files_only=True
                    )
                else:
                    self._tok = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
            except Exception as exc:  # transformers raises many kinds; all mean "no usable tokenizer"
                raise ModelFormatError(f"cannot load the tokenizer of {model_path}: {exc}") from exc
        eos: set[int] = set(int(i) for i in extra_eos)
        if self._tok.eos_token_id is not None:
            eos.add(int(self._tok.eos_token_id))
        self._eos = frozenset(eos)

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def save(self, folder: Path) -> None:
        """Write tokenizer.json, its config and the chat template: a folder this class loads in ~1 s,
        where a GGUF file is parsed whole again (~20 s on 2 cores)."""
        self._tok.save_pretrained(str(folder))

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    def backend_facts(self) -> tuple[int | None, int, bool] | None:
        """(eos id, vocabulary length, the backend's encode_special_tokens) where encoding and
        decoding are the backend's own calls with nothing added (folder_tokenizer.py), else None:
        a class that overrides them, or a decode that cleans up tokenization spaces."""
        with TRANSFORMERS_IMPORT:
            from transformers import TokenizersBackend

        cls = type(self._tok)
        own = ("encode", "_encode_plus", "decode", "_decode", "__len__")
        if not isinstance(self._tok, TokenizersBackend) or any(
            getattr(cls, name) is not getattr(TokenizersBackend, name) for name in own
        ):
            return None
        if self._tok.clean_up_tokenization_spaces:
            return None
        eos = self._tok.eos_token_id
        return (
            (None if eos is None else int(eos)),
            len(self._tok),
            bool(self._tok.backend_tokenizer.encode_special_tokens),
        )

    def backend_json(self) -> str:
        backend = copy.copy(self._tok.backend_tokenizer)  # padding and truncation off on a copy only
        backend.no_padding()
        backend.no_truncation()
        return str(backend.to_str())

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(i) for i in self._tok.encode(text, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def render_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
        if not self.has_chat_template:
            raise InvalidRequestError("this model has no chat template; send a plain prompt instead")
        rendered = self._tok.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
        return str(rendered)

    def encode_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        # The rendered template already holds every special token, as transformers does it.
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)


def preload_tokenizer_code() -> None:
    """Import transformers' tokenizer classes (~0.7 s) ahead of need: each process of `dyngen serve` calls
    it on a thread while it waits or loads, so a tokenizer loads in a tenth of that once needed."""
    with TRANSFORMERS_IMPORT:
        import transformers

        for name in ("PreTrainedTokenizerBase", "PreTrainedTokenizerFast", "TokenizersBackend"):
            getattr(transformers, name, None)
