"""The gateway's worker contract (vllm.grpc.engine.VllmEngine, from the pinned smg-grpc-proto) as a
gateway calls it: plain gRPC on 127.0.0.1 against a real `dyngen serve` with the tiny random-weight
model (tests/tiny_service_model.py).

Two servers, both with pages of 16 tokens so that short prompts fill pages:
- `server`: the shared one (--max-batch-size 1, --served-model-name): Generate and its constraints,
  refusals, Abort and a dropped call, loads, the tokenizer, model and server facts;
- `kv_server`: a KV cache of 256 tokens (16 pages), so that a dozen prompts evict: the KV event
  stream (snapshot, stored, removed, numbering, heartbeats, replay, cursors), FlushCache and an
  engine restart (last: it kills the engine).

"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import random
import threading
import time
import zipfile
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import NoReturn, cast

import grpc
import jsonschema
import pytest
import tokenizers
from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from dyngen_client import Client, ErrorReason, Request, Sampling, collect, error_details
from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from engine.cache.kv_events import AllBlocksCleared, BlockStored
from service.frontend.engine_load import EngineLoadTracker, LoadSample
from service.frontend.kv_event_relay import KvEventRelay
from service.frontend.limits import ModelBounds
from service.frontend.servicer import GeneratorService
from service.frontend.worker_servicer import WorkerService
from tests.service_harness import TINY_SERVER_FLAGS, ServerProcess, start_tiny_server, wait_pool_idle
from tests.tiny_service_model import SERVICE_SPEC, write_servable_tiny_gguf

pytestmark = pytest.mark.timeout(120)

METHOD = "/vllm.grpc.engine.VllmEngine/"
CALL_SECONDS = 30.0  # every unary call and every finite stream
STREAM_SECONDS = 90.0  # a KV event stream read for a whole test
WAIT_SECONDS = 15.0  # polling for a state the server reaches on its own
PAGE = 16
SERVED_NAME = "tiny-worker"
KV_CACHE_TOKENS = 256  # 16 pages of 16
SHARED_CACHE_TOKENS = int(TINY_SERVER_FLAGS[TINY_SERVER_FLAGS.index("--cache-tokens") + 1])
LONG_TOKENS = 4000  # seconds of decoding: a job still running when the test acts on it


# -- the contract over a plain channel ----------------------------------------------------------


class Worker:
    """The worker contract's RPCs by name (the generated _grpc module is untyped)."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        ch = self.channel
        self._generate = ch.unary_stream(
            METHOD + "Generate",
            request_serializer=vpb.GenerateRequest.SerializeToString,
            response_deserializer=vpb.GenerateResponse.FromString,
        )
        self._abort = ch.unary_unary(
            METHOD + "Abort",
            request_serializer=vpb.AbortRequest.SerializeToString,
            response_deserializer=vpb.AbortResponse.FromString,
        )
        self._health = ch.unary_unary(
            METHOD + "HealthCheck",
            request_serializer=vpb.HealthCheckRequest.SerializeToString,
            response_deserializer=vpb.HealthCheckResponse.FromString,
        )
        self._model_info = ch.unary_unary(
            METHOD + "GetModelInfo",
            request_serializer=vpb.GetModelInfoRequest.SerializeToString,
            response_deserializer=vpb.GetModelInfoResponse.FromString,
        )
        self._server_info = ch.unary_unary(
            METHOD + "GetServerInfo",
            request_serializer=vpb.GetServerInfoRequest.SerializeToString,
            response_deserializer=vpb.GetServerInfoResponse.FromString,
        )
        self._loads = ch.unary_unary(
            METHOD + "GetLoads",
            request_serializer=vpb.GetLoadsRequest.SerializeToString,
            response_deserializer=vpb.GetLoadsResponse.FromString,
        )
        self._tokenizer = ch.unary_stream(
            METHOD + "GetTokenizer",
            request_serializer=cpb.GetTokenizerRequest.SerializeToString,
            response_deserializer=cpb.GetTokenizerChunk.FromString,
        )
        self._flush = ch.unary_unary(
            METHOD + "FlushCache",
            request_serializer=cpb.FlushCacheRequest.SerializeToString,
            response_deserializer=cpb.FlushCacheResponse.FromString,
        )
        self._embed = ch.unary_unary(
            METHOD + "Embed",
            request_serializer=vpb.EmbedRequest.SerializeToString,
            response_deserializer=vpb.EmbedResponse.FromString,
        )
        self._subscribe = ch.unary_stream(
            METHOD + "SubscribeKvEvents",
            request_serializer=cpb.SubscribeKvEventsRequest.SerializeToString,
            response_deserializer=cpb.KvEventBatch.FromString,
        )
        # The same Generate taking raw bytes: a malformed request reaches the server as sent.
        self.generate_bytes = ch.unary_stream(
            METHOD + "Generate",
            request_serializer=lambda data: data,
            response_deserializer=vpb.GenerateResponse.FromString,
        )

    def close(self) -> None:
        self.channel.close()

    def generate(self, request: vpb.GenerateRequest) -> list[vpb.GenerateResponse]:
        return list(self._generate(request, timeout=CALL_SECONDS))

    def stream(
        self, request: vpb.GenerateRequest, timeout: float = CALL_SECONDS
    ) -> grpc._CallIterator[vpb.GenerateResponse]:
        return self._generate(request, timeout=timeout)

    def abort(self, *request_ids: str) -> None:
        self._abort(vpb.AbortRequest(request_ids=request_ids), timeout=CALL_SECONDS)

    def health(self) -> vpb.HealthCheckResponse:
        return self._health(vpb.HealthCheckRequest(), timeout=CALL_SECONDS)

    def model_info(self) -> vpb.GetModelInfoResponse:
        return self._model_info(vpb.GetModelInfoRequest(), timeout=CALL_SECONDS)

    def server_info(self) -> vpb.GetServerInfoResponse:
        return self._server_info(vpb.GetServerInfoRequest(), timeout=CALL_SECONDS)

    def load(self) -> vpb.SchedulerLoad:
        reply = self._loads(vpb.GetLoadsRequest(), timeout=CALL_SECONDS)
        assert reply.dp_rank_count == 1 and len(reply.loads) == 1, reply
        return reply.loads[0]

    def tokenizer_chunks(self) -> list[cpb.GetTokenizerChunk]:
        return list(self._tokenizer(cpb.GetTokenizerRequest(), timeout=CALL_SECONDS))

    def flush(self) -> cpb.FlushCacheResponse:
        return self._flush(cpb.FlushCacheRequest(), timeout=CALL_SECONDS)

    def embed(self, request: vpb.EmbedRequest) -> vpb.EmbedResponse:
        return self._embed(request, timeout=CALL_SECONDS)

    def subscribe(self, start: int, timeout: float = STREAM_SECONDS) -> grpc._CallIterator[cpb.KvEventBatch]:
        return self._subscribe(cpb.SubscribeKvEventsRequest(start_sequence_number=start), timeout=timeout)


def tokenized(
    ids: list[int], request_id: str = "", stream: bool = False, **sampling: object
) -> vpb.GenerateRequest:
    """A Generate on token ids; `sampling` are SamplingParams fields."""
    return vpb.GenerateRequest(
        request_id=request_id,
        tokenized=vpb.TokenizedInput(input_ids=ids),
        sampling_params=vpb.SamplingParams(**sampling),  # type: ignore[arg-type]
        stream=stream,
    )


def greedy(
    ids: list[int], max_tokens: int, request_id: str = "", stream: bool = False, **sampling: object
) -> vpb.GenerateRequest:
    return tokenized(
        ids, request_id, stream, temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **sampling
    )


def long_job(ids: list[int], request_id: str) -> vpb.GenerateRequest:
    """A streamed job that runs for seconds unless stopped."""
    return tokenized(ids, request_id, stream=True, max_tokens=LONG_TOKENS, ignore_eos=True)


def complete_of(responses: list[vpb.GenerateResponse]) -> vpb.GenerateComplete:
    """The one GenerateComplete that ends a Generate's responses."""
    assert responses and responses[-1].WhichOneof("response") == "complete", responses[-1:]
    assert all(r.WhichOneof("response") == "chunk" for r in responses[:-1])
    return responses[-1].complete


def chunks_of(responses: list[vpb.GenerateResponse]) -> list[vpb.GenerateStreamChunk]:
    complete_of(responses)
    return [r.chunk for r in responses[:-1]]


def refusal(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def wait_until(what: str, check: Callable[[], bool], timeout: float = WAIT_SECONDS) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.02)


def wait_load(worker: Worker, what: str, check: Callable[[vpb.SchedulerLoad], bool]) -> vpb.SchedulerLoad:
    """GetLoads until `check` holds (bounded): that reply."""
    seen: list[vpb.SchedulerLoad] = []

    def ok() -> bool:
        seen.append(worker.load())
        return check(seen[-1])

    try:
        wait_until(what, ok)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last GetLoads: {seen[-1] if seen else None}") from None
    return seen[-1]


def random_prompt(seed: int, length: int = 40) -> list[int]:
    """Token ids no other prompt here shares a page with (ids 0-2 are the special tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(3, SERVICE_SPEC.vocab_size) for _ in range(length)]


# -- the servers --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_servable_tiny_gguf(tmp_path_factory.mktemp("worker") / "tiny.gguf")


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[ServerProcess]:
    s = start_tiny_server(
        tiny_model,
        *("--page-size", str(PAGE), "--max-batch-size", "1", "--served-model-name", SERVED_NAME),
    )
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def worker(server: ServerProcess) -> Iterator[Worker]:
    w = Worker(server.target)
    yield w
    w.close()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[Client]:
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def bundle(worker: Worker) -> zipfile.ZipFile:
    """GetTokenizer's zip, checked against its digest."""
    chunks = worker.tokenizer_chunks()
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert all(c.sha256 == "" for c in chunks[:-1])
    return zipfile.ZipFile(io.BytesIO(data))


@pytest.fixture(scope="module")
def tokenizer(bundle: zipfile.ZipFile) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_str(bundle.read("tokenizer.json").decode("utf-8"))


@pytest.fixture(scope="module")
def kv_server(tiny_model: Path) -> Iterator[ServerProcess]:
    # Later flags win: this cache replaces TINY_SERVER_FLAGS' --cache-tokens 16384.
    s = start_tiny_server(tiny_model, "--page-size", str(PAGE), "--cache-tokens", str(KV_CACHE_TOKENS))
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def kv_worker(kv_server: ServerProcess) -> Iterator[Worker]:
    w = Worker(kv_server.target)
    yield w
    w.close()


# -- Generate -----------------------------------------------------------------------------------

PROMPT = list(range(60, 80))


def test_greedy_ids_streamed_and_not_equal_dyngen_generate(worker: Worker, client: Client) -> None:
    n = 12
    whole = complete_of(worker.generate(greedy(PROMPT, n)))
    assert len(whole.output_ids) == n
    assert whole.finish_reason == "length"
    assert (whole.prompt_tokens, whole.completion_tokens) == (len(PROMPT), n)

    streamed = worker.generate(greedy(PROMPT, n, stream=True))
    chunks, end = chunks_of(streamed), complete_of(streamed)
    assert len(chunks) > 1  # deltas, not one chunk of everything
    for c in chunks:
        assert c.token_ids and c.completion_tokens == len(c.token_ids) and c.prompt_tokens == len(PROMPT)
    assert [t for c in chunks for t in c.token_ids] == list(whole.output_ids)
    assert end.finish_reason == "length"
    assert (end.prompt_tokens, end.completion_tokens) == (len(PROMPT), n)

    own = collect(
        client.generate(
            Request(PROMPT, max_new_tokens=n, sampling=Sampling(temperature=0.0), ignore_eos=True), timeout=30
        )
    )
    assert own.token_ids == tuple(whole.output_ids)
    assert own.stop_reason == "max_new_tokens"


def test_n_samples_are_jobs_of_their_own_seeds(worker: Worker) -> None:
    """n = 3 at temperature 1 with seed s: three completes, indexed 0-2, sample i being exactly what
    one request with seed s + i gives; streamed, every chunk names its sample and each ends."""

    def sampled(seed: int, n: int = 1, stream: bool = False) -> vpb.GenerateRequest:
        return tokenized(PROMPT, "", stream, temperature=1.0, max_tokens=6, ignore_eos=True, seed=seed, n=n)

    whole = worker.generate(sampled(41, 3))
    ends = sorted((r.complete for r in whole if r.HasField("complete")), key=lambda c: c.index)
    assert [c.index for c in ends] == [0, 1, 2]
    for i, end in enumerate(ends):
        alone = complete_of(worker.generate(sampled(41 + i)))
        assert list(end.output_ids) == list(alone.output_ids)
        assert end.completion_tokens == 6 and end.finish_reason == "length"
    assert len({tuple(c.output_ids) for c in ends}) > 1

    streamed = worker.generate(sampled(41, 2, stream=True))
    ids: dict[int, list[int]] = {0: [], 1: []}
    for r in streamed:
        if r.HasField("chunk"):
            ids[r.chunk.index].extend(r.chunk.token_ids)
    assert sorted(r.complete.index for r in streamed if r.HasField("complete")) == [0, 1]
    assert streamed[-1].HasField("complete")
    assert [ids[0], ids[1]] == [list(e.output_ids) for e in ends[:2]]


def test_a_stop_token_ends_the_job_and_is_named(worker: Worker) -> None:
    ids = list(complete_of(worker.generate(greedy(PROMPT, 12))).output_ids)
    # The first token that is new at its position: the job must stop right before it.
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])
    stop = ids[k]
    for stream in (False, True):
        responses = worker.generate(greedy(PROMPT, 12, stop_token_ids=[stop], stream=stream))
        end = complete_of(responses)
        got = [t for c in chunks_of(responses) for t in c.token_ids] if stream else list(end.output_ids)
        assert got == ids[:k], (stream, got, ids, stop)
        assert end.finish_reason == "stop"
        assert end.WhichOneof("matched_stop") == "matched_token_id" and end.matched_token_id == stop
        assert end.completion_tokens == k


def test_a_seed_repeats_sampling_and_logprobs_have_the_top_entries(worker: Worker) -> None:
    def sampled(seed: int) -> list[int]:
        request = tokenized(PROMPT, temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True)
        return list(complete_of(worker.generate(request)).output_ids)

    first = sampled(1234)
    assert len(first) == 16
    assert sampled(1234) == first
    assert sampled(4321) != first  # the seed is used, not ignored

    n = 6
    end = complete_of(worker.generate(greedy(PROMPT, n, logprobs=2)))
    lp = end.output_logprobs
    assert list(lp.token_ids) == list(end.output_ids) and len(lp.token_logprobs) == n
    assert len(lp.top_logprobs) == n
    for chosen, value, top in zip(end.output_ids, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top.values) == 2 and len(top.token_ids) == 2
        assert 0.0 >= top.values[0] >= top.values[1]
        assert top.token_ids[0] == chosen  # greedy: the chosen token is the most likely
        assert value == pytest.approx(top.values[0])

    streamed = worker.generate(greedy(PROMPT, n, logprobs=2, stream=True))
    chunks = chunks_of(streamed)
    assert [t for c in chunks for t in c.token_ids] == list(end.output_ids)
    for c in chunks:
        assert list(c.output_logprobs.token_ids) == list(c.token_ids)
        assert [len(t.values) for t in c.output_logprobs.top_logprobs] == [2] * len(c.token_ids)

    sampled_lp = complete_of(
        worker.generate(tokenized(PROMPT, temperature=1.0, seed=7, max_tokens=n, ignore_eos=True, logprobs=2))
    ).output_logprobs
    assert [len(t.token_ids) for t in sampled_lp.top_logprobs] == [2] * n


# -- constraints --------------------------------------------------------------------------------

SCHEMA: dict[str, object] = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "c": {"enum": ["red", "green"]},
    },
    "required": ["n", "c"],
    "additionalProperties": False,
}
CONSTRAINED_TOKENS = 64
SEEDS = (None, 1, 2, 3)  # None: greedy


def constrained(seed: int | None, **constraint: object) -> vpb.GenerateRequest:
    """A Generate the grammar must end (EOS allowed) well within CONSTRAINED_TOKENS."""
    if seed is None:
        request = tokenized(PROMPT, temperature=0.0, max_tokens=CONSTRAINED_TOKENS)
    else:
        request = tokenized(PROMPT, temperature=1.0, seed=seed, max_tokens=CONSTRAINED_TOKENS)
    request.sampling_params.MergeFrom(vpb.SamplingParams(**constraint))  # type: ignore[arg-type]
    return request


def constrained_text(worker: Worker, tokenizer: tokenizers.Tokenizer, request: vpb.GenerateRequest) -> str:
    end = complete_of(worker.generate(request))
    text = tokenizer.decode(list(end.output_ids), skip_special_tokens=True)
    assert end.finish_reason == "stop", (end, text)  # the grammar ended it, not max_tokens
    return text


def test_json_schema_output_is_valid(worker: Worker, tokenizer: tokenizers.Tokenizer) -> None:
    for seed in SEEDS:
        text = constrained_text(worker, tokenizer, constrained(seed, json_schema=json.dumps(SCHEMA)))
        jsonschema.validate(json.loads(text), SCHEMA)


def test_choice_output_is_one_of_the_choices(worker: Worker, tokenizer: tokenizers.Tokenizer) -> None:
    choices = ["red", "green", "blue"]
    for seed in SEEDS:
        request = constrained(seed, choice=vpb.ChoiceConstraint(choices=choices))
        assert constrained_text(worker, tokenizer, request) in choices


def test_gbnf_grammar_output_matches(worker: Worker, tokenizer: tokenizers.Tokenizer) -> None:
    for seed in SEEDS:
        request = constrained(seed, grammar='root ::= "yes" | "no"')
        assert constrained_text(worker, tokenizer, request) in ("yes", "no")


def test_json_object_output_is_an_object(worker: Worker, tokenizer: tokenizers.Tokenizer) -> None:
    text = constrained_text(worker, tokenizer, constrained(None, json_object=True))
    assert isinstance(json.loads(text), dict)


# -- refusals -----------------------------------------------------------------------------------


def test_bad_requests_are_refused_naming_the_field_and_the_server_serves_on(
    worker: Worker, client: Client
) -> None:
    info = worker.model_info()
    ok = PROMPT[:8]

    def field_refusal(request: vpb.GenerateRequest, field: str) -> None:
        """INVALID_ARGUMENT naming the contract's field, in the message and the details."""
        error = refusal(lambda: worker.generate(request))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, error)
        assert field in (error.details() or ""), (field, error.details())
        assert [v.field for v in error_details(error).field_violations] == [field]

    field_refusal(tokenized(ok, max_tokens=2, n=17), "sampling_params.n")
    field_refusal(tokenized(ok, max_tokens=2, prompt_logprobs=1), "sampling_params.prompt_logprobs")
    field_refusal(tokenized(ok, max_tokens=2, structural_tag="{}"), "sampling_params.structural_tag")
    field_refusal(tokenized(ok, max_tokens=2, logprobs=-1), "sampling_params.logprobs")
    field_refusal(vpb.GenerateRequest(sampling_params=vpb.SamplingParams(max_tokens=2)), "input")
    field_refusal(
        vpb.GenerateRequest(
            tokenized=vpb.TokenizedInput(input_ids=ok),
            sampling_params=vpb.SamplingParams(max_tokens=2),
            mm_inputs=vpb.MultimodalInputs(im_token_id=5),
        ),
        "mm_inputs",
    )
    field_refusal(
        vpb.GenerateRequest(
            text="hello", sampling_params=vpb.SamplingParams(max_tokens=2, truncate_prompt_tokens=4)
        ),
        "sampling_params.truncate_prompt_tokens",
    )

    # Refused by dyngen's own rule (JobSpec.check), which names the setting in its message only.
    def refused(request: vpb.GenerateRequest, *words: str) -> grpc.RpcError:
        error = refusal(lambda: worker.generate(request))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (words, error)
        assert all(w in (error.details() or "") for w in words), (words, error.details())
        return error

    refused(tokenized(ok, max_tokens=2, temperature=-1.0), "temperature")
    refused(tokenized(ok, max_tokens=2, top_p=2.0), "top_p")
    refused(tokenized([*ok, info.vocab_size], max_tokens=2), "token ids", str(info.vocab_size))
    too_long = refused(tokenized([7] * (info.max_context_length + 1), max_tokens=1), "prompt")
    assert error_details(too_long).reason is ErrorReason.PROMPT_TOO_LONG

    garbage = refusal(lambda: list(worker.generate_bytes(b"\xff\xff\xff\xff", timeout=CALL_SECONDS)))
    assert garbage.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "GenerateRequest" in (garbage.details() or "")

    unknown = refusal(lambda: worker.abort("no-such-request"))
    assert unknown.code() == grpc.StatusCode.NOT_FOUND
    assert [v.field for v in error_details(unknown).field_violations] == ["request_ids"]
    assert "no-such-request" in (unknown.details() or "")

    running = worker.stream(long_job(ok, "twin"))
    try:
        assert next(running).WhichOneof("response") == "chunk"  # running: its id is taken
        twin = refusal(lambda: worker.generate(tokenized(ok, "twin", max_tokens=2)))
        assert twin.code() == grpc.StatusCode.ALREADY_EXISTS
        assert error_details(twin).reason is ErrorReason.REQUEST_ID_IN_USE
        assert [v.field for v in error_details(twin).field_violations] == ["request_id"]
    finally:
        running.cancel()

    assert wait_pool_idle(client).pages_used == 0
    end = complete_of(worker.generate(greedy(ok, 4, request_id="twin")))  # the id is free again
    assert end.finish_reason == "length" and len(end.output_ids) == 4


# -- Abort, a dropped call, loads ---------------------------------------------------------------


def test_abort_and_a_cancelled_call_free_the_job(worker: Worker, client: Client) -> None:
    call = worker.stream(long_job(list(range(100, 124)), "to-abort"))
    try:
        first = next(call)
        assert first.WhichOneof("response") == "chunk"
        worker.abort("to-abort")
        rest = list(call)
    finally:
        call.cancel()
    end = complete_of(rest)
    assert end.finish_reason == "abort"
    assert 0 < end.completion_tokens < LONG_TOKENS
    assert refusal(lambda: worker.abort("to-abort")).code() == grpc.StatusCode.NOT_FOUND  # gone

    dropped = worker.stream(long_job(list(range(130, 154)), "to-drop"))
    assert next(dropped).WhichOneof("response") == "chunk"
    dropped.cancel()  # the caller goes away: the job is cancelled as an Abort would
    wait_load(worker, "no job left", lambda s: s.num_running_reqs == 0 and s.num_waiting_reqs == 0)
    assert refusal(lambda: worker.abort("to-drop")).code() == grpc.StatusCode.NOT_FOUND
    idle = wait_pool_idle(client)
    assert (idle.pages_used, idle.running_jobs, idle.queued_jobs) == (0, 0, 0)


def test_loads_count_running_and_waiting_jobs(worker: Worker, client: Client) -> None:
    prompts = [random_prompt(500 + i, 24) for i in range(3)]
    calls = [worker.stream(long_job(prompts[0], "load-0"))]
    try:
        assert next(calls[0]).WhichOneof("response") == "chunk"  # the one running (batch of 1)
        calls += [worker.stream(long_job(p, f"load-{i}")) for i, p in enumerate(prompts[1:], 1)]
        # A job counts as waiting from submission, its prompt tokens once the engine has accepted it.
        busy = wait_load(
            worker,
            "1 running, 2 waiting with their prompts",
            lambda s: (
                (s.num_running_reqs, s.num_waiting_reqs, s.num_waiting_uncached_tokens)
                == (1, 2, 2 * len(prompts[0]))
            ),  # distinct prompts: none of their tokens is cached
        )
        assert busy.num_total_reqs == 3 and busy.max_running_requests == 1
        assert busy.utilization == pytest.approx(1.0)
        assert busy.max_total_num_tokens == SHARED_CACHE_TOKENS
        used = wait_load(worker, "KV cache in use", lambda s: s.token_usage > 0 and s.num_used_tokens > 0)
        assert used.num_running_reqs == 1 and used.gen_throughput > 0
        assert 0 < used.token_usage <= 1
    finally:
        for call in calls:
            call.cancel()
    done = wait_load(worker, "no job left", lambda s: s.num_running_reqs == 0 and s.num_waiting_reqs == 0)
    assert done.num_total_reqs == 0 and done.num_waiting_uncached_tokens == 0
    assert wait_pool_idle(client).pages_used == 0


# -- facts, the tokenizer, health ---------------------------------------------------------------


def test_tokenizer_bundle_tokenizes_as_the_server(
    bundle: zipfile.ZipFile, tokenizer: tokenizers.Tokenizer, client: Client
) -> None:
    names = set(bundle.namelist())
    assert {"tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"} <= names
    for text in ("Hello world, this is a test.", 'yes or no? {"n": 12}'):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert ids and ids == client.tokenize(text)


def test_model_and_server_info_and_health(worker: Worker, bundle: zipfile.ZipFile) -> None:
    info = worker.model_info()
    assert info.served_model_name == SERVED_NAME
    assert info.model_path == "tiny.gguf" and info.is_generation
    assert info.max_context_length == SERVICE_SPEC.context_length > 0
    assert info.max_req_input_len == info.max_context_length - 1
    assert info.vocab_size == SERVICE_SPEC.vocab_size
    eos = json.loads(bundle.read("generation_config.json"))["eos_token_id"]
    assert info.eos_token_ids and list(info.eos_token_ids) == (eos if isinstance(eos, list) else [eos])
    assert json.loads(bundle.read("config.json"))["eos_token_id"] == list(info.eos_token_ids)

    facts = worker.server_info()
    assert facts.block_size == PAGE
    assert facts.max_num_seqs == 1
    assert facts.data_parallel_size == 1 and facts.uptime_seconds > 0 and not facts.is_paused
    assert facts.kv_cache_dtype in ("float32", "float16", "bfloat16", "int8"), facts.kv_cache_dtype

    health = worker.health()
    assert health.healthy, health

    embed = refusal(lambda: worker.embed(vpb.EmbedRequest(tokenized=vpb.TokenizedInput(input_ids=PROMPT))))
    assert embed.code() == grpc.StatusCode.UNIMPLEMENTED
    assert error_details(embed).reason is ErrorReason.UNSUPPORTED
    assert "Embed" in (embed.details() or "")


# -- KV events ----------------------------------------------------------------------------------


class KvStream:
    """A SubscribeKvEvents call read on a thread of its own: the batches so far, and its error."""

    def __init__(self, worker: Worker, start: int) -> None:
        self.call = worker.subscribe(start)
        self.batches: list[cpb.KvEventBatch] = []
        self.error: grpc.RpcError | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for batch in self.call:
                with self._cond:
                    self.batches.append(batch)
                    self._cond.notify_all()
        except grpc.RpcError as exc:
            with self._cond:
                self.error = exc
                self._cond.notify_all()

    def wait(
        self, what: str, check: Callable[[list[cpb.KvEventBatch]], bool], timeout: float = WAIT_SECONDS
    ) -> list[cpb.KvEventBatch]:
        """The batches so far, once `check` holds for them (bounded)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not check(self.batches):
                left = deadline - time.monotonic()
                if left <= 0 or self.error is not None:
                    tail = [
                        (b.sequence_number, [e.WhichOneof("data") for e in b.events]) for b in self.batches
                    ]
                    raise AssertionError(
                        f"{what}: not within {timeout} s ({self.error}); batches {tail[-8:]}"
                    )
                self._cond.wait(left)
            return list(self.batches)

    def __enter__(self) -> KvStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.call.cancel()
        self._thread.join(10)


def event_batches(batches: list[cpb.KvEventBatch]) -> list[cpb.KvEventBatch]:
    return [b for b in batches if not b.load.load_only]


def stored(batches: list[cpb.KvEventBatch]) -> list[tuple[cpb.KvBlock, cpb.KvBlocksStored, int]]:
    """Every stored block: (block, its event, its batch's sequence number)."""
    return [
        (block, e.stored, b.sequence_number)
        for b in batches
        for e in b.events
        if e.WhichOneof("data") == "stored"
        for block in e.stored.blocks
    ]


def removed(batches: list[cpb.KvEventBatch]) -> set[int]:
    return {
        h
        for b in batches
        for e in b.events
        if e.WhichOneof("data") == "removed"
        for h in e.removed.block_hashes
    }


def blocks_of(
    batches: list[cpb.KvEventBatch], ids: list[int]
) -> list[tuple[cpb.KvBlock, cpb.KvBlocksStored, int]]:
    """The stored blocks holding `ids`' full pages, in page order (fewer while not all are stored)."""
    pages = [ids[i : i + PAGE] for i in range(0, len(ids) - PAGE + 1, PAGE)]
    found = {tuple(block.token_ids): (block, event, seq) for block, event, seq in stored(batches)}
    out = []
    for page in pages:
        if tuple(page) not in found:
            break
        out.append(found[tuple(page)])
    return out


def assert_numbering(batches: list[cpb.KvEventBatch]) -> int:
    """Every batch carries a load with a rising sample number; event batches are numbered +1 each
    and load-only ones repeat the last number. Returns the last number."""
    last: int | None = None
    sample = 0
    for b in batches:
        assert b.HasField("load"), b
        assert b.load.sample > sample, (b.load.sample, sample)
        sample = b.load.sample
        if b.load.load_only:
            assert not b.events and b.sequence_number == last, (b, last)
        else:
            assert b.events, b
            assert last is None or b.sequence_number == last + 1, (b.sequence_number, last)
            last = b.sequence_number
    assert last is not None
    return last


def run_prompt(worker: Worker, ids: list[int]) -> None:
    end = complete_of(worker.generate(greedy(ids, 1)))
    assert end.prompt_tokens == len(ids)


def published_once(worker: Worker) -> None:
    """Wait until the server has numbered at least one batch (the engine's first AllBlocksCleared),
    so that a subscription from 0 starts with a snapshot."""
    with KvStream(worker, 1) as probe:
        probe.wait("a first batch", lambda bs: bool(event_batches(bs)))


def test_kv_events_snapshot_store_evict_heartbeat_and_replay(kv_worker: Worker) -> None:
    early = random_prompt(1000)
    run_prompt(kv_worker, early)
    published_once(kv_worker)
    with KvStream(kv_worker, 0) as sub:
        # From 0: a snapshot of what the cache holds, an AllBlocksCleared first.
        snapshot = sub.wait("the snapshot", bool)[0]
        assert snapshot.HasField("snapshot") and snapshot.snapshot.index == 0
        assert snapshot.events[0].WhichOneof("data") == "cleared"
        first = sub.wait("the whole snapshot", lambda bs: len(bs) >= snapshot.snapshot.count)[
            : snapshot.snapshot.count
        ]
        assert all(b.HasField("snapshot") for b in first)
        assert len(stored(first)) == snapshot.snapshot.blocks
        assert len(blocks_of(first, early)) == 2  # the earlier prompt's two full pages are cached

        # A 40-token prompt: its two full pages are stored, chained.
        prompt = random_prompt(1001)
        run_prompt(kv_worker, prompt)
        batches = sub.wait("the prompt's pages", lambda bs: len(blocks_of(bs, prompt)) == 2)
        (one, one_event, one_seq), (two, two_event, _) = blocks_of(batches, prompt)
        assert list(one.token_ids) == prompt[:PAGE] and list(two.token_ids) == prompt[PAGE : 2 * PAGE]
        assert one.block_size == two.block_size == PAGE
        assert not one_event.HasField("parent_block_hash")  # a first page, unsalted
        assert two_event.parent_block_hash == one.block_hash
        assert one_seq > snapshot.sequence_number  # live, after the snapshot

        # Twelve more prompts overflow 16 pages: the oldest cached pages are evicted, and said so.
        for i in range(12):
            run_prompt(kv_worker, random_prompt(1100 + i))
        batches = sub.wait(
            "the prompt's pages removed", lambda bs: {one.block_hash, two.block_hash} <= removed(bs)
        )
        assert removed(batches) <= {block.block_hash for block, _, _ in stored(batches)}
        assert_numbering(batches)

        # Idle: load-only heartbeats repeating the last number.
        n = len(batches)
        batches = sub.wait("a heartbeat", lambda bs: any(b.load.load_only for b in bs[n:]), timeout=5)
        i = next(i for i in range(n, len(batches)) if batches[i].load.load_only)
        beat = batches[i]
        assert beat.sequence_number == event_batches(batches[:i])[-1].sequence_number and not beat.events
        assert beat.load.max_total_num_tokens == KV_CACHE_TOKENS
        last = assert_numbering(batches)

    # Replay from the prompt's first batch: the same batches, numbers and events.
    seen = [
        (b.sequence_number, list(b.events)) for b in event_batches(batches) if b.sequence_number >= one_seq
    ]
    with KvStream(kv_worker, one_seq) as replay:
        again = replay.wait(
            "the replay", lambda bs: any(b.sequence_number == last for b in event_batches(bs))
        )
        assert not again[0].HasField("snapshot")
        assert [(b.sequence_number, list(b.events)) for b in event_batches(again)] == seen
        assert all(b.HasField("load") for b in again)

    # A cursor past anything published: OUT_OF_RANGE, naming it.
    ahead = kv_worker.subscribe(last + 100, timeout=CALL_SECONDS)
    error = refusal(lambda: next(ahead))
    assert error.code() == grpc.StatusCode.OUT_OF_RANGE
    assert error_details(error).reason is ErrorReason.KV_EVENTS_GONE
    assert "start_sequence_number" in (error.details() or "")


def test_flush_cache_removes_every_cached_block(kv_worker: Worker, kv_server: ServerProcess) -> None:
    run_prompt(kv_worker, random_prompt(2000))
    published_once(kv_worker)
    with KvStream(kv_worker, 0) as sub:
        head = sub.wait("the snapshot", bool)[0]
        snapshot = sub.wait("the whole snapshot", lambda bs: len(bs) >= head.snapshot.count)
        snapshot = snapshot[: head.snapshot.count]
        live = {block.block_hash for block, _, _ in stored(snapshot)}
        assert len(live) >= 2
        reply = kv_worker.flush()
        assert reply.success, reply
        assert f"dropped {len(live)} " in reply.message
        batches = sub.wait("every live block removed", lambda bs: live <= removed(bs[len(snapshot) :]))
        assert removed(batches[len(snapshot) :]) == live
        assert not stored(batches[len(snapshot) :])
        assert_numbering(batches)
    with kv_server.client() as c:
        assert c.model_info(timeout=CALL_SECONDS).pages_cached == 0
    with KvStream(kv_worker, 0) as empty:
        after = empty.wait("the snapshot", bool)[0]
        assert after.snapshot.blocks == 0
        assert [e.WhichOneof("data") for e in after.events] == ["cleared"]


def test_max_req_input_len_fits_the_kv_cache(kv_worker: Worker) -> None:
    info = kv_worker.model_info()
    end = complete_of(kv_worker.generate(tokenized([7] * info.max_req_input_len, max_tokens=1)))
    assert end.prompt_tokens == info.max_req_input_len


def test_text_without_max_tokens_runs_to_the_end_of_the_cache(kv_worker: Worker) -> None:
    request = vpb.GenerateRequest(
        text="hello there", sampling_params=vpb.SamplingParams(temperature=0.0, ignore_eos=True)
    )
    end = complete_of(kv_worker.generate(request))
    assert end.finish_reason == "length"
    assert end.prompt_tokens + end.completion_tokens == KV_CACHE_TOKENS


def test_an_engine_restart_clears_and_numbering_goes_on(kv_worker: Worker, kv_server: ServerProcess) -> None:
    before = random_prompt(3000)
    run_prompt(kv_worker, before)
    published_once(kv_worker)
    with KvStream(kv_worker, 0) as sub:
        batches = sub.wait("the earlier prompt's pages", lambda bs: len(blocks_of(bs, before)) == 2)
        last = assert_numbering(batches)
        kv_server.kill_engine()
        batches = sub.wait(
            "a cleared after the kill",
            lambda bs: any(b.sequence_number == last + 1 for b in event_batches(bs)),
        )
        cleared = next(b for b in event_batches(batches) if b.sequence_number == last + 1)
        assert [e.WhichOneof("data") for e in cleared.events] == ["cleared"]
        assert not kv_worker.health().healthy  # the engine is restarting (seconds)

        kv_server.wait_serving(timeout=90)
        wait_until("HealthCheck healthy again", lambda: kv_worker.health().healthy, timeout=30)
        after = random_prompt(3001)
        run_prompt(kv_worker, after)
        batches = sub.wait("the new prompt's pages", lambda bs: len(blocks_of(bs, after)) == 2)
        assert all(seq > last + 1 for _, _, seq in blocks_of(batches, after))
        # The restarted engine's pool starts with an AllBlocksCleared of its own, numbered on too.
        clears = [
            b.sequence_number
            for b in event_batches(batches)
            if b.sequence_number > last and any(e.WhichOneof("data") == "cleared" for e in b.events)
        ]
        assert len(clears) == 2 and clears[0] == last + 1, clears
        assert_numbering(batches)  # +1 throughout, across the restart


# -- races inside the servicer, driven in-process with stand-ins for the job path and the engine --


class RefusedError(Exception):
    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__(code)
        self.code = code


class StandInEngine:
    def __init__(self) -> None:
        self.kv_events = KvEventRelay()
        self.bounds = ModelBounds(SERVICE_SPEC.vocab_size, 4096, 16384, SERVICE_SPEC.hidden_size, PAGE)

    def release(self, job: object, why: str) -> None:
        pass


@dataclass
class StandInJob:
    finished: bool = True  # its one event is its JobFinished


class StandInJobs:
    """What WorkerService uses of GeneratorService: requests pass, a job is accepted after a moment
    (the engine's round trip) and finishes at once."""

    def __init__(self) -> None:
        self.engine = StandInEngine()
        self.open_streams = 0

    async def parsed(self, request: object, context: object) -> object:
        return request

    async def tenant_of(self, context: object) -> str:
        return str(getattr(context, "tenant", ""))  # a test's stand-in context may name one

    async def fail(self, context: object, code: grpc.StatusCode, *details: object) -> NoReturn:
        raise RefusedError(code)

    async def open_stream(self, context: object) -> None:
        self.open_streams += 1

    async def submit(self, request: object, tenant: str, context: object, streamed: bool) -> object:
        await asyncio.sleep(0.05)  # tokenizing, then the engine's acceptance
        return StandInJob()

    async def job_events(self, job: object, context: object) -> AsyncIterator[pb.GenerateEvent]:
        yield pb.GenerateEvent(finished=pb.JobFinished(stop_reason=pb.STOP_REASON_MAX_NEW_TOKENS))


class StandInLoad:
    def __init__(self) -> None:
        self.on_change: list[Callable[[], None]] = []

    def sample(self) -> LoadSample:
        return LoadSample(0, 0, 0, 0, KV_CACHE_TOKENS, 0, 0.0, 0.0, 1)


def stand_in_service() -> tuple[WorkerService, StandInJobs]:
    jobs = StandInJobs()
    return WorkerService(cast(GeneratorService, jobs), cast(EngineLoadTracker, StandInLoad()), ""), jobs


def generates_at_once(tenants: list[str]) -> list[str]:
    """One stand-in service runs a Generate with request_id "twin" from each tenant at once; each
    one's finish reason, or the status it was refused with, sorted."""
    service, _ = stand_in_service()
    request = greedy(PROMPT, 4, request_id="twin")

    async def one(tenant: str) -> str:
        context = cast(
            "grpc.aio.ServicerContext[vpb.GenerateRequest, vpb.GenerateResponse]",
            SimpleNamespace(tenant=tenant),
        )
        try:
            responses = [r async for r in service.Generate(request, context)]
        except RefusedError as refused:
            return refused.code.name
        return complete_of(responses).finish_reason

    async def run() -> list[str]:
        return list(await asyncio.gather(*(one(t) for t in tenants)))

    return sorted(asyncio.run(run()))


def test_two_generates_with_one_request_id_at_once_are_not_both_run() -> None:
    assert generates_at_once(["", ""]) == ["ALREADY_EXISTS", "length"]


def test_a_request_id_is_the_tenants_own() -> None:
    """Two tenants may run one request_id at once, and neither learns that the other's runs."""
    assert generates_at_once(["alice", "bob", "alice"]) == ["ALREADY_EXISTS", "length", "length"]


def test_a_batch_published_while_the_snapshot_is_sent_is_not_skipped() -> None:
    service, jobs = stand_in_service()
    relay = jobs.engine.kv_events
    relay.publish([AllBlocksCleared(), BlockStored(11, None, tuple(range(PAGE)))])
    context = cast("grpc.aio.ServicerContext[cpb.SubscribeKvEventsRequest, cpb.KvEventBatch]", None)

    async def scenario() -> tuple[cpb.KvEventBatch, cpb.KvEventBatch]:
        stream = service.SubscribeKvEvents(cpb.SubscribeKvEventsRequest(), context)
        snapshot = await anext(stream)
        # The engine's next batch arrives while the snapshot chunk is on its way to the subscriber.
        relay.publish([BlockStored(22, 11, tuple(range(PAGE, 2 * PAGE)))])
        return snapshot, await asyncio.wait_for(anext(stream), 5)

    snapshot, following = asyncio.run(scenario())
    assert snapshot.HasField("snapshot") and snapshot.sequence_number == 1
    assert following.sequence_number == 2 and not following.load.load_only
    assert [e.WhichOneof("data") for e in following.events] == ["stored"]


def test_a_streamed_generate_resumes_across_an_engine_kill(worker: Worker, server: ServerProcess) -> None:
    """The gateway's streams resume as dyngen.v1's do: a kill is a pause, not an error, every id comes
    once, and the resumed job goes on as the uninterrupted run (greedy). This server runs bfloat16
    matmuls, whose last bits move with a batch's row count, so a random-weight model's near-ties
    may part the two runs later on: the check is the first 50 ids after the resume (the shipped
    model in float32 is held to every token: tests/test_crash_resume.py)."""
    request = greedy(random_prompt(3100), 600, stream=True)
    reference = [t for c in chunks_of(worker.generate(request)) for t in c.token_ids]
    mark = len(server.logs)
    ids: list[int] = []
    end: vpb.GenerateComplete | None = None
    killed, at = False, 0
    for response in worker.stream(request):
        if response.WhichOneof("response") == "chunk":
            ids.extend(response.chunk.token_ids)
            if len(ids) >= 20 and not killed:
                server.kill_engine()
                killed, at = True, len(ids)
        else:
            end = response.complete
    assert killed and end is not None
    assert ids[: at + 50] == reference[: at + 50] and end.completion_tokens == len(ids) == 600
    server.wait_log("engine_recovered", after=mark)
