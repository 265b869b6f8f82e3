"""A converted tokenizer run by the tokenizers library alone, for a start without transformers.

Importing transformers takes ~0.7 s of an engine's start and loading its tokenizer class
another ~0.4 s; the engine only decodes tokens and hands the grammar engine the backend's
JSON. When the converted tokenizer is saved (HFTokenizer.save), the backend exactly as
transformers built it goes beside it with the few facts its wrapper adds (`FACTS`): the eos
id, the vocabulary's length, and that decoding adds nothing to the backend's text. A folder
with them loads here; encoding and decoding are then the backend's own calls, the same ones
transformers makes. A wrapper that would change the text (clean-up of tokenization spaces)
writes no facts, and the folder loads through transformers as before.

Chat rendering is transformers' (its template engine): the first render loads the folder
through it, so only a caller that renders chats in-process pays for the import.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer as BackendTokenizer

from engine.model.tokenizer import ChatMessage, HFTokenizer

FACTS = "dyngen-tokenizer.json"  # the wrapper's facts (TokenizerFacts)
BACKEND = "dyngen-backend.json"  # the backend as transformers built it, padding and truncation off
FACTS_VERSION = 1


@dataclass(frozen=True)
class TokenizerFacts:
    """What a transformers tokenizer adds to its backend, as far as encode and decode go."""

    eos_token_id: int | None
    vocab_size: int  # len(tokenizer): the backend's vocabulary with its added tokens
    encode_special_tokens: bool  # the backend's flag (special tokens split as text), not serialized

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": FACTS_VERSION,
                "eos_token_id": self.eos_token_id,
                "vocab_size": self.vocab_size,
                "encode_special_tokens": self.encode_special_tokens,
            }
        )

    @staticmethod
    def read(path: Path) -> TokenizerFacts | None:
        """The facts in `path`; None if absent, damaged or of another version."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data["version"] != FACTS_VERSION:
                return None
            eos = data["eos_token_id"]
            return TokenizerFacts(
                None if eos is None else int(eos),
                int(data["vocab_size"]),
                bool(data["encode_special_tokens"]),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None


def write_facts(tokenizer: HFTokenizer, folder: Path, publish: Callable[[Path, str], None]) -> None:
    """Beside `tokenizer`'s saved folder, its backend and facts, where encoding and decoding are the
    backend's alone (HFTokenizer.backend_facts); otherwise nothing, and the folder loads through
    transformers. `publish` writes a file whole or not at all (DerivedFiles.publish_file)."""
    found = tokenizer.backend_facts()
    if found is None:
        return
    # The facts last: a folder is used only once both are in (a backend that failed to be written
    # fails its load, and the folder loads through transformers), so this may also add them to a
    # folder saved before they existed.
    publish(folder / BACKEND, tokenizer.backend_json())
    publish(folder / FACTS, TokenizerFacts(*found).to_json())


class FolderTokenizer:
    """A saved tokenizer folder with its facts (write_facts), run by the tokenizers library."""

    def __init__(
        self, folder: Path, backend: BackendTokenizer, facts: TokenizerFacts, extra_eos: Sequence[int]
    ):
        self._folder = folder
        self._backend = backend
        self._facts = facts
        backend.encode_special_tokens = facts.encode_special_tokens
        eos = {int(i) for i in extra_eos}
        if facts.eos_token_id is not None:
            eos.add(facts.eos_token_id)
        self._eos = frozenset(eos)
        self._chat: HFTokenizer | None = None
        self._chat_lock = threading.Lock()

    @staticmethod
    def open(folder: Path, extra_eos: Sequence[int] = ()) -> FolderTokenizer | None:
        """The folder's tokenizer; None where it has no facts (the caller loads it through transformers)."""
        facts = TokenizerFacts.read(folder / FACTS)
        if facts is None:
            return None
        try:
            backend = BackendTokenizer.from_file(str(folder / BACKEND))
        except Exception:  # the library raises its own kinds; all mean "load it the slow way"
            return None
        return FolderTokenizer(folder, backend, facts, extra_eos)

    @property
    def vocab_size(self) -> int:
        return self._facts.vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def backend_json(self) -> str:
        return self._backend.to_str()

    def save(self, folder: Path) -> None:
        """What HFTokenizer.save wrote to the folder it was loaded from, copied (not the backend and
        facts: the front end loads the folder through transformers, and a gateway fetches it whole)."""
        shutil.copytree(
            self._folder, folder, dirs_exist_ok=True, ignore=shutil.ignore_patterns(FACTS, BACKEND)
        )

    def _transformers(self) -> HFTokenizer:
        with self._chat_lock:
            if self._chat is None:
                self._chat = HFTokenizer(self._folder, sorted(self._eos))
            return self._chat

    @property
    def has_chat_template(self) -> bool:
        return self._transformers().has_chat_template

    def render_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
        return self._transformers().render_chat(messages, add_generation_prompt)

    def encode_chat(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)
