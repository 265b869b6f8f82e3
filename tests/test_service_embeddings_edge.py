"""GenerateRequest.embeddings at the edge: the front end's checks (each bad span INVALID_ARGUMENT
naming its field, the server serving on), GetModelInfo's hidden_size, the codec's placement (the
job's prompt expanded at placeholders, the spans at their positions), the Python client's
PromptEmbedding, and the field an engine refusal about an embedding is blamed on. What the engine
does with the vectors is tested with the engine (tests/test_prompt_embeddings.py)."""

from __future__ import annotations

import struct
from collections.abc import Iterator

import grpc
import pytest

from dyngen_client import Client, PromptEmbedding, Request, collect, error_details
from dyngen_client.errors import ErrorReason
from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from engine.errors import InvalidRequestError
from engine.jobs import JobSpec
from engine.prompt.prompt_embeddings import (
    MAX_EMBEDDING_ROWS,
    MAX_PROMPT_EMBEDDINGS,
    EmbeddingPlacement,
    check_embeddings,
    place_embeddings,
)
from engine.prompt.prompt_embeddings import PromptEmbedding as Span
from service.frontend.codec import job_spec
from service.frontend.limits import (
    Limits,
    ModelBounds,
    RequestError,
    check_prompt_embeddings,
    check_request,
)
from tests.service_harness import ServerProcess, start_tiny_server
from tests.tiny_service_model import SERVICE_SPEC, write_servable_tiny_gguf

pytestmark = pytest.mark.timeout(300)

HIDDEN = SERVICE_SPEC.hidden_size
PROMPT = [1, 40, 41, 42, 43, 44, 45, 46]  # token ids of the tiny model's vocabulary
HOLE = 300  # a placeholder token id


def rows(n: int, width: int = HIDDEN, value: float = 0.25) -> list[list[float]]:
    return [[value + r] * width for r in range(n)]


def at(position: int, n: int = 1, width: int = HIDDEN) -> PromptEmbedding:
    return PromptEmbedding(rows(n, width), position=position)


def hole(n: int = 1, token: int = HOLE) -> PromptEmbedding:
    return PromptEmbedding(rows(n), placeholder_token_id=token)


def _unplaced(n: int = 1) -> pb.GenerateRequest:
    req = Request(PROMPT).to_proto()
    req.embeddings.add(data=bytes(4 * HIDDEN * n), rows=n)  # neither position nor placeholder
    return req


# -- the client's PromptEmbedding, the codec -------------------------------------------------------


def test_the_client_packs_float32_little_endian_row_major() -> None:
    e = PromptEmbedding([[1.0, -2.5], [0.5, 3.0]], position=4).to_proto()
    assert (e.rows, e.position, e.WhichOneof("placement")) == (2, 4, "position")
    assert e.data == struct.pack("<4f", 1.0, -2.5, 0.5, 3.0)
    packed = PromptEmbedding(e.data, placeholder_token_id=7, rows=2).to_proto()
    assert (packed.data, packed.rows, packed.placeholder_token_id) == (e.data, 2, 7)
    assert packed.WhichOneof("placement") == "placeholder_token_id"
    req = Request([1, 2], embeddings=(PromptEmbedding([[0.0]], position=0),) * 2).to_proto()
    assert len(req.embeddings) == 2 and not Request([1]).to_proto().embeddings


def test_the_client_refuses_what_the_wire_cannot_say() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        PromptEmbedding([[0.0]])
    with pytest.raises(ValueError, match="exactly one"):
        PromptEmbedding([[0.0]], position=0, placeholder_token_id=3)
    with pytest.raises(ValueError, match="need rows"):
        PromptEmbedding(bytes(8), position=0)
    with pytest.raises(ValueError, match="rows=3"):
        PromptEmbedding([[0.0]], position=0, rows=3)
    with pytest.raises(ValueError, match="different widths"):
        PromptEmbedding([[0.0], [1.0, 2.0]], position=0).to_proto()


def test_the_codec_places_the_spans() -> None:
    a, b, c = hole(2), hole(3, token=301), hole(1)
    req = Request([1, HOLE, 40, 301, HOLE, 41], embeddings=(a, b, c)).to_proto()
    wire = pb.GenerateRequest.FromString(req.SerializeToString())
    spec = job_spec(wire, wire.token_ids.ids)
    assert spec.prompt_ids == (1, HOLE, HOLE, 40, 301, 301, 301, HOLE, 41)
    assert [(s.position, s.rows) for s in spec.embeddings] == [(1, 2), (4, 3), (7, 1)]
    assert [s.data for s in spec.embeddings] == [a.data(), b.data(), c.data()]
    by_position = Request(PROMPT, embeddings=(at(5, 2), at(1))).to_proto()
    spec = job_spec(by_position, by_position.token_ids.ids)
    assert spec.prompt_ids == tuple(PROMPT)
    assert [(s.position, s.rows) for s in spec.embeddings] == [(5, 2), (1, 1)]
    assert job_spec(Request(PROMPT).to_proto(), PROMPT).embeddings == ()
    with pytest.raises(InvalidRequestError, match=r"embeddings\[0\]\.placeholder_token_id"):
        job_spec(Request(PROMPT, embeddings=(hole(),)).to_proto(), PROMPT)


# -- the checks in the front end (no server) -------------------------------------------------------

BOUNDS = ModelBounds(vocab_size=512, context_length=64, cache_tokens=1000, hidden_size=HIDDEN)


def _refusal(request: Request | pb.GenerateRequest, max_new_tokens: int = 8) -> RequestError:
    req = request.to_proto() if isinstance(request, Request) else request
    with pytest.raises(RequestError) as info:
        check_request(req, Limits())
        check_prompt_embeddings(req, list(req.token_ids.ids), max_new_tokens, BOUNDS)
    return info.value


INVALID, LIMIT = ErrorReason.INVALID_ARGUMENT, ErrorReason.LIMIT_EXCEEDED

# (name, request, field, reason): each bad value the front end refuses, and the field it names.
BAD: list[tuple[str, Request | pb.GenerateRequest, str, ErrorReason]] = [
    (
        "wrong width",
        Request(PROMPT, embeddings=(at(0), at(2, width=HIDDEN + 1))),
        "embeddings[1].data",
        INVALID,
    ),
    (
        "rows 0",
        Request(PROMPT, embeddings=(PromptEmbedding(b"", position=1, rows=0),)),
        "embeddings[0].rows",
        INVALID,
    ),
    (
        "data of more rows",
        Request(PROMPT, embeddings=(PromptEmbedding(bytes(8 * HIDDEN), position=1, rows=1),)),
        "embeddings[0].data",
        INVALID,
    ),
    (
        "outside the prompt",
        Request(PROMPT, embeddings=(at(0), at(len(PROMPT) - 1, 2))),
        "embeddings[1].position",
        INVALID,
    ),
    ("past the prompt", Request(PROMPT, embeddings=(at(len(PROMPT)),)), "embeddings[0].position", INVALID),
    ("overlap", Request(PROMPT, embeddings=(at(4), at(1, 2), at(2))), "embeddings[2].position", INVALID),
    ("mixed placement", Request([1, HOLE], embeddings=(at(0), hole())), "embeddings", INVALID),
    ("no placement", _unplaced(), "embeddings[0].placement", INVALID),
    (
        "missing placeholder",
        Request([1, HOLE, 40], embeddings=(hole(), hole(2))),
        "embeddings[1].placeholder_token_id",
        INVALID,
    ),
    (
        "too many spans",
        Request(PROMPT, embeddings=(at(0),) * (MAX_PROMPT_EMBEDDINGS + 1)),
        "embeddings",
        LIMIT,
    ),
    (
        "too many rows",
        Request(PROMPT, embeddings=(PromptEmbedding(b"", position=0, rows=MAX_EMBEDDING_ROWS + 1),)),
        "embeddings",
        LIMIT,
    ),
    ("token healing", Request(PROMPT, token_healing=True, embeddings=(at(0),)), "token_healing", INVALID),
]


@pytest.mark.parametrize(("request_", "field", "reason"), [case[1:] for case in BAD], ids=[c[0] for c in BAD])
def test_each_bad_value_names_its_field(
    request_: Request | pb.GenerateRequest, field: str, reason: ErrorReason
) -> None:
    error = _refusal(request_)
    assert (error.field, error.reason) == (field, reason), str(error)
    assert str(error).startswith(field.split(".", maxsplit=1)[0])


def test_an_expanded_prompt_past_the_context_is_prompt_too_long() -> None:
    req = Request([1, HOLE, 40], embeddings=(hole(50),)).to_proto()
    check_prompt_embeddings(req, [1, HOLE, 40], 12, BOUNDS)  # 3 tokens expand to 52: + 12 fits 64
    error = _refusal(req, max_new_tokens=13)
    assert (error.field, error.reason) == ("embeddings", ErrorReason.PROMPT_TOO_LONG)
    assert "expands to 52" in str(error) and "context of 64" in str(error)
    with pytest.raises(RequestError, match="whole KV cache of 60"):
        check_prompt_embeddings(req, [1, HOLE, 40], 13, ModelBounds(512, 64, 60, HIDDEN))
    # A prompt too long before it expands is the engine's to refuse, as any prompt (PromptTooLong).
    check_prompt_embeddings(req, [1, HOLE, 40], 62, BOUNDS)


def test_spans_that_fit_pass() -> None:
    for request in (
        Request(PROMPT, embeddings=(at(6, 2), at(0, 3))),
        Request([1, HOLE, 40, HOLE], embeddings=(hole(5), hole(1))),
        Request(PROMPT, embeddings=tuple(at(i) for i in range(len(PROMPT)))),
    ):
        req = request.to_proto()
        check_request(req, Limits())
        check_prompt_embeddings(req, list(req.token_ids.ids), 8, BOUNDS)


def test_an_engine_refusal_names_the_field_of_its_message() -> None:
    """The engine checks the spans again (and their width at enqueue); its errors name the span's field."""
    d = bytes(4 * 4)
    cases: list[tuple[list[Span], str]] = [
        ([Span(0, 1, d), Span(5, 2, d + d)], "embeddings[1].position"),  # outside a prompt of 6
        ([Span(3, 1, d), Span(0, 1, d), Span(2, 2, d + d)], "embeddings[0].position"),  # overlap
        ([Span(0, 0, b"")], "embeddings[0].rows"),
        ([Span(0, 1, d + b"\x00")], "embeddings[0].data"),
        ([Span(0, 1, d)] * (MAX_PROMPT_EMBEDDINGS + 1), "embeddings"),
    ]
    for spans, field in cases:
        with pytest.raises(InvalidRequestError) as info:
            check_embeddings(spans, 6, None)
        assert info.value.field == field, str(info.value)
    with pytest.raises(InvalidRequestError) as info:
        check_embeddings([Span(0, 1, d)], 6, 8)
    assert info.value.field == "embeddings[0].data"
    with pytest.raises(InvalidRequestError) as info:
        place_embeddings([1], [EmbeddingPlacement(1, d)])
    assert info.value.field == "embeddings[0].placement"
    healed = JobSpec(prompt_ids=(1, 2, 3), token_healing=True, embeddings=(Span(0, 1, d),))
    with pytest.raises(InvalidRequestError, match="token_healing cannot be combined with embeddings") as info:
        healed.validate(512, 4)
    assert info.value.field == "token_healing"


# -- a real server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = write_servable_tiny_gguf(tmp_path_factory.mktemp("embeddings") / "tiny.gguf")
    s = start_tiny_server(model, "--max-batch-size", "2")
    yield s
    assert s.stop() == 0


def test_model_info_reports_the_hidden_size(server: ServerProcess) -> None:
    with Client(server.target) as client:
        assert client.model_info(timeout=30).hidden_size == HIDDEN


def test_bad_spans_are_invalid_argument_naming_the_field(server: ServerProcess) -> None:
    context = SERVICE_SPEC.context_length
    long = Request([1, HOLE, 40], max_new_tokens=context - 10, embeddings=(hole(20),))
    cases = [(request, field, reason) for _, request, field, reason in BAD]
    cases.append((long, "embeddings", ErrorReason.PROMPT_TOO_LONG))
    with Client(server.target) as client:
        for request, field, reason in cases:
            with pytest.raises(grpc.RpcError) as info:
                if isinstance(request, Request):
                    collect(client.generate(request, timeout=60))
                else:
                    client.stub.Enqueue(request, timeout=60)
            d = error_details(info.value)
            got = (d.code, d.reason, [v.field for v in d.field_violations])
            assert got == (grpc.StatusCode.INVALID_ARGUMENT, reason, [field]), d.message
            assert d.message.startswith(field.split(".")[0]) and "\n" not in d.message
        # The server serves on.
        done = collect(client.generate(Request("Hi", max_new_tokens=3, ignore_eos=True), timeout=60))
        assert done.finished.new_tokens == 3


def test_spans_that_fit_are_taken_and_prompt_tokens_counts_the_expansion(server: ServerProcess) -> None:
    request = Request(
        [1, HOLE, 40, HOLE], max_new_tokens=3000, ignore_eos=True, embeddings=(hole(5), hole(2))
    )
    with Client(server.target) as client:
        reply = client.stub.Enqueue(request.to_proto(), timeout=60)
        assert reply.prompt_tokens == 2 + 5 + 2
        client.cancel(reply.job_id, timeout=10)
        finished = collect(client.stream(reply.job_id, timeout=60)).finished
        assert finished.stop_reason == pb.STOP_REASON_CANCELLED
