"""dyngen-client: the torch-free Python client of dyngen's gRPC contract (dyngen.v1.Generator).

The names below are imported on first use, so that importing one part of the package (the
contract: `dyngen_client.proto`, `dyngen_client.errors`, `dyngen_client.affinity`, which the
server depends on) loads none of the client's conveniences.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dyngen_client.affinity import AFFINITY_HEADER, affinity_key
    from dyngen_client.client import AsyncClient, Client, tls_credentials
    from dyngen_client.errors import (
        ErrorDetails,
        ErrorReason,
        FieldViolation,
        StreamCutError,
        error_details,
        is_stream_cut,
    )
    from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
    from dyngen_client.request import (
        Chat,
        GbnfGrammar,
        Guidance,
        JsonSchema,
        LarkGrammar,
        Prompt,
        PromptEmbedding,
        Regex,
        Request,
        ResponseFormat,
        Sampling,
    )
    from dyngen_client.result import Event, Result, acollect, collect, stop_reason_name

_WHERE = {
    "AFFINITY_HEADER": "affinity",
    "affinity_key": "affinity",
    "AsyncClient": "client",
    "Client": "client",
    "tls_credentials": "client",
    "ErrorDetails": "errors",
    "ErrorReason": "errors",
    "FieldViolation": "errors",
    "StreamCutError": "errors",
    "error_details": "errors",
    "is_stream_cut": "errors",
    "Chat": "request",
    "Guidance": "request",
    "JsonSchema": "request",
    "GbnfGrammar": "request",
    "LarkGrammar": "request",
    "Prompt": "request",
    "PromptEmbedding": "request",
    "Regex": "request",
    "Request": "request",
    "ResponseFormat": "request",
    "Sampling": "request",
    "Event": "result",
    "Result": "result",
    "collect": "result",
    "acollect": "result",
    "stop_reason_name": "result",
}

__all__ = [
    "AFFINITY_HEADER",
    "AsyncClient",
    "Chat",
    "Client",
    "ErrorDetails",
    "ErrorReason",
    "Event",
    "FieldViolation",
    "GbnfGrammar",
    "Guidance",
    "JsonSchema",
    "LarkGrammar",
    "Prompt",
    "PromptEmbedding",
    "Regex",
    "Request",
    "ResponseFormat",
    "Result",
    "Sampling",
    "StreamCutError",
    "acollect",
    "affinity_key",
    "collect",
    "error_details",
    "is_stream_cut",
    "pb",
    "stop_reason_name",
    "tls_credentials",
]


def __getattr__(name: str) -> object:
    if name == "pb":
        return importlib.import_module("dyngen_client.proto.dyngen.v1.generator_pb2")
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'dyngen_client' has no attribute {name!r}")
    return getattr(importlib.import_module(f"dyngen_client.{module}"), name)
