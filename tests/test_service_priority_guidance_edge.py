"""GenerateRequest.priority and GenerateRequest.guidance at the edge: the front end's checks (each
refusal INVALID_ARGUMENT naming the field, the server serving on), the negative prompt tokenized in
the front end and carried to the engine as token ids (the codec), the Python client's Request and
CLI flags, and the tenant cap on jobs of priority > 0 (--max-priority-jobs) with authentication on.
What the engine does with either setting is tested with the engine."""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator

import grpc
import pytest

from dyngen_client import Chat, Client, Guidance, Request, collect, error_details
from dyngen_client.cli import CliError, add_request_arguments, guidance_flags
from dyngen_client.errors import ErrorReason
from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from engine.errors import InvalidRequestError
from engine.jobs import MAX_PRIORITY
from engine.prompt.guidance import Guidance as EngineGuidance
from service.config import ServiceConfig
from service.frontend.codec import job_spec
from service.frontend.limits import (
    Limits,
    ModelBounds,
    RequestError,
    check_negative_prompt_ids,
    check_request,
)
from tests.service_harness import ServerProcess, start_tiny_server
from tests.tiny_service_model import SERVICE_SPEC, write_servable_tiny_gguf

pytestmark = pytest.mark.timeout(300)

ALICE, BOB = "alice-token-0123456789", "bob-token-9876543210xx"


def _guided(scale: float, negative: str | Chat | list[int], priority: int = 0) -> pb.GenerateRequest:
    return Request("Hello", guidance=Guidance(scale, negative), priority=priority).to_proto()


def _refusal(req: pb.GenerateRequest) -> RequestError:
    with pytest.raises(RequestError) as info:
        check_request(req, Limits(max_prompt_chars=100))
    return info.value


# -- the checks before tokenizing (no server) ------------------------------------------------------


@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf, -0.5, 100.5, 1e9])
def test_a_bad_scale_names_guidance_scale(scale: float) -> None:
    error = _refusal(_guided(scale, "boring"))
    assert error.field == "guidance.scale" and "guidance.scale" in str(error)


def test_an_unset_scale_is_refused_not_taken_as_zero() -> None:
    req = Request("Hello").to_proto()
    req.guidance.text = "boring"  # guidance set, its scale not
    error = _refusal(req)
    assert error.field == "guidance.scale" and "must be set" in str(error)


@pytest.mark.parametrize("scale", [0.0, 1.0, 1.5, 100.0])
def test_scales_in_range_pass(scale: float) -> None:
    check_request(_guided(scale, "boring"), Limits())


def test_a_missing_or_empty_negative_prompt_names_it() -> None:
    no_prompt = Request("Hello").to_proto()
    no_prompt.guidance.scale = 2.0  # guidance set, its oneof not
    for req in (no_prompt, _guided(2.0, ""), _guided(2.0, [])):
        error = _refusal(req)
        assert error.field == "guidance.negative_prompt" and "guidance.negative_prompt" in str(error)
    error = _refusal(_guided(2.0, Chat(())))
    assert error.field == "guidance.chat.messages"


def test_a_negative_prompt_has_the_prompts_size_limits() -> None:
    error = _refusal(_guided(2.0, "x" * 101))
    assert (error.field, error.reason) == ("guidance.text", ErrorReason.LIMIT_EXCEEDED)
    error = _refusal(_guided(2.0, Chat((("user", "x" * 101),))))
    assert (error.field, error.reason) == ("guidance.chat.messages", ErrorReason.LIMIT_EXCEEDED)
    with pytest.raises(RequestError) as info:
        check_request(_guided(2.0, [1, 2, 3]), Limits(max_prompt_tokens=2))
    assert info.value.field == "guidance.token_ids.ids"


@pytest.mark.parametrize("priority", [MAX_PRIORITY + 1, -MAX_PRIORITY - 1, 2**31 - 1, -(2**31)])
def test_a_priority_out_of_range_names_priority(priority: int) -> None:
    error = _refusal(Request("Hello", priority=priority).to_proto())
    assert error.field == "priority" and str(error).startswith("priority")


def test_priorities_in_range_pass() -> None:
    for priority in (-MAX_PRIORITY, -1, 0, 1, MAX_PRIORITY):
        check_request(Request("Hello", priority=priority).to_proto(), Limits())


def test_the_negative_ids_are_checked_as_the_engine_checks_a_prompt() -> None:
    bounds = ModelBounds(vocab_size=100, context_length=50, cache_tokens=80, hidden_size=8)
    check_negative_prompt_ids([0, 99], 48, bounds)
    cases = [
        ([], 10, "guidance.negative_prompt", ErrorReason.INVALID_ARGUMENT),
        ([5, 100], 10, "guidance.token_ids.ids", ErrorReason.INVALID_ARGUMENT),
        ([1, 2, 3], 48, "guidance.negative_prompt", ErrorReason.PROMPT_TOO_LONG),
    ]
    for ids, max_new, field, reason in cases:
        with pytest.raises(RequestError) as info:
            check_negative_prompt_ids(ids, max_new, bounds)
        assert (info.value.field, info.value.reason) == (field, reason)
    with pytest.raises(RequestError, match="whole KV cache of 40"):
        check_negative_prompt_ids([1] * 30, 20, ModelBounds(100, 50, 40, 8))


# -- the client's Request, the codec, the flags ----------------------------------------------------


def test_the_request_carries_each_kind_of_negative_prompt() -> None:
    text = _guided(2.5, "dull", priority=7)
    assert text.priority == 7 and text.guidance.scale == 2.5 and text.guidance.text == "dull"
    chat = _guided(2.0, Chat.user("dull"))
    assert [(m.role, m.content) for m in chat.guidance.chat.messages] == [("user", "dull")]
    ids = _guided(0.0, [4, 5])
    assert ids.HasField("guidance") and list(ids.guidance.token_ids.ids) == [4, 5]
    plain = Request("Hello").to_proto()
    assert plain.priority == 0 and not plain.HasField("guidance")


def test_the_codec_round_trip() -> None:
    req = _guided(3.0, [7, 8, 9], priority=-12)
    wire = pb.GenerateRequest.FromString(req.SerializeToString())
    spec = job_spec(wire, [1, 2], [7, 8, 9])  # as the front end builds it: both prompts tokenized
    assert spec.prompt_ids == (1, 2) and spec.priority == -12
    assert spec.guidance == EngineGuidance(3.0, (7, 8, 9))
    plain = pb.GenerateRequest()
    assert job_spec(plain, [1]).guidance is None and job_spec(plain, [1]).priority == 0
    text = _guided(3.0, "not tokenized")
    with pytest.raises(InvalidRequestError, match="negative prompt is not tokenized"):
        job_spec(text, [1])


def _flags(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_request_arguments(parser)
    return parser.parse_args(["hi", *argv])


def test_the_cli_flags() -> None:
    assert guidance_flags(_flags()) is None and _flags().priority == 0
    assert guidance_flags(_flags("--negative-prompt", "dull")) == (1.5, "dull")
    args = _flags("--negative-prompt", "dull", "--guidance-scale", "3", "--priority", "-4")
    assert guidance_flags(args) == (3.0, "dull") and args.priority == -4
    with pytest.raises(CliError, match="--guidance-scale needs --negative-prompt"):
        guidance_flags(_flags("--guidance-scale", "3"))


def test_the_tenant_cap_default_is_defined_once() -> None:
    assert ServiceConfig().max_priority_jobs == 4


# -- a real server with two tenants ----------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("priority_guidance")
    model = write_servable_tiny_gguf(folder / "tiny.gguf")
    tokens = folder / "tokens"
    tokens.write_text(f"alice {ALICE}\nbob {BOB}\n")
    s = start_tiny_server(model, "--auth-tokens-file", str(tokens), "--max-batch-size", "2")
    yield s
    assert s.stop() == 0


def _refused(client: Client, request: Request) -> tuple[grpc.StatusCode, ErrorReason | None, list[str], str]:
    with pytest.raises(grpc.RpcError) as info:
        collect(client.generate(request, timeout=60))
    d = error_details(info.value)
    return d.code, d.reason, [v.field for v in d.field_violations], d.message


def _end(client: Client, job: str, cancel: bool = True) -> None:
    """Cancel an enqueued job and read its stream (the server then holds nothing of it)."""
    if cancel:
        client.cancel(job, timeout=10)
    assert collect(client.stream(job, timeout=60)).finished.stop_reason == pb.STOP_REASON_CANCELLED


def test_bad_values_are_invalid_argument_naming_the_field(server: ServerProcess) -> None:
    vocab = SERVICE_SPEC.vocab_size
    context = SERVICE_SPEC.context_length
    cases: list[tuple[Request, str, ErrorReason]] = [
        (Request("Hi", guidance=Guidance(math.nan, "dull")), "guidance.scale", ErrorReason.INVALID_ARGUMENT),
        (Request("Hi", guidance=Guidance(math.inf, "dull")), "guidance.scale", ErrorReason.INVALID_ARGUMENT),
        (Request("Hi", guidance=Guidance(-1.0, "dull")), "guidance.scale", ErrorReason.INVALID_ARGUMENT),
        (Request("Hi", guidance=Guidance(101.0, "dull")), "guidance.scale", ErrorReason.INVALID_ARGUMENT),
        (Request("Hi", guidance=Guidance(2.0, "")), "guidance.negative_prompt", ErrorReason.INVALID_ARGUMENT),
        (Request("Hi", guidance=Guidance(2.0, [])), "guidance.negative_prompt", ErrorReason.INVALID_ARGUMENT),
        (
            Request("Hi", guidance=Guidance(2.0, [1, vocab])),
            "guidance.token_ids.ids",
            ErrorReason.INVALID_ARGUMENT,
        ),
        (
            Request("Hi", max_new_tokens=200, guidance=Guidance(2.0, [1] * (context - 100))),
            "guidance.negative_prompt",
            ErrorReason.PROMPT_TOO_LONG,
        ),
        (Request("Hi", priority=MAX_PRIORITY + 1), "priority", ErrorReason.INVALID_ARGUMENT),
        (Request("Hi", priority=-MAX_PRIORITY - 1), "priority", ErrorReason.INVALID_ARGUMENT),
    ]
    with Client(server.target, token=ALICE) as a:
        for request, field, reason in cases:
            code, got_reason, fields, message = _refused(a, request)
            assert (code, got_reason, fields) == (grpc.StatusCode.INVALID_ARGUMENT, reason, [field]), message
            assert field.split(".")[0] in message
        # The server serves on, and takes guidance given each way, the negative text tokenized here.
        done = collect(a.generate(Request("Hi", max_new_tokens=3, ignore_eos=True), timeout=60))
        assert done.finished.new_tokens == 3
        negatives: list[str | Chat | list[int]] = ["dull", Chat.user("dull"), [1, 2, 3]]
        for negative in negatives:
            guided = Request("Hi", max_new_tokens=3000, ignore_eos=True, guidance=Guidance(2.0, negative))
            _end(a, a.enqueue(guided, timeout=60))


def test_a_tenant_has_at_most_max_priority_jobs_above_zero(server: ServerProcess) -> None:
    def long_job(priority: int) -> Request:
        return Request("Hi", max_new_tokens=3000, ignore_eos=True, priority=priority)

    with Client(server.target, token=ALICE) as a, Client(server.target, token=BOB) as b:
        mine = [a.enqueue(long_job(p), timeout=60) for p in (1, 5, 1000, 2)]
        try:
            code, reason, _, message = _refused(a, long_job(1))
            assert (code, reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, ErrorReason.PRIORITY_LIMIT)
            assert "priority" in message and "4" in message and "\n" not in message
            theirs = b.enqueue(long_job(3), timeout=60)  # another tenant's count is its own
            mine.append(a.enqueue(long_job(0), timeout=60))  # priority <= 0 is never capped
            mine.append(a.enqueue(long_job(-7), timeout=60))
            _end(b, theirs)
            cancelled = mine.pop(0)
            a.cancel(cancelled)  # a cancelled job no longer counts (before the engine has ended it)
            mine.append(a.enqueue(long_job(9), timeout=60))
            code, reason, _, _ = _refused(a, long_job(9))
            assert reason == ErrorReason.PRIORITY_LIMIT
            _end(a, cancelled, cancel=False)
            _end(a, mine.pop(0))  # nor does one that ended
            mine.append(a.enqueue(long_job(9), timeout=60))
        finally:
            for job in mine:
                _end(a, job)
