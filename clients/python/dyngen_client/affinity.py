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

from dyngen_client.request import Chat, Prompt

AFFINITY_HEADER = "x-dyngen-affinity"
DEFAULT_AFFINITY_CHARS = 2048


def canonical_text(prompt: Prompt) -> str:
    """Step 1: the text whose leading characters make the key."""
    match prompt:
        case str():
            return prompt
        case Chat(messages=messages):
            return "".join(f"{role}\n{content}\n" for role, content in messages)
        case _:
            return "".join(f"{int(t)} " for t in prompt)


def affinity_key(prompt: Prompt, chars: int = DEFAULT_AFFINITY_CHARS) -> str:
    """Steps 2-3: 16 hex digits."""
    if chars < 1:
        raise ValueError(f"affinity chars must be >= 1, got {chars}")
    return hashlib.sha256(canonical_text(prompt)[:chars].encode("utf-8")).hexdigest()[:16]


def affinity_metadata(prompt: Prompt, chars: int | None) -> tuple[tuple[str, str], ...]:
    """The header to send with a request (none when `chars` is None: affinity off)."""
    return () if chars is None else ((AFFINITY_HEADER, affinity_key(prompt, chars)),)
