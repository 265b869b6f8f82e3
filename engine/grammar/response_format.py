"""What a job's output must be (ResponseFormat): plain values, no grammar engine and no torch.

engine/grammar/constraints.py compiles them with llguidance inside the engine; this module stays light
so that engine/jobs.py, and through it the service's front end, never import either.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

from engine.errors import InvalidRequestError

MAX_GRAMMAR_CHARS = 64 * 1024  # a schema or grammar larger than this is refused at enqueue


class GrammarKind(enum.Enum):
    JSON_SCHEMA = "json_schema"  # a JSON Schema document (the output is one JSON value)
    REGEX = "regex"  # the whole output matches the regular expression
    LARK = "lark"  # a Lark grammar (llguidance's dialect: `start` is the root rule)
    GBNF = "gbnf"  # a GBNF grammar (`root ::= ...`, the EBNF dialect of llama.cpp and vLLM's grammars)


@dataclass(frozen=True)
class ResponseFormat:
    """What a job's output must be. `source` is the schema (JSON text), regex or grammar."""

    kind: GrammarKind
    source: str

    def validate(self) -> None:
        if not self.source:
            raise InvalidRequestError(
                f"response_format: the {self.kind.value} must not be empty", "response_format"
            )
        if len(self.source) > MAX_GRAMMAR_CHARS:
            raise InvalidRequestError(
                f"response_format: the {self.kind.value} has {len(self.source)} characters, "
                f"more than {MAX_GRAMMAR_CHARS}",
                "response_format",
            )

    @staticmethod
    def json_schema(schema: object) -> ResponseFormat:
        """From a parsed schema (dict) or its JSON text."""
        return ResponseFormat(
            GrammarKind.JSON_SCHEMA, schema if isinstance(schema, str) else json.dumps(schema)
        )
