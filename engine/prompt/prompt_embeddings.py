"""Prompt embeddings: vectors a job feeds to the model in place of the token embeddings of spans
of its prompt (the hook for multimodal inputs: an image encoder's outputs, say).

A span is placed at a prompt position (replacing the embeddings of the tokens already there) or at
a placeholder token (each occurrence, in order, is expanded to the span's rows). Positions under a
span keep a token id for everything that reads ids as text (penalties, logs), but the job's token
list carries a pseudo id per row instead, derived from the row's bytes: the prefix cache hashes
those, so two jobs share pages over a span only when their vectors are equal.

No torch here: the front end checks requests with these limits.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError

MAX_PROMPT_EMBEDDINGS = 64  # spans per job
MAX_EMBEDDING_ROWS = 8192  # rows over all of a job's spans
FLOAT32_BYTES = 4


@dataclass(frozen=True)
class PromptEmbedding:
    """`rows` float32 vectors (little-endian, row-major) for prompt positions [position, position + rows)."""

    position: int
    rows: int
    data: bytes = field(repr=False)

    @property
    def end(self) -> int:
        return self.position + self.rows

    def row_bytes(self, i: int) -> bytes:
        size = len(self.data) // self.rows
        return self.data[i * size : (i + 1) * size]


@dataclass(frozen=True)
class EmbeddingPlacement:
    """One span as a request names it: at a prompt position, or at the next occurrence of a
    placeholder token that no earlier span took (exactly one of the two)."""

    rows: int
    data: bytes = field(repr=False)
    position: int | None = None
    placeholder_token_id: int | None = None


def check_embeddings(embeddings: Sequence[PromptEmbedding], prompt_len: int, hidden_size: int | None) -> None:
    """InvalidRequestError naming the field unless the spans fit the prompt, do not overlap, stay
    within the limits and (with `hidden_size`) hold rows of the model's width."""
    if len(embeddings) > MAX_PROMPT_EMBEDDINGS:
        raise InvalidRequestError(
            f"embeddings: at most {MAX_PROMPT_EMBEDDINGS} spans, got {len(embeddings)}", "embeddings"
        )
    total = sum(e.rows for e in embeddings)
    if total > MAX_EMBEDDING_ROWS:
        raise InvalidRequestError(
            f"embeddings: at most {MAX_EMBEDDING_ROWS} rows in all, got {total}", "embeddings"
        )
    end = 0
    for i, e in sorted(enumerate(embeddings), key=lambda item: item[1].position):  # i: as the job lists it
        if e.rows < 1:
            raise InvalidRequestError(
                f"embeddings[{i}].rows must be >= 1, got {e.rows}", f"embeddings[{i}].rows"
            )
        if e.position < 0 or e.end > prompt_len:
            raise InvalidRequestError(
                f"embeddings[{i}]: the span [{e.position}, {e.end}) is outside the prompt of {prompt_len} tokens",
                f"embeddings[{i}].position",
            )
        if e.position < end:
            raise InvalidRequestError(
                f"embeddings[{i}]: the span at {e.position} overlaps another span",
                f"embeddings[{i}].position",
            )
        end = e.end
        if len(e.data) % (e.rows * FLOAT32_BYTES):
            raise InvalidRequestError(
                f"embeddings[{i}].data: {len(e.data)} bytes are not {e.rows} rows of float32 values",
                f"embeddings[{i}].data",
            )
        width = len(e.data) // (e.rows * FLOAT32_BYTES)
        if hidden_size is not None and width != hidden_size:
            raise InvalidRequestError(
                f"embeddings[{i}].data: rows of {width} values, but the model's hidden size is {hidden_size}",
                f"embeddings[{i}].data",
            )


def place_embeddings(
    prompt_ids: Sequence[int], placements: Sequence[EmbeddingPlacement]
) -> tuple[tuple[int, ...], tuple[PromptEmbedding, ...]]:
    """The prompt with each placeholder occurrence expanded to its span's rows, and the spans at
    their positions in it. All spans of a request are placed the same way (positions or placeholders)."""
    if not placements:
        return tuple(prompt_ids), ()
    by_placeholder = [p.placeholder_token_id is not None for p in placements]
    for i, p in enumerate(placements):
        if (p.position is None) == (p.placeholder_token_id is None):
            raise InvalidRequestError(
                f"embeddings[{i}]: set exactly one of position and placeholder_token_id",
                f"embeddings[{i}].placement",
            )
    if not any(by_placeholder):
        return tuple(prompt_ids), tuple(
            PromptEmbedding(p.position, p.rows, p.data) for p in placements if p.position is not None
        )
    if not all(by_placeholder):
        raise InvalidRequestError(
            "embeddings: place every span by position or every span by placeholder, not both", "embeddings"
        )
    waiting: dict[int, deque[tuple[int, EmbeddingPlacement]]] = {}
    for i, p in enumerate(placements):
        assert p.placeholder_token_id is not None
        waiting.setdefault(p.placeholder_token_id, deque()).append((i, p))
    out: list[int] = []
    spans: list[PromptEmbedding] = []
    for token in prompt_ids:
        pending = waiting.get(token)
        if pending:
            _, p = pending.popleft()
            spans.append(PromptEmbedding(len(out), p.rows, p.data))
            out.extend([token] * p.rows)
        else:
            out.append(token)
    left = [item for pending in waiting.values() for item in pending]
    if left:
        i, p = min(left, key=lambda item: item[0])
        raise InvalidRequestError(
            f"embeddings[{i}].placeholder_token_id: the prompt has no occurrence of token "
            f"{p.placeholder_token_id} left for it (each span takes its placeholder's next occurrence)",
            f"embeddings[{i}].placeholder_token_id",
        )
    return tuple(out), tuple(spans)


def span_token_ids(embedding: PromptEmbedding) -> list[int]:
    """Pseudo token ids for a span's rows: negative (never a real token), one per row, from the row's
    bytes, so equal vectors get equal ids and the prefix cache's hashes tell different ones apart."""
    ids: list[int] = []
    for i in range(embedding.rows):
        digest = hashlib.blake2b(embedding.row_bytes(i), digest_size=8).digest()
        ids.append(-1 - (int.from_bytes(digest, "little") >> 2))
    return ids
