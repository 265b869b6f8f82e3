"""Behind a real gateway: the official OpenAI client through `smg launch` in front of two replicas.

The SMG gateway (a dev dependency) reaches each `dyngen serve` replica through the worker contract
(service/frontend/worker_servicer.py): it fetches the tokenizer from a replica, renders the chat,
tokenizes, routes by policy and detokenizes. The replicas run the shipped model in float32 with
plain linears, so both compute the same greedy tokens as dyngen's own Generate.

Cache-aware routing is fed by the replicas' KV events alone (no affinity key): a system prompt's
requests after its first are all prefix hits, which they can only be if they all landed on the
replica that computed it (the other one would miss, and then hold it too).
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from dyngen_client import Chat, Client, Request, Sampling, collect
from service.cluster import Cluster, free_port
from service.smg_gateway import SmgGateway

MODEL = "smollm2"
FLAGS = (
    *("--served-model-name", MODEL, "--quant", "none", "--dtype", "float32"),
    *("--cache-tokens", "16384", "--omp-wait-policy", "passive"),
)
QUESTION_TEXT = "What is the capital of France?"
QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": QUESTION_TEXT}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(2, FLAGS, gateway="cache_aware", workdir=tmp_path_factory.mktemp("gateway"))
    c.start()
    try:
        assert c.gateway is not None
        c.gateway.wait_ready(timeout=180)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def oai(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.target, api_key="unused", timeout=60, max_retries=0)


def test_chat_completion_equals_dyngens_own_greedy_output(cluster: Cluster, oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24)
    choice = r.choices[0]
    with Client(cluster.replica_target(0)) as client:
        own = collect(client.generate(Request(Chat.user(QUESTION_TEXT), max_new_tokens=24)))
    assert choice.message.content == own.text
    assert r.usage is not None
    assert r.usage.prompt_tokens == own.finished.prompt_tokens  # the gateway's chat rendering is the engine's
    assert r.usage.completion_tokens == len(own.token_ids)
    assert choice.finish_reason == ("length" if len(own.token_ids) == 24 else "stop")


def test_a_streamed_chat_completion_carries_the_same_text(oai: openai.OpenAI) -> None:
    whole = oai.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=16)
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts: list[str] = []
    finish: str | None = None
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(parts) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and whole.usage is not None
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_n_choices(oai: openai.OpenAI) -> None:
    poem: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Write a short poem about the sea."}
    ]
    r = oai.chat.completions.create(model=MODEL, messages=poem, n=3, temperature=1.0, max_tokens=12, seed=5)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1  # three samples, not one thrice
    assert r.usage is not None and 3 <= r.usage.completion_tokens <= 3 * 12  # summed over the choices


def test_a_completion(oai: openai.OpenAI) -> None:
    r = oai.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8)
    assert r.choices[0].text.strip()
    assert r.usage is not None and r.usage.completion_tokens == 8


def test_a_json_schema_response_format_gives_valid_output(oai: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "is_capital": {"type": "boolean"}},
        "required": ["city", "is_capital"],
        "additionalProperties": False,
    }
    r = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name the capital of France, as JSON."}],
        temperature=0,
        max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    )
    text = r.choices[0].message.content
    assert text is not None
    jsonschema.validate(json.loads(text), schema)
    assert r.choices[0].finish_reason == "stop"


def test_stop_max_tokens_and_seed(oai: openai.OpenAI) -> None:
    stopped = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Write three sentences about the sea."}],
        temperature=0,
        max_tokens=64,
        stop=["."],
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert "." not in (stopped.choices[0].message.content or "")
    short = oai.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=3)
    assert short.usage is not None and short.usage.completion_tokens == 3
    assert short.choices[0].finish_reason == "length"
    poem: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Write a short poem about the sea."}
    ]
    texts = [
        oai.chat.completions.create(model=MODEL, messages=poem, temperature=1.0, max_tokens=24, seed=seed)
        .choices[0]
        .message.content
        for seed in (7, 7, 8)
    ]
    assert texts[0] == texts[1]  # the same seed, the same text
    assert texts[0] != texts[2]


def test_bad_requests_are_the_gateways_errors_and_the_replicas_serve_on(oai: openai.OpenAI) -> None:
    # SMG ignores a request's unknown top-level fields (as OpenAI's own API does for extra
    # body keys); an unknown value or one out of range is a 400 naming the field, whether the
    # gateway's validation or the worker's refusal (INVALID_ARGUMENT) catches it.
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(  # type: ignore[call-overload]
            model=MODEL,
            messages=QUESTION,
            response_format={"type": "no_such_format"},
        )
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="no-such-model", messages=QUESTION)
    with pytest.raises(openai.BadRequestError) as info:  # the gateway's own bound on n (10)
        oai.chat.completions.create(model=MODEL, messages=QUESTION, n=11, max_tokens=4)
    assert "n: Validation error" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=-1.0)
    assert "temperature" in str(info.value)
    ok = oai.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=2,
        extra_body={"bogus_param": 1},
    )
    assert ok.usage is not None and ok.usage.completion_tokens == 2


def _system_prompt(tag: str, rules: int = 60) -> str:
    """About 11 tokens a rule: 60 rules are 10 pages of 64, most of a prompt of one short question."""
    return " ".join(f"{tag} rule {i}: answer briefly and politely." for i in range(rules))


def _hit_rate(
    client: openai.OpenAI, tag: str, prompts: int = 3, questions: int = 6
) -> tuple[float, float, int]:
    """Several system prompts x questions, in order: cached / prompt tokens over all requests and over
    the requests after each system prompt's first (those that can hit), and how many of the latter
    found none of it cached."""
    cached = total = later_cached = later_total = misses = 0
    for q in range(questions):
        for p in range(prompts):
            messages: list[ChatCompletionMessageParam] = [
                {"role": "system", "content": _system_prompt(f"{tag}{p}")},
                {"role": "user", "content": f"question {q}?"},
            ]
            r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
            assert r.usage is not None and r.usage.prompt_tokens_details is not None
            hit = r.usage.prompt_tokens_details.cached_tokens or 0
            cached += hit
            total += r.usage.prompt_tokens
            if q > 0:
                later_cached += hit
                later_total += r.usage.prompt_tokens
                misses += int(hit == 0)
    return cached / total, later_cached / later_total, misses


@pytest.mark.timeout(300)
def test_cache_aware_routing_keeps_each_system_prompt_on_one_replica(
    cluster: Cluster, oai: openai.OpenAI, tmp_path_factory: pytest.TempPathFactory
) -> None:
    workers = [cluster.replica_target(i) for i in range(2)]
    single_gateway = SmgGateway(workers[:1], free_port(), free_port(), "round_robin")
    robin_gateway = SmgGateway(workers, free_port(), free_port(), "round_robin")
    single_gateway.start()
    robin_gateway.start()
    try:
        single_gateway.wait_ready()
        robin_gateway.wait_ready()
        single, _, _ = _hit_rate(openai.OpenAI(base_url=single_gateway.url, api_key="-"), "single")
        aware, aware_later, misses = _hit_rate(oai, "aware")
        robin, _, _ = _hit_rate(openai.OpenAI(base_url=robin_gateway.url, api_key="-"), "robin")
    finally:
        single_gateway.stop()
        robin_gateway.stop()
    print(
        f"hit rate: one replica {single:.3f}, cache_aware {aware:.3f} ({aware_later:.3f} after each "
        f"prompt's first), round robin {robin:.3f}"
    )
    assert misses == 0  # every later request of a system prompt found it: it went where it was computed
    assert aware_later >= 0.9  # and found all of its system prompt cached
    assert aware >= 0.9 * single
    assert robin < aware - 0.02  # round robin computes each system prompt on both replicas


@pytest.mark.timeout(300)
def test_a_killed_replica_is_routed_around(cluster: Cluster, oai: openai.OpenAI) -> None:
    """SIGKILL of one replica: every next request is answered by the other (the gateway retries a
    request whose worker failed before answering, then stops routing to the dead one)."""
    cluster.signal_replica(0, signal.SIGKILL)
    cluster.wait_replica(0, 30)
    answered = 0
    deadline = time.monotonic() + 60
    for i in range(8):
        messages: list[ChatCompletionMessageParam] = [
            {"role": "system", "content": _system_prompt(f"kill{i % 2}")},
            *QUESTION,
        ]
        r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
        answered += int(r.usage is not None and r.usage.completion_tokens == 2)
        assert time.monotonic() < deadline
    assert answered == 8
    with Client(cluster.replica_target(1)) as client:
        assert collect(client.generate(Request("hi", max_new_tokens=1, sampling=Sampling()))).token_ids
