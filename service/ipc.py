"""Typed messages between the gRPC front end and the engine process.

Every message is bytes: a one-byte tag, an 8-byte request number (0 when unused) and a
payload: the engine's own types (JobSpec, JobEvent, EngineInfo, AdapterView) in MessagePack,
decoded into those types and checked against them (msgspec), or a small JSON object. The
public contract (dyngen.v1) never crosses the pipe: the front end alone translates to and
from it. Nothing is pickled, so nothing a caller sent can become code on either side.
"""

from __future__ import annotations

import enum
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from engine.cache.kv_events import AllBlocksCleared, BlocksRemoved, BlockStored, KvEvent
from engine.jobs import JobEvent, JobFinished, JobSpec, JobStarted, PrefillProgress, TokensGenerated

_HEADER = struct.Struct(">cQ")

HEARTBEAT_INTERVAL = 0.25  # seconds between the engine's heartbeats
JOB_ID_LENGTH = 32  # hex characters of a job id (128 random bits)


class Tag(enum.Enum):
    # front end -> engine
    SUBMIT = b"S"  # payload: Submit (job id minted by the front end + the checked JobSpec)
    CANCEL = b"C"  # payload: job id (ascii); no answer (the job's JobFinished follows)
    INFO = b"I"  # no payload; answered by INFO_REPLY
    ADAPTER = b"L"  # payload: JSON AdapterCommand; answered by ADAPTERS or REJECTED
    FLUSH = b"F"  # no payload; the cached prefix pages no job holds are dropped; answered by FLUSHED
    QUIT = b"Q"
    START = b"G"  # no payload; a spare engine (imports done, waiting) loads the model and serves
    # engine -> front end
    READY = b"R"  # payload: JSON Ready; the model is loaded and warmed up
    ACCEPTED = b"A"  # payload: JSON {"job_id": ..., "prompt_tokens": ...}
    REJECTED = b"X"  # payload: JSON {"code": ErrorCode value, "message": ...}
    EVENTS = b"E"  # payload: one iteration's JobEvents (pack_events)
    INFO_REPLY = b"N"  # payload: EngineInfo
    ADAPTERS = b"D"  # payload: the AdapterViews asked for (the loaded one, none, or all)
    STATS = b"M"  # payload: JSON EngineStats
    HEARTBEAT = b"H"  # payload: JSON Heartbeat, from a thread of its own every HEARTBEAT_INTERVAL
    KV_EVENTS = b"K"  # payload: the prefix cache's new KV events, in order (pack_kv_events)
    FLUSHED = b"U"  # payload: JSON {"dropped": pages}


class ErrorCode(enum.Enum):
    """Why the engine refused a request; the front end maps it to a gRPC status."""

    INVALID_ARGUMENT = "invalid_argument"
    PROMPT_TOO_LONG = "prompt_too_long"
    QUEUE_FULL = "queue_full"
    ADAPTER_NOT_FOUND = "adapter_not_found"
    ADAPTER_EXISTS = "adapter_exists"
    ADAPTER_IN_USE = "adapter_in_use"
    ADAPTER_LIMIT = "adapter_limit"
    ADAPTER_PATH = "adapter_path"  # a run-time load's path leaves the adapter folder
    FAILED_PRECONDITION = "failed_precondition"  # the server is not set up for it (run-time adapter loads)
    INTERNAL = "internal"


@dataclass(frozen=True)
class Message:
    tag: Tag
    request: int
    payload: bytes

    def encode(self) -> bytes:
        return _HEADER.pack(self.tag.value, self.request) + self.payload

    @staticmethod
    def decode(data: bytes) -> Message:
        tag, request = _HEADER.unpack_from(data)
        return Message(Tag(tag), request, data[_HEADER.size :])


_ENCODE = msgspec.msgpack.Encoder()
_EVENT_KINDS: tuple[
    type[JobStarted] | type[PrefillProgress] | type[TokensGenerated] | type[JobFinished], ...
] = (
    JobStarted,
    PrefillProgress,
    TokensGenerated,
    JobFinished,
)
_EVENT_KIND = {kind: i for i, kind in enumerate(_EVENT_KINDS)}
_EVENT_LIST = msgspec.msgpack.Decoder(list[tuple[int, msgspec.Raw]])
_EVENT_DECODERS = [msgspec.msgpack.Decoder(kind) for kind in _EVENT_KINDS]
_SPEC = msgspec.msgpack.Decoder(JobSpec)


def pack_events(events: Sequence[JobEvent]) -> bytes:
    """One pipe message for an iteration's events: fewer wake-ups of the front end per iteration."""
    return _ENCODE.encode([(_EVENT_KIND[type(e)], e) for e in events])


def unpack_events(data: bytes) -> list[JobEvent]:
    return [_EVENT_DECODERS[kind].decode(raw) for kind, raw in _EVENT_LIST.decode(data)]


_KV_KINDS: tuple[type[BlockStored] | type[BlocksRemoved] | type[AllBlocksCleared], ...] = (
    BlockStored,
    BlocksRemoved,
    AllBlocksCleared,
)
_KV_KIND = {kind: i for i, kind in enumerate(_KV_KINDS)}
_KV_DECODERS = [msgspec.msgpack.Decoder(kind) for kind in _KV_KINDS]


def pack_kv_events(events: Sequence[KvEvent]) -> bytes:
    """The KV events an iteration produced (or a snapshot: AllBlocksCleared, then every findable page)."""
    return _ENCODE.encode([(_KV_KIND[type(e)], e) for e in events])


def unpack_kv_events(data: bytes) -> list[KvEvent]:
    return [_KV_DECODERS[kind].decode(raw) for kind, raw in _EVENT_LIST.decode(data)]


@dataclass(frozen=True)
class Rejection:
    code: ErrorCode
    message: str
    field: str | None = None  # the JobSpec field to blame (InvalidRequestError.field)

    def to_bytes(self) -> bytes:
        return json.dumps({"code": self.code.value, "message": self.message, "field": self.field}).encode()

    @staticmethod
    def from_bytes(data: bytes) -> Rejection:
        obj = json.loads(data)
        field = obj.get("field")
        return Rejection(ErrorCode(obj["code"]), str(obj["message"]), None if field is None else str(field))


class AdapterOp(enum.Enum):
    LOAD = "load"
    UNLOAD = "unload"
    LIST = "list"


@dataclass(frozen=True)
class AdapterCommand:
    """Load (name, path), unload (name) or list the engine's LoRA adapters."""

    op: AdapterOp
    name: str = ""
    path: str = ""

    def to_bytes(self) -> bytes:
        return json.dumps({"op": self.op.value, "name": self.name, "path": self.path}).encode()

    @staticmethod
    def from_bytes(data: bytes) -> AdapterCommand:
        obj = json.loads(data)
        return AdapterCommand(AdapterOp(obj["op"]), str(obj["name"]), str(obj["path"]))


@dataclass(frozen=True)
class Submit:
    """A job for the engine: the id the front end minted and the JobSpec it built and checked (its
    prompt tokenized, its tenant, cache salt and adapter's engine name set)."""

    job_id: str
    spec: JobSpec

    def to_bytes(self) -> bytes:
        job = self.job_id.encode("ascii")
        if len(job) != JOB_ID_LENGTH:
            raise ValueError(f"job id must be {JOB_ID_LENGTH} characters")
        return job + _ENCODE.encode(self.spec)

    @staticmethod
    def from_bytes(data: bytes) -> Submit:
        return Submit(data[:JOB_ID_LENGTH].decode("ascii"), _SPEC.decode(data[JOB_ID_LENGTH:]))


@dataclass(frozen=True)
class EngineInfo:
    """What GetModelInfo reports of the engine: its model, limits and state at the moment."""

    model: str
    vocab_size: int
    context_length: int
    page_size: int
    num_pages: int
    max_batch_size: int
    max_queue_size: int
    max_chunk_size: int
    dtype: str
    queued_jobs: int
    running_jobs: int
    pages_free: int
    pages_cached: int
    pages_used: int
    quant: str
    linears: str
    cpu: str
    kv_cache: str
    max_adapters: int
    hidden_size: int
    device: str
    iterations: int

    def to_bytes(self) -> bytes:
        return _ENCODE.encode(self)

    @staticmethod
    def from_bytes(data: bytes) -> EngineInfo:
        return _INFO.decode(data)


@dataclass(frozen=True)
class AdapterView:
    """A loaded LoRA adapter as the engine reports it (ListAdapters, LoadAdapter's answer)."""

    name: str  # the engine's name (a tenant's adapters carry its scope)
    path: str  # how it was named: a run-time load's relative path; "" for the server's own
    description: str
    jobs: int
    shared: bool  # loaded by the server (--lora)


def pack_adapters(views: Sequence[AdapterView]) -> bytes:
    return _ENCODE.encode(list(views))


def unpack_adapters(data: bytes) -> list[AdapterView]:
    return _ADAPTERS.decode(data)


_INFO = msgspec.msgpack.Decoder(EngineInfo)
_ADAPTERS = msgspec.msgpack.Decoder(list[AdapterView])


@dataclass(frozen=True)
class Ready:
    """The engine is loaded and warmed up; the front end tokenizes with the tokenizer saved here."""

    model: str
    tokenizer_dir: str
    context_length: int
    linears: str  # which linear kernel runs per projection
    cpu: str  # the CPU features the kernels were chosen for
    kv_cache: str  # what the KV cache stores and its size (PagedKVCache.describe)
    kv_cache_dtype: str  # the dtype it stores K/V in ("bfloat16", "int8", ...: PagedKVCache.stored_dtype)
    vocab_size: int  # token ids are below this (the front end checks a negative prompt's ids)
    cache_tokens: int  # the whole KV cache in tokens (pages x page size)
    hidden_size: int  # the model's embedding width (the front end checks prompt embeddings' rows)
    device: str  # where the model runs (engine/device.py describe_device)
    page_size: int  # the KV cache's page size in tokens (a job's fit is counted in pages)
    prompt_slices: str  # how prompt slices beside decode steps are priced (PromptDepthCost.describe)
    # Seconds each part of the start took in the engine process (imports, model, warmup, tokenizer).
    start_seconds: dict[str, float] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        return json.dumps(self.__dict__).encode()

    @staticmethod
    def from_bytes(data: bytes) -> Ready:
        obj = json.loads(data)
        return Ready(
            str(obj["model"]),
            str(obj["tokenizer_dir"]),
            int(obj["context_length"]),
            str(obj["linears"]),
            str(obj["cpu"]),
            str(obj["kv_cache"]),
            str(obj["kv_cache_dtype"]),
            int(obj["vocab_size"]),
            int(obj["cache_tokens"]),
            int(obj["hidden_size"]),
            str(obj["device"]),
            int(obj["page_size"]),
            str(obj["prompt_slices"]),
            {str(k): float(v) for k, v in dict(obj.get("start_seconds", {})).items()},
        )


@dataclass(frozen=True)
class Heartbeat:
    """Sent by a thread of the engine's own: the process runs; `loop_age` says whether its loop does."""

    loop_age: float  # seconds since the engine loop last went round (0 before it starts)

    def to_bytes(self) -> bytes:
        return json.dumps({"loop_age": self.loop_age}).encode()

    @staticmethod
    def from_bytes(data: bytes) -> Heartbeat:
        return Heartbeat(float(json.loads(data)["loop_age"]))


@dataclass(frozen=True)
class Accepted:
    job_id: str
    prompt_tokens: int

    def to_bytes(self) -> bytes:
        return json.dumps({"job_id": self.job_id, "prompt_tokens": self.prompt_tokens}).encode()

    @staticmethod
    def from_bytes(data: bytes) -> Accepted:
        obj = json.loads(data)
        return Accepted(str(obj["job_id"]), int(obj["prompt_tokens"]))


@dataclass(frozen=True)
class EngineStats:
    queued: int
    running: int
    pages_free: int
    pages_cached: int
    pages_used: int
    forwarded_tokens: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    preemptions: int  # since this engine started

    def to_bytes(self) -> bytes:
        return json.dumps(self.__dict__).encode()

    @staticmethod
    def from_bytes(data: bytes) -> EngineStats:
        obj = json.loads(data)
        return EngineStats(**{k: int(obj[k]) for k in EngineStats.__dataclass_fields__})
