"""dyngen-client: the torch-free Python client of dyngen's gRPC contract (dyngen.v1.Generator)."""

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
from dyngen_client.result import Event, Result, collect, stop_reason_name

__all__ = [
    "AFFINITY_HEADER",
    "AsyncClient",
    "Chat",
    "Client",
    "ErrorDetails",
    "ErrorReason",
    "Event",
    "FieldViolation",
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
    "affinity_key",
    "collect",
    "error_details",
    "is_stream_cut",
    "pb",
    "stop_reason_name",
    "tls_credentials",
]
