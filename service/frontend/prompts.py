"""Prompts become token ids in the front end, on worker threads, never in the engine process.

So a 1 MiB prompt costs front-end CPU on a worker thread, not a stall of every other job's
decoding. The tokenizer is the engine's own, loaded from the folder the engine saved it to,
so the ids are exactly the ones the engine would have made.

The front end never imports torch (tests/test_frontend_imports.py): transformers' AutoTokenizer
does (its model configuration code), so the saved folder is loaded by the tokenizer class it
names instead (SavedTokenizer), which imports tokenizer code only.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from engine.errors import DyngenError, ModelFormatError
from engine.model.tokenizer import TRANSFORMERS_IMPORT, ChatMessage, HFTokenizer
from service.frontend.limits import RequestError

_PromptSource = pb.GenerateRequest | pb.TokenizeRequest | pb.Guidance  # messages with a prompt oneof
_S = TypeVar("_S", pb.GenerateRequest | pb.TokenizeRequest, pb.Guidance)

# Tokenizing is CPU work; a small pool keeps many large prompts from starving the event loop's
# own thread, and bounds how many run at once.
TOKENIZER_THREADS = 2


def saved_tokenizer_class(folder: Path) -> Any | None:
    """The transformers tokenizer class that `HFTokenizer.save` wrote `folder` from (the
    tokenizer_config.json's tokenizer_class), or None if the folder names none transformers has."""
    try:
        name = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))["tokenizer_class"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(name, str):
        return None
    with TRANSFORMERS_IMPORT:
        import transformers  # a lazy package: this imports the named class's module only

        found = getattr(transformers, name, None)
        if isinstance(found, type) and issubclass(found, transformers.PreTrainedTokenizerBase):
            return found
    return None


class SavedTokenizer(HFTokenizer):
    """The engine's tokenizer, loaded from the folder it saved (`HFTokenizer.save`) by its own class.

    Encoding and chat rendering are HFTokenizer's; only the loading differs: the class the
    engine's AutoTokenizer chose, named in the folder, loads it directly, not AutoTokenizer again.
    """

    def __init__(self, folder: Path, tokenizer_class: Any) -> None:  # no super().__init__: no AutoTokenizer
        logging.getLogger("transformers").setLevel(logging.ERROR)
        try:
            with TRANSFORMERS_IMPORT:  # loading may import more of transformers
                self._tok = tokenizer_class.from_pretrained(str(folder), local_files_only=True)
        except Exception as exc:  # transformers raises many kinds; all mean "no usable tokenizer"
            raise ModelFormatError(f"cannot load the tokenizer of {folder}: {exc}") from exc
        eos = self._tok.eos_token_id
        self._eos = frozenset() if eos is None else frozenset({int(eos)})

    @staticmethod
    def load(folder: Path) -> HFTokenizer:
        """A SavedTokenizer; HFTokenizer (AutoTokenizer, and so torch) for a folder naming no class."""
        tokenizer_class = saved_tokenizer_class(folder)
        return HFTokenizer(folder) if tokenizer_class is None else SavedTokenizer(folder, tokenizer_class)


class PromptTokenizer:
    def __init__(self, tokenizer: HFTokenizer) -> None:
        self.tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")

    @staticmethod
    def load(folder: Path) -> PromptTokenizer:
        return PromptTokenizer(SavedTokenizer.load(folder))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _chat_ids(self, chat: pb.ChatPrompt, field: str) -> list[int]:
        messages = [ChatMessage(m.role, m.content) for m in chat.messages]
        try:
            return self.tokenizer.encode_chat(messages)
        except DyngenError as exc:
            raise RequestError(str(exc), field) from exc
        except Exception as exc:  # the template's raise_exception(), or a template error
            raise RequestError(f"{field}: the model's chat template refused it: {exc}", field) from exc

    def _ids(self, source: _PromptSource, which: str | None, field: str, prefix: str = "") -> list[int]:
        """The ids of a prompt oneof (text, chat or token_ids) of `source`, `which` being the set one;
        `field` names the oneof in errors, `prefix` where `source` sits in the request."""
        match which:
            case "text":
                return self.tokenizer.encode(source.text)
            case "chat":
                return self._chat_ids(source.chat, prefix + "chat")
            case "token_ids" if not isinstance(source, pb.TokenizeRequest):
                return list(source.token_ids.ids)
            case _:
                raise RequestError(f"{field}: set one of text, chat or token_ids", field)

    def token_ids(self, prompt: pb.GenerateRequest | pb.TokenizeRequest) -> list[int]:
        """The prompt's ids; RequestError for an empty prompt or a chat the template refuses."""
        return self._ids(prompt, prompt.WhichOneof("prompt"), "prompt")

    def negative_ids(self, guidance: pb.Guidance) -> list[int]:
        """The guidance's negative prompt's ids, made exactly as a prompt's (BOS, chat template)."""
        return self._ids(
            guidance, guidance.WhichOneof("negative_prompt"), "guidance.negative_prompt", "guidance."
        )

    async def token_ids_async(self, prompt: pb.GenerateRequest | pb.TokenizeRequest) -> list[int]:
        return await self._off_loop(self.token_ids, prompt, prompt.WhichOneof("prompt"))

    async def negative_ids_async(self, guidance: pb.Guidance) -> list[int]:
        return await self._off_loop(self.negative_ids, guidance, guidance.WhichOneof("negative_prompt"))

    async def _off_loop(self, ids: Callable[[_S], list[int]], source: _S, which: str | None) -> list[int]:
        """`ids(source)` on the tokenizing pool; at once for token ids (nothing to tokenize)."""
        if which == "token_ids":
            return ids(source)
        return await asyncio.get_running_loop().run_in_executor(self._pool, ids, source)
