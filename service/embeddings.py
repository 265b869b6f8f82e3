"""GenerateRequest.embeddings as the engine places them (engine/prompt/prompt_embeddings.py), shared by the
codec (which expands placeholders into the job's prompt) and the front end (which runs the same
placement on the tokenized prompt to refuse a bad span at the edge). No torch here.
"""

from __future__ import annotations

import re

from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from engine.prompt.prompt_embeddings import EmbeddingPlacement

# "embeddings[3].data: ...", "embeddings[3]: the span ...", "embeddings: at most ...".
_NAMED = re.compile(r"embeddings(\[\d+\])?(\.\w+)?[: ]")


def embedding_placements(req: pb.GenerateRequest) -> list[EmbeddingPlacement]:
    """The request's spans in its order, each placed as it says (position or placeholder token)."""
    out: list[EmbeddingPlacement] = []
    for e in req.embeddings:
        which = e.WhichOneof("placement")
        out.append(
            EmbeddingPlacement(
                e.rows,
                e.data,
                e.position if which == "position" else None,
                e.placeholder_token_id if which == "placeholder_token_id" else None,
            )
        )
    return out


def embedding_field(message: str) -> str | None:
    """The request field an InvalidRequestError about embeddings blames (a BadRequest field
    violation), from its message: `embeddings[i].<field>`, or `embeddings` for the whole list; a
    span outside the prompt or overlapping another blames its position, a span placed neither way
    or both its placement, token healing with embeddings `token_healing`. None for other errors."""
    if message.startswith("token_healing") and "embeddings" in message:
        return "token_healing"
    match = _NAMED.match(message)
    if match is None:
        return None
    span, field = match.group(1), match.group(2)
    if span is None:
        return "embeddings"
    if field is not None:
        return f"embeddings{span}{field}"
    if "exactly one" in message:
        return f"embeddings{span}.placement"
    return f"embeddings{span}.position"  # outside the prompt, or overlapping another span
