"""Prompts become token ids in the front end, on worker threads, never in the engine process.

So a 1 MiB prompt costs front-end CPU on a worker thread, not a stall of every other job's
decoding. The tokenizer is the engine's own, loaded from the folder the engine saved it to,
so the ids are exactly the ones the engine would have made.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from engine.errors import DyngenError
from engine.model.tokenizer import ChatMessage, HFTokenizer
from service.limits import RequestError

# Tokenizing is CPU work; a small pool keeps many large prompts from starving the event loop's
# own thread, and bounds how many run at once.
TOKENIZER_THREADS = 2


class PromptTokenizer:
    def __init__(self, tokenizer: HFTokenizer) -> None:
        self.tokenizer = tokenizer
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")

    @staticmethod
    def load(folder: Path) -> PromptTokenizer:
        return PromptTokenizer(HFTokenizer(folder))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def token_ids(self, prompt: pb.GenerateRequest | pb.TokenizeRequest) -> list[int]:
        """The prompt's ids; RequestError for an empty prompt or a chat the template refuses."""
        match prompt.WhichOneof("prompt"):
            case "text":
                return self.tokenizer.encode(prompt.text)
            case "chat":
                messages = [ChatMessage(m.role, m.content) for m in prompt.chat.messages]
                try:
                    return self.tokenizer.encode_chat(messages)
                except DyngenError as exc:
                    raise RequestError(str(exc), "chat") from exc
                except Exception as exc:  # the template's raise_exception(), or a template error
                    raise RequestError(f"chat: the model's chat template refused it: {exc}", "chat") from exc
            case "token_ids" if isinstance(prompt, pb.GenerateRequest):
                return list(prompt.token_ids.ids)
            case _:
                raise RequestError("prompt: set one of text, chat or token_ids", "prompt")

    async def token_ids_async(self, prompt: pb.GenerateRequest | pb.TokenizeRequest) -> list[int]:
        if prompt.WhichOneof("prompt") == "token_ids":
            return self.token_ids(prompt)
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.token_ids, prompt)
