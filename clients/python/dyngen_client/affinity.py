"""The prefix-affinity key: requests that share a prompt's start get the same key, so a balancer
hashing on it sends them to the same replica, whose prefix cache then holds their shared pages.

The key is defined on what every client has before any tokenizer runs, so a client in any
language computes it the same way (docs/SCALING.md gives the steps and a test vector):

1. the prompt's canonical text: a text prompt as it is; chat messages as each message's
   role, a newline, its content and a newline, in order (the system message included); token
   ids as decimal numbers, each followed by a space;
2. its first `chars` characters (Unicode code points; default 2048);
3. SHA-256 of their UTF-8 bytes, the first 16 hex digits (lowercase).

It travels as the gRPC metadata header `x-dyngen-affinity`; the server logs it per job.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Protocol

AFFINITY_HEADER = "x-dyngen-affinity"
DEFAULT_AFFINITY_CHARS = 2048


class ChatLike(Protocol):
    """Chat messages as (role, content) pairs (dyngen_client.request.Chat is one)."""

    @property
    def messages(self) -> Sequence[tuple[str, str]]: ...


KeyedPrompt = str | ChatLike | Sequence[int]  # plain text, chat messages, or token ids


def chat_text(messages: Iterable[tuple[str, str]]) -> str:
    """Step 1 for chat messages: each message's role, a newline, its content and a newline."""
    return "".join(f"{role}\n{content}\n" for role, content in messages)


def ids_text(ids: Iterable[int]) -> str:
    """Step 1 for token ids: each as a decimal number followed by a space."""
    return "".join(f"{int(t)} " for t in ids)


def canonical_text(prompt: KeyedPrompt) -> str:
    """Step 1: the text whose leading characters make the key."""
    match prompt:
        case str():
            return prompt
        case Sequence():
            return ids_text(int(t) for t in prompt)
        case _:
            return chat_text(prompt.messages)


def text_key(text: str, chars: int = DEFAULT_AFFINITY_CHARS) -> str:
    """Steps 2-3 on a canonical text: 16 hex digits."""
    if chars < 1:
        raise ValueError(f"affinity chars must be >= 1, got {chars}")
    return hashlib.sha256(text[:chars].encode("utf-8")).hexdigest()[:16]


def affinity_key(prompt: KeyedPrompt, chars: int = DEFAULT_AFFINITY_CHARS) -> str:
    """Steps 1-3: 16 hex digits."""
    return text_key(canonical_text(prompt), chars)


def affinity_metadata(prompt: KeyedPrompt, chars: int | None) -> tuple[tuple[str, str], ...]:
    """The header to send with a request (none when `chars` is None: affinity off)."""
    return () if chars is None else ((AFFINITY_HEADER, affinity_key(prompt, chars)),)
