"""GenerateRequest.embeddings as the engine places them (engine/prompt/prompt_embeddings.py), shared by the
codec (which expands placeholders into the job's prompt) and the front end (which runs the same
placement on the tokenized prompt to refuse a bad span at the edge). No torch here.
"""

from __future__ import annotations

from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from engine.prompt.prompt_embeddings import EmbeddingPlacement


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
