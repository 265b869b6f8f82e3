"""Fuzz the live service: hypothesis draws requests over every field, with valid, boundary and
hostile values, and sends them to a real `dyngen serve` (tiny random-weight model, 127.0.0.1).

Every reply must be OK or a clear status (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, NOT_FOUND,
FAILED_PRECONDITION, DEADLINE_EXCEEDED, CANCELLED): never UNKNOWN, INTERNAL or UNAVAILABLE,
never a traceback in the message. A stream that ends OK ends with exactly one JobFinished.
The engine process is never restarted (one `engine_starting` log record per test), and after
each test every page is free or cached and no job runs or waits.

Cheap by construction: max_new_tokens is small in most examples, each call has a deadline,
and the example counts are fixed (hypothesis is derandomized by tests/conftest.py).
Shrinking is off (an engine crash costs a restart per shrink step); set
DYNGEN_FUZZ_SHRINK=1 to shrink a failure to a minimal request.
"""

from __future__ import annotations

import math
import os
import random
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypeVar

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from dyngen_client import Client
from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from engine.model.tokenizer import ChatMessage, HFTokenizer
from tests.service_harness import ServerProcess, is_idle, log_count, start_tiny_server, wait_pool_idle
from tests.tiny_service_model import SERVICE_SPEC, write_servable_tiny_gguf

pytestmark = [pytest.mark.timeout(600)]

T = TypeVar("T")
Code = grpc.StatusCode

ALLOWED = frozenset(
    {
        Code.OK,
        Code.INVALID_ARGUMENT,
        Code.RESOURCE_EXHAUSTED,
        Code.NOT_FOUND,
        Code.FAILED_PRECONDITION,
        Code.DEADLINE_EXCEEDED,
        Code.CANCELLED,
    }
)
CALL_TIMEOUT = 3.0
VOCAB = SERVICE_SPEC.vocab_size
CONTEXT = SERVICE_SPEC.context_length
SERVICE = "/dyngen.v1.Generator/"
SHRINK = os.environ.get("DYNGEN_FUZZ_SHRINK") == "1"


def fuzz_settings(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        deadline=None,
        phases=tuple(Phase) if SHRINK else (Phase.explicit, Phase.generate),
        suppress_health_check=list(HealthCheck),
        database=None,
    )


# -- the server -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = write_servable_tiny_gguf(tmp_path_factory.mktemp("fuzz") / "tiny.gguf")
    s = start_tiny_server(model, "--stream-grace-seconds", "2")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[Client]:
    # Large enough to send the oversize examples: the server, not the client, must refuse them.
    with Client(server.target, max_message_bytes=64 << 20) as c:
        yield c


def assert_intact_and_idle(server: ServerProcess, client: Client, starts: int) -> None:
    server.wait_serving(90.0)  # wait out a restart an earlier failing example caused
    info = wait_pool_idle(client, timeout=10)
    assert is_idle(info), f"pool not idle after the fuzz: {info}"
    assert log_count(server, "engine_starting") == starts, "the engine was restarted during the fuzz"


@dataclass(frozen=True)
class Reply:
    rpc: str
    code: grpc.StatusCode
    details: str
    events: tuple[pb.GenerateEvent, ...] = ()


def check(replies: Sequence[Reply], server: ServerProcess, starts: int, what: object) -> None:
    for r in replies:
        assert r.code in ALLOWED, f"{r.rpc} -> {r.code.name} {r.details!r} for {_short(what)}"
        assert "Traceback" not in r.details, f"{r.rpc}: traceback in {r.details!r}"
        if r.code == Code.INVALID_ARGUMENT:
            assert r.details.strip(), f"{r.rpc}: INVALID_ARGUMENT without a message"
        if r.code == Code.OK and r.events:
            finishes = [e for e in r.events if e.HasField("finished")]
            assert len(finishes) == 1 and r.events[-1].HasField("finished"), (
                f"{r.rpc}: OK stream with {len(finishes)} JobFinished, last event "
                f"{r.events[-1].WhichOneof('event')}, for {_short(what)}"
            )
            reason = pb.StopReason.Name(finishes[0].finished.stop_reason)
            assert reason not in ("STOP_REASON_UNSPECIFIED", "STOP_REASON_ERROR"), (r.rpc, reason)
    assert log_count(server, "engine_starting") == starts, f"the engine restarted after {_short(what)}"


def _short(what: object, limit: int = 600) -> str:
    text = repr(what) if not isinstance(what, pb.GenerateRequest | pb.TokenizeRequest) else _describe(what)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def _describe(msg: pb.GenerateRequest | pb.TokenizeRequest) -> str:
    """The message's set fields, long strings and lists abbreviated."""
    parts: list[str] = []
    for f, value in msg.ListFields():
        if f.is_repeated and len(value) > 8:
            parts.append(f"{f.name}=[{len(value)} items: {list(value[:3])!r}...]")
        elif isinstance(value, str) and len(value) > 80:
            parts.append(f"{f.name}={value[:40]!r}...({len(value)} chars)")
        else:
            parts.append(f"{f.name}={str(value).replace(chr(10), ' ')[:300]}")
    return f"{type(msg).__name__}({', '.join(parts)})"


def _rpc_error(rpc: str, exc: grpc.RpcError, events: Sequence[pb.GenerateEvent] = ()) -> Reply:
    return Reply(rpc, exc.code(), exc.details() or "", tuple(events))


def stream_events(rpc: str, call: Iterator[pb.GenerateEvent]) -> Reply:
    events: list[pb.GenerateEvent] = []
    try:
        for event in call:
            events.append(event)
    except grpc.RpcError as exc:
        return _rpc_error(rpc, exc, events)
    return Reply(rpc, Code.OK, "", tuple(events))


# -- value pools ----------------------------------------------------------------------------------


def rarely(
    common: st.SearchStrategy[T], rare: st.SearchStrategy[T], one_in: int = 12
) -> st.SearchStrategy[T]:
    """`common` mostly, `rare` one time in `one_in` (shrinks towards `common`)."""
    return st.integers(0, one_in - 1).flatmap(lambda k: rare if k == one_in - 1 else common)


U32_EDGES = (
    0,
    1,
    2,
    3,
    VOCAB - 1,
    VOCAB,
    VOCAB + 1,
    CONTEXT,
    CONTEXT + 1,
    2**31 - 1,
    2**31,
    2**32 - 2,
    2**32 - 1,
)
U64_EDGES = (0, 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1)
F32_EDGES = (
    0.0,
    -0.0,
    1.0,
    -1.0,
    0.5,
    1e-45,
    100.0,
    -100.0,
    100.0001,
    1e30,
    3.4e38,
    -3.4e38,
    math.inf,
    -math.inf,
    math.nan,
)
STRING_EDGES = (
    "",
    " ",
    "\x00",
    "\x00" * 64,
    "\ufeff",
    "\U0010ffff",
    "\u202e",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "{{ raise_exception('boom') }}",
    "{% for x in range(10**9) %}",
    "\n" * 500,
    "é" * 500,
    "🙂" * 300,
    "a" * 4097,
)
HUGE_SIZES = (64 << 10, 1 << 20, 3 << 20, 5 << 20)  # 5 MiB: over the server's 4 MiB message limit
ROLES = ("user", "system", "assistant", "tool", "function", "ipython", "", "USER", "<|im_start|>", "user\n")

u32 = st.one_of(st.sampled_from(U32_EDGES), st.integers(0, 2**32 - 1))
u64 = st.one_of(st.sampled_from(U64_EDGES), st.integers(0, 2**64 - 1))
f32 = st.one_of(st.sampled_from(F32_EDGES), st.floats(width=32, allow_nan=True, allow_infinity=True))
token = st.one_of(st.integers(0, VOCAB - 1), st.sampled_from(U32_EDGES))
huge_string = st.tuples(st.sampled_from(HUGE_SIZES), st.sampled_from("aé🙂 \n")).map(lambda p: p[1] * p[0])
string = rarely(st.one_of(st.sampled_from(STRING_EDGES), st.text(max_size=40)), huge_string, one_in=15)


def many(
    element: st.SearchStrategy[T], huge: Callable[[random.Random], T], huge_size: int
) -> st.SearchStrategy[list[T]]:
    """Short lists mostly; sometimes `huge_size` elements made from one seed (cheap to draw)."""
    made = st.integers(0, 2**32 - 1).map(lambda seed: _made(huge, huge_size, seed))
    return rarely(st.lists(element, max_size=5), made, one_in=15)


def _made(make: Callable[[random.Random], T], n: int, seed: int) -> list[T]:
    rng = random.Random(seed)
    return [make(rng) for _ in range(n)]


def _random_token(rng: random.Random) -> int:
    return rng.randrange(VOCAB) if rng.random() < 0.9 else rng.randrange(2**32)


tokens = many(token, _random_token, 20_000)
chat_messages = many(
    st.tuples(st.one_of(st.sampled_from(ROLES), string), string),
    lambda rng: (rng.choice(ROLES[:3]), "word " * rng.randrange(1, 5)),
    2_000,
)
stop_strings = many(string, lambda rng: "s" * rng.randrange(1, 64), 5_000)
logit_bias = many(st.tuples(token, f32), lambda rng: (_random_token(rng), rng.uniform(-150.0, 150.0)), 50_000)


def scalar(kind: int) -> st.SearchStrategy[object]:
    """A pool for a scalar proto field type (for fields added after this test was written)."""
    if kind == FieldDescriptor.TYPE_STRING:
        return string
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return f32
    if kind in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return u64
    if kind in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT32):
        return st.integers(-(2**31), 2**31 - 1)
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    return u32


# -- requests -------------------------------------------------------------------------------------

# Each field is valid most of the time and hostile now and then, so that about a third of the
# requests are valid as a whole and reach the engine (sampling, penalties, logprobs, stops).
HOSTILE_ONE_IN = 12
valid_text = st.text(st.characters(codec="utf-8"), min_size=1, max_size=60)
valid_token = st.integers(3, VOCAB - 1)
VALID_SAMPLING: dict[str, st.SearchStrategy[object]] = {
    "temperature": st.floats(0.0, 2.0, width=32),
    "top_k": st.integers(0, 100),
    "top_p": st.floats(0.125, 1.0, width=32),
    "min_p": st.floats(0.0, 0.875, width=32),
    "typical": st.floats(0.125, 1.0, width=32),
    "repetition_penalty": st.floats(0.5, 2.0, width=32),
    "frequency_penalty": st.floats(-2.0, 2.0, width=32),
    "presence_penalty": st.floats(-2.0, 2.0, width=32),
    "seed": u64,
}


def field_value(valid: st.SearchStrategy[T], hostile: st.SearchStrategy[T]) -> st.SearchStrategy[T]:
    return rarely(valid, hostile, HOSTILE_ONE_IN)


@st.composite
def sampling_settings(draw: st.DrawFn) -> pb.SamplingSettings:
    s = pb.SamplingSettings()
    for f in pb.SamplingSettings.DESCRIPTOR.fields:  # every scalar field, present or future
        if f.is_repeated or not draw(st.booleans()):
            continue
        setattr(s, f.name, draw(field_value(VALID_SAMPLING.get(f.name, scalar(f.type)), scalar(f.type))))
    valid_bias = st.lists(st.tuples(valid_token, st.floats(-100.0, 100.0, width=32)), max_size=4)
    for t, b in draw(field_value(valid_bias, logit_bias)):
        s.logit_bias.add(token_id=t, bias=b)
    everything = st.just(list(range(VOCAB)))
    s.banned_token_ids.extend(
        draw(field_value(st.lists(valid_token, max_size=4), st.one_of(tokens, everything)))
    )
    return s


VALID_REQUEST: dict[str, st.SearchStrategy[object]] = {
    "min_new_tokens": st.integers(0, 2),
    "top_logprobs": st.integers(0, 20),
    "identifier": st.text(max_size=20),
    "cache_salt": st.text(max_size=20),
}
REQUEST_HANDLED = {
    "text",
    "chat",
    "token_ids",
    "sampling",
    "max_new_tokens",
    "stop_token_ids",
    "stop_strings",
}


HIDDEN = SERVICE_SPEC.hidden_size
u32 = st.sampled_from(U32_EDGES)


def add_guidance(draw: st.DrawFn, req: pb.GenerateRequest) -> None:
    """A negative prompt (text or token ids, or none) and a scale: in range, unset or hostile."""
    scale = draw(field_value(st.floats(0.0, 100.0, width=32), st.floats(width=32)))
    if draw(st.integers(0, 7)):
        req.guidance.scale = scale
    match draw(st.sampled_from(("text", "token_ids", "none"))):
        case "text":
            req.guidance.text = draw(field_value(valid_text, string))
        case "token_ids":
            req.guidance.token_ids.SetInParent()
            req.guidance.token_ids.ids.extend(
                draw(field_value(st.lists(valid_token, min_size=1, max_size=12), tokens))
            )
        case _:
            req.guidance.SetInParent()


def add_embeddings(draw: st.DrawFn, req: pb.GenerateRequest) -> None:
    """Spans of float32 rows, mostly of the model's width and placed inside the prompt, sometimes not."""
    for _ in range(draw(st.integers(1, 3))):
        rows = draw(field_value(st.integers(1, 3), st.sampled_from((0, 1, 9000, *U32_EDGES))))
        width = draw(field_value(st.just(HIDDEN), st.sampled_from((0, 1, HIDDEN - 1, HIDDEN + 1))))
        values = draw(st.floats(-2.0, 2.0, width=32) | st.sampled_from((math.nan, math.inf)))
        span = req.embeddings.add(rows=rows, data=struct.pack("<f", values) * (min(rows, 4) * width))
        if draw(st.booleans()):
            span.position = draw(field_value(st.integers(0, 4), u32))
        elif draw(st.integers(0, 5)):
            span.placeholder_token_id = draw(field_value(valid_token, u32))


@st.composite
def generate_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    req = pb.GenerateRequest()
    form = draw(field_value(st.sampled_from(("chat", "text", "token_ids")), st.just("none")))
    hostile = draw(st.integers(0, HOSTILE_ONE_IN - 1)) == HOSTILE_ONE_IN - 1
    match form:
        case "text":
            req.text = draw(string if hostile else valid_text)
        case "chat":
            req.chat.SetInParent()
            valid_chat = st.lists(st.tuples(st.sampled_from(ROLES[:3]), valid_text), min_size=1, max_size=3)
            for role, content in draw(chat_messages if hostile else valid_chat):
                req.chat.messages.add(role=role, content=content)
        case "token_ids":
            req.token_ids.SetInParent()
            req.token_ids.ids.extend(
                draw(tokens if hostile else st.lists(valid_token, min_size=1, max_size=40))
            )
        case _:
            pass
    if draw(st.booleans()):
        req.sampling.CopyFrom(draw(sampling_settings()))
    # Small in most examples (each costs decode time); sometimes unset (256) or a boundary.
    max_new = draw(field_value(st.integers(1, 8), st.sampled_from((None, *U32_EDGES))))
    if max_new is not None:
        req.max_new_tokens = max_new
    req.stop_token_ids.extend(draw(field_value(st.lists(valid_token, max_size=3), tokens)))
    valid_stops = st.lists(st.text(min_size=1, max_size=8), max_size=3)
    req.stop_strings.extend(draw(field_value(valid_stops, stop_strings)))
    if draw(st.integers(0, 3)) == 0:
        add_guidance(draw, req)
    if draw(st.integers(0, 3)) == 0:
        add_embeddings(draw, req)
    if draw(st.integers(0, 5)) == 0:
        req.stop_on_loop.window = draw(field_value(st.integers(1, 16), u32))
        req.stop_on_loop.min_repetitions = draw(field_value(st.integers(2, 4), u32))
    for f in pb.GenerateRequest.DESCRIPTOR.fields:  # every other field, present or future
        if f.name in REQUEST_HANDLED or f.type == FieldDescriptor.TYPE_MESSAGE:
            continue
        pool = scalar(f.type)
        if f.is_repeated:
            getattr(req, f.name).extend(draw(st.lists(pool, max_size=3)))
        elif draw(st.booleans()):
            setattr(req, f.name, draw(field_value(VALID_REQUEST.get(f.name, pool), pool)))
    return req


def chat(*messages: tuple[str, str], max_new_tokens: int = 4) -> pb.GenerateRequest:
    req = pb.GenerateRequest(max_new_tokens=max_new_tokens)
    for role, content in messages:
        req.chat.messages.add(role=role, content=content)
    return req


def with_sampling(req: pb.GenerateRequest, **fields: float | int) -> pb.GenerateRequest:
    for name, value in fields.items():
        setattr(req.sampling, name, value)
    return req


MODES = ("generate", "generate", "generate", "enqueue_stream", "enqueue_cancel")


def send_generate(client: Client, req: pb.GenerateRequest, mode: str) -> list[Reply]:
    stub = client.stub
    if mode == "generate":
        return [stream_events("Generate", stub.Generate(req, timeout=CALL_TIMEOUT))]
    try:
        job_id = stub.Enqueue(req, timeout=CALL_TIMEOUT).job_id
    except grpc.RpcError as exc:
        return [_rpc_error("Enqueue", exc)]
    replies = [Reply("Enqueue", Code.OK, "")]
    if mode == "enqueue_stream":
        replies.append(
            stream_events("Stream", stub.Stream(pb.StreamRequest(job_id=job_id), timeout=CALL_TIMEOUT))
        )
        return replies
    try:
        stub.Cancel(pb.CancelRequest(job_id=job_id), timeout=CALL_TIMEOUT)
        replies.append(Reply("Cancel", Code.OK, ""))
    except grpc.RpcError as exc:
        reply = _rpc_error("Cancel", exc)
        # NOT_FOUND only if the job had already finished by itself (a tiny job can).
        replies.append(reply if reply.code != Code.NOT_FOUND else Reply("Cancel", Code.OK, ""))
    return replies


def test_fuzz_generate_requests(server: ServerProcess, client: Client) -> None:
    starts = log_count(server, "engine_starting")

    @fuzz_settings(max_examples=150)
    @given(req=generate_requests(), mode=st.sampled_from(MODES))
    # Hostile cases that must always run, whatever hypothesis draws:
    @example(req=pb.GenerateRequest(), mode="generate")  # no prompt
    @example(req=chat(("tool", "hi")), mode="generate")  # the chat template raises
    @example(req=chat(("tool", "hi")), mode="enqueue_stream")
    @example(
        req=pb.GenerateRequest(chat=pb.ChatPrompt(), max_new_tokens=1), mode="generate"
    )  # chat, no message
    @example(req=pb.GenerateRequest(text="", max_new_tokens=1), mode="generate")
    @example(req=with_sampling(chat(("user", "hi")), temperature=math.nan), mode="generate")
    @example(req=with_sampling(chat(("user", "hi")), top_p=math.inf, temperature=1.0), mode="generate")
    @example(
        req=pb.GenerateRequest(token_ids=pb.TokenIds(ids=[2**32 - 1]), max_new_tokens=1), mode="generate"
    )
    @example(req=pb.GenerateRequest(text="hi", max_new_tokens=0), mode="generate")
    @example(req=pb.GenerateRequest(text="hi", max_new_tokens=2**32 - 1, ignore_eos=True), mode="generate")
    @example(req=pb.GenerateRequest(text="hi", max_new_tokens=2, min_new_tokens=2**32 - 1), mode="generate")
    @example(req=pb.GenerateRequest(text="hi", max_new_tokens=2, top_logprobs=2**32 - 1), mode="generate")
    @example(req=pb.GenerateRequest(text="hi", max_new_tokens=2, stop_strings=[""]), mode="generate")
    @example(
        req=pb.GenerateRequest(text="hi", max_new_tokens=2, stop_strings=["s"] * 100_000), mode="generate"
    )
    @example(req=pb.GenerateRequest(text="hi", max_new_tokens=2, identifier="i" * (1 << 20)), mode="generate")
    @example(req=pb.GenerateRequest(text="a" * (3 << 20), max_new_tokens=1), mode="generate")
    @example(req=pb.GenerateRequest(text="a" * (5 << 20), max_new_tokens=1), mode="generate")
    def one(req: pb.GenerateRequest, mode: str) -> None:
        server.wait_serving(90.0)
        before = log_count(server, "engine_starting")
        check(send_generate(client, req, mode), server, before, req)

    one()
    assert_intact_and_idle(server, client, starts)


@st.composite
def tokenize_requests(draw: st.DrawFn) -> pb.TokenizeRequest:
    req = pb.TokenizeRequest()
    match draw(st.sampled_from(("chat", "text", "none"))):
        case "text":
            req.text = draw(string)
        case "chat":
            req.chat.SetInParent()
            for role, content in draw(chat_messages):
                req.chat.messages.add(role=role, content=content)
        case _:
            pass
    return req


def test_fuzz_tokenize_requests(server: ServerProcess, client: Client) -> None:
    starts = log_count(server, "engine_starting")

    @fuzz_settings(max_examples=60)
    @given(req=tokenize_requests())
    @example(req=pb.TokenizeRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="tool", content="x")])))
    @example(req=pb.TokenizeRequest())
    @example(req=pb.TokenizeRequest(text="a" * (3 << 20)))
    def one(req: pb.TokenizeRequest) -> None:
        server.wait_serving(90.0)
        before = log_count(server, "engine_starting")
        try:
            client.stub.Tokenize(req, timeout=CALL_TIMEOUT)
            replies = [Reply("Tokenize", Code.OK, "")]
        except grpc.RpcError as exc:
            replies = [_rpc_error("Tokenize", exc)]
        check(replies, server, before, req)

    one()
    assert_intact_and_idle(server, client, starts)


# -- raw bytes ------------------------------------------------------------------------------------

UNARY = ("Enqueue", "Tokenize", "Cancel", "GetModelInfo")
STREAMING = ("Generate", "Stream")
SEEDS = (
    pb.GenerateRequest(text="Hello", max_new_tokens=3).SerializeToString(),
    chat(("user", "hi"), max_new_tokens=2).SerializeToString(),
    with_sampling(chat(("user", "x")), temperature=0.7, seed=3).SerializeToString(),
    pb.StreamRequest(job_id="0" * 32).SerializeToString(),
)


def _identity(data: bytes) -> bytes:
    return data


def raw_call(channel: grpc.Channel, method: str, body: bytes) -> Reply:
    """Send `body` as the request message exactly (identity serializers)."""
    if method in STREAMING:
        streaming = channel.unary_stream(SERVICE + method, _identity, _identity)
        call = streaming(body, timeout=CALL_TIMEOUT)
        try:
            for _ in call:
                pass
        except grpc.RpcError as exc:
            return _rpc_error(method, exc)
        return Reply(method, Code.OK, "")
    try:
        channel.unary_unary(SERVICE + method, _identity, _identity)(body, timeout=CALL_TIMEOUT)
    except grpc.RpcError as exc:
        return _rpc_error(method, exc)
    return Reply(method, Code.OK, "")


def _mutate(seed: bytes, edits: list[tuple[int, int]], cut: int) -> bytes:
    data = bytearray(seed)
    for at, value in edits:
        data[at % len(data)] = value
    return bytes(data[: max(0, len(data) - cut)])


raw_bodies = st.one_of(
    st.binary(max_size=300),
    st.builds(
        _mutate,
        st.sampled_from(SEEDS),
        st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4),
        st.integers(0, 4),
    ),
)


def test_fuzz_raw_bytes(server: ServerProcess, client: Client) -> None:
    starts = log_count(server, "engine_starting")
    channel = grpc.insecure_channel(server.target)

    @fuzz_settings(max_examples=120)
    @given(method=st.sampled_from(UNARY + STREAMING), body=raw_bodies)
    @example(method="Generate", body=b"\xff\xff\xff\xff")
    @example(method="Generate", body=b"\x0a\x05\xff\xfe\xfd\xfc\xfb")  # text = 5 bytes of invalid UTF-8
    @example(method="Enqueue", body=b"\x0a")  # truncated
    def one(method: str, body: bytes) -> None:
        server.wait_serving(90.0)
        before = log_count(server, "engine_starting")
        check([raw_call(channel, method, body)], server, before, (method, body))

    try:
        one()
    finally:
        channel.close()
    assert_intact_and_idle(server, client, starts)


# -- invalid UTF-8 in every string field ----------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (strings, bytes, messages) on the wire."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _chat_with(role: bytes, content: bytes) -> bytes:
    return _field(1, _field(1, role) + _field(2, content))  # ChatPrompt.messages[0]


def _appended(base: bytes, number: int, bad: bytes) -> bytes:
    return base + _field(number, bad)


def _chat_role(prefix: bytes, number: int, bad: bytes) -> bytes:
    return prefix + _field(number, _chat_with(bad, b"hi"))


def _chat_content(prefix: bytes, number: int, bad: bytes) -> bytes:
    return prefix + _field(number, _chat_with(b"user", bad))


def utf8_cases() -> dict[str, tuple[str, Callable[[bytes], bytes]]]:
    """Name -> (method, function of the bad bytes giving the whole request body)."""
    base = pb.GenerateRequest(text="hi", max_new_tokens=1).SerializeToString()
    one_token = pb.GenerateRequest(max_new_tokens=1).SerializeToString()
    fields = pb.GenerateRequest.DESCRIPTOR.fields_by_name
    strings = [n for n in ("text", "stop_strings", "identifier", "cache_salt") if n in fields]
    chat_number = fields["chat"].number
    cases: dict[str, tuple[str, Callable[[bytes], bytes]]] = {}
    for rpc in ("Generate", "Enqueue"):
        for name in strings:
            cases[f"{rpc}.{name}"] = (rpc, partial(_appended, base, fields[name].number))
        cases[f"{rpc}.chat.role"] = (rpc, partial(_chat_role, one_token, chat_number))
        cases[f"{rpc}.chat.content"] = (rpc, partial(_chat_content, one_token, chat_number))
    cases["Tokenize.text"] = ("Tokenize", partial(_appended, b"", 1))
    cases["Tokenize.chat.role"] = ("Tokenize", partial(_chat_role, b"", 2))
    cases["Tokenize.chat.content"] = ("Tokenize", partial(_chat_content, b"", 2))
    cases["Stream.job_id"] = ("Stream", partial(_appended, b"", 1))
    cases["Cancel.job_id"] = ("Cancel", partial(_appended, b"", 1))
    return cases


UTF8_CASES = utf8_cases()
INVALID_UTF8 = (
    b"\xff",
    b"\xc3\x28",
    b"\xed\xa0\x80",
    b"\xc0\xaf",
    b"\xe2\x82",
    b"\xf8\x88\x80\x80\x80",
    b"\x80",
)


def _around(pre: str, bad: bytes, post: str) -> bytes:
    return pre.encode() + bad + post.encode()


bad_utf8 = st.builds(
    _around,
    st.text(max_size=8),
    st.sampled_from(INVALID_UTF8),
    st.text(max_size=8),
)


def test_fuzz_invalid_utf8_is_invalid_argument(server: ServerProcess, client: Client) -> None:
    starts = log_count(server, "engine_starting")
    channel = grpc.insecure_channel(server.target)

    @fuzz_settings(max_examples=3 * len(UTF8_CASES))
    @given(case=st.sampled_from(sorted(UTF8_CASES)), bad=bad_utf8)
    def one(case: str, bad: bytes) -> None:
        server.wait_serving(90.0)
        before = log_count(server, "engine_starting")
        method, body = UTF8_CASES[case]
        reply = raw_call(channel, method, body(bad))
        assert reply.code == Code.INVALID_ARGUMENT, (
            f"{case} with {bad!r}: {reply.code.name} {reply.details!r}"
        )
        check([reply], server, before, (case, bad))

    try:
        one()
    finally:
        channel.close()
    assert_intact_and_idle(server, client, starts)


# -- hostile job ids ------------------------------------------------------------------------------

job_ids = st.one_of(
    st.text(max_size=64),
    st.binary(min_size=16, max_size=16).map(bytes.hex),  # well formed, unknown
    st.sampled_from(("", "0" * 32, "g" * 32, "A" * 33, "../../etc/passwd", "%s%n", "\x00" * 32, " " * 32)),
    st.sampled_from(("a" * (1 << 20), "é" * (1 << 19), "0" * (3 << 20))),
)


def test_fuzz_stream_and_cancel_with_hostile_job_ids(server: ServerProcess, client: Client) -> None:
    starts = log_count(server, "engine_starting")

    @fuzz_settings(max_examples=60)
    @given(job_id=job_ids, rpc=st.sampled_from(("Stream", "Cancel")))
    def one(job_id: str, rpc: str) -> None:
        server.wait_serving(90.0)
        before = log_count(server, "engine_starting")
        try:
            if rpc == "Stream":
                list(client.stub.Stream(pb.StreamRequest(job_id=job_id), timeout=CALL_TIMEOUT))
            else:
                client.stub.Cancel(pb.CancelRequest(job_id=job_id), timeout=CALL_TIMEOUT)
            reply = Reply(rpc, Code.OK, "")
        except grpc.RpcError as exc:
            reply = _rpc_error(rpc, exc)
        assert reply.code in (Code.NOT_FOUND, Code.INVALID_ARGUMENT), (
            f"{rpc}({_short(job_id, 80)}) -> {reply.code.name} {reply.details[:200]!r}"
        )
        assert len(reply.details) < 4096, f"{rpc}: a {len(reply.details)}-character message echoes the id"
        check([reply], server, before, job_id[:80])

    one()
    assert_intact_and_idle(server, client, starts)


def test_tiny_model_file_round_trips(tmp_path: Path) -> None:
    """The fuzz model: vocabulary and chat template as the tests above assume."""
    tok = HFTokenizer(write_servable_tiny_gguf(tmp_path / "tiny.gguf"))
    assert tok.vocab_size == VOCAB
    assert tok.render_chat([ChatMessage("user", "hi")]).endswith("<|im_start|>assistant\n")
