"""The gateway's worker contract (vllm.grpc.engine, from smg-grpc-proto) in dyngen's own terms.

A worker-contract GenerateRequest becomes a dyngen.v1 GenerateRequest, so it is limited, tokenized,
built into a JobSpec and checked by the same code as every other request (servicer.py, codec.py):
one rule for both services. Its events become the contract's GenerateResponse messages: streamed,
one chunk of new token ids per delta, then a GenerateComplete; not streamed, one GenerateComplete
with every token id. The gateway detokenizes, so no text is sent.

The contract's own defaults apply where it leaves a field unset: temperature 1.0, and max_tokens up
to the end of the context (its engines' behaviour, which an OpenAI client behind a gateway expects);
a zero top_p, top_k, min_p, penalty or repetition_penalty means "off" as the contract's proto3
fields cannot say unset.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from smg_grpc_proto.generated import common_pb2 as cpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from dyngen_client.errors import ErrorReason
from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from engine.cache.kv_events import AllBlocksCleared, BlocksRemoved, BlockStored, KvEvent
from service.frontend.engine_load import LoadSample
from service.frontend.limits import ModelBounds, RequestError

CONTRACT_TEMPERATURE = 1.0  # the contract's temperature when a request leaves it unset
MAX_REQUEST_ID_CHARS = 256
MAX_SAMPLES = 16  # sampling_params.n: each sample is a job of its own

FINISH_REASONS = {
    pb.STOP_REASON_EOS: "stop",
    pb.STOP_REASON_STOP_TOKEN: "stop",
    pb.STOP_REASON_STOP_STRING: "stop",
    pb.STOP_REASON_GRAMMAR: "stop",
    pb.STOP_REASON_LOOP: "stop",
    pb.STOP_REASON_MAX_NEW_TOKENS: "length",
    pb.STOP_REASON_CANCELLED: "abort",
}


def _refuse(field: str, message: str) -> RequestError:
    return RequestError(f"{field}: {message}", field, ErrorReason.INVALID_ARGUMENT)


def _prompt(req: vpb.GenerateRequest, out: pb.GenerateRequest, bounds: ModelBounds) -> int | None:
    """Sets the prompt; its length in tokens when known before tokenizing (token ids)."""
    match req.WhichOneof("input"):
        case "tokenized":
            ids: Sequence[int] = req.tokenized.input_ids
            sp = req.sampling_params
            if sp.HasField("truncate_prompt_tokens"):
                keep = sp.truncate_prompt_tokens
                if keep == -1:  # the model's limit: room for at least one new token
                    keep = bounds.request_tokens - 1
                if keep < 1:
                    raise _refuse("sampling_params.truncate_prompt_tokens", f"must be >= 1 or -1, got {keep}")
                ids = ids[-keep:]
            out.token_ids.ids.extend(ids)
            return len(ids)
        case "text":
            if req.sampling_params.HasField("truncate_prompt_tokens"):
                raise _refuse(
                    "sampling_params.truncate_prompt_tokens",
                    "applies to tokenized input only; send token ids",
                )
            out.text = req.text
            return None
        case _:
            raise _refuse("input", "set tokenized (token ids) or text")


def _constraint(sp: vpb.SamplingParams, out: pb.GenerateRequest) -> None:
    match sp.WhichOneof("constraint"):
        case None:
            return
        case "json_schema":
            out.response_format.json_schema = sp.json_schema
        case "regex":
            out.response_format.regex = sp.regex
        case "grammar":
            # The gateway's `ebnf` arrives here: GBNF (`root ::= ...`) as its engines take, or Lark.
            if "::=" in sp.grammar:
                out.response_format.gbnf_grammar = sp.grammar
            else:
                out.response_format.lark_grammar = sp.grammar
        case "json_object":
            if sp.json_object:
                out.response_format.json_schema = json.dumps({"type": "object"})
        case "choice":
            if not sp.choice.choices:
                raise _refuse("sampling_params.choice", "give at least one choice")
            literals = " | ".join(json.dumps(c) for c in sp.choice.choices)
            out.response_format.lark_grammar = f"start: {literals}"
        case other:
            raise _refuse(
                f"sampling_params.{other}",
                "this constraint is not supported; use json_schema, regex, grammar, json_object or choice",
            )


def _sampling(sp: vpb.SamplingParams, out: pb.GenerateRequest) -> None:
    s = out.sampling
    s.temperature = sp.temperature if sp.HasField("temperature") else CONTRACT_TEMPERATURE
    if sp.top_p:
        s.top_p = sp.top_p
    if sp.top_k:
        s.top_k = sp.top_k
    if sp.min_p:
        s.min_p = sp.min_p
    if sp.frequency_penalty:
        s.frequency_penalty = sp.frequency_penalty
    if sp.presence_penalty:
        s.presence_penalty = sp.presence_penalty
    if sp.repetition_penalty:
        s.repetition_penalty = sp.repetition_penalty
    if sp.HasField("seed"):
        s.seed = sp.seed & 0xFFFF_FFFF  # an int32 in the contract; negative seeds stay distinct
    for token, bias in sorted(sp.logit_bias.items()):
        if token < 0:
            raise _refuse("sampling_params.logit_bias", f"token id {token} is negative")
        s.logit_bias.add(token_id=token, bias=bias)


def generate_request(req: vpb.GenerateRequest, bounds: ModelBounds) -> pb.GenerateRequest:
    """The dyngen.v1 request for a worker-contract one; RequestError naming the contract's field
    for what this engine cannot do (images, KV transfer, several samples, prompt logprobs)."""
    if len(req.request_id) > MAX_REQUEST_ID_CHARS:
        raise _refuse("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters")
    if req.HasField("mm_inputs") or req.extra_mm_inputs or req.HasField("media_refs"):
        raise _refuse("mm_inputs", "this model takes text only")
    if req.HasField("kv_transfer_params") or req.HasField("kv_transfer_params_json"):
        raise _refuse("kv_transfer_params", "this worker does no prefill/decode disaggregation")
    if req.HasField("data_parallel_rank") and req.data_parallel_rank != 0:
        raise _refuse("data_parallel_rank", f"this worker has one rank (0), got {req.data_parallel_rank}")
    sp = req.sampling_params
    if sp.n > MAX_SAMPLES:
        raise _refuse("sampling_params.n", f"at most {MAX_SAMPLES} samples per request, got {sp.n}")
    if sp.HasField("prompt_logprobs"):
        raise _refuse("sampling_params.prompt_logprobs", "the engine does not compute prompt logprobs")
    out = pb.GenerateRequest(identifier=req.request_id)
    prompt_len = _prompt(req, out, bounds)
    _sampling(sp, out)
    _constraint(sp, out)
    if sp.HasField("max_tokens"):
        out.max_new_tokens = sp.max_tokens
    elif prompt_len is not None:  # up to the end of the context (or of the cache, if smaller)
        out.max_new_tokens = max(1, bounds.request_tokens - prompt_len)
    out.min_new_tokens = sp.min_tokens
    out.stop_strings.extend(sp.stop)
    out.stop_token_ids.extend(sp.stop_token_ids)
    out.ignore_eos = sp.ignore_eos
    out.decode_special_tokens = not sp.skip_special_tokens
    if sp.HasField("logprobs"):
        if sp.logprobs < 0:
            raise _refuse(
                "sampling_params.logprobs", "logprobs over the whole vocabulary (-1) are not offered"
            )
        out.return_logprobs = True
        out.top_logprobs = sp.logprobs
    return out


def sample_requests(req: pb.GenerateRequest, n: int) -> list[pb.GenerateRequest]:
    """The jobs of `n` samples: the request itself, or `n` copies whose seeds, if set, follow on
    from the request's (seed, seed + 1, ...) so the samples differ and each repeats. They share the
    prompt's pages (the prefix cache), so n samples prefill it once."""
    if n == 1:
        return [req]
    out = []
    for i in range(n):
        sample = pb.GenerateRequest()
        sample.CopyFrom(req)
        if req.sampling.HasField("seed"):
            sample.sampling.seed = (req.sampling.seed + i) & 0xFFFF_FFFF_FFFF_FFFF
        out.append(sample)
    return out


# -- responses ----------------------------------------------------------------------------------


def output_logprobs(deltas: Sequence[pb.TextDelta]) -> vpb.OutputLogProbs:
    out = vpb.OutputLogProbs()
    for delta in deltas:
        for lp in delta.logprobs:
            out.token_logprobs.append(lp.logprob)
            out.token_ids.append(lp.token_id)
            out.top_logprobs.add(values=[t.logprob for t in lp.top], token_ids=[t.token_id for t in lp.top])
    return out


def chunk(delta: pb.TextDelta, started: pb.JobStarted, index: int = 0) -> vpb.GenerateResponse:
    """One streamed delta of sample `index`: its new token ids (the contract's chunks are deltas)."""
    c = vpb.GenerateStreamChunk(
        token_ids=delta.token_ids,
        prompt_tokens=started.prompt_tokens,
        completion_tokens=len(delta.token_ids),
        cached_tokens=started.cached_tokens,
        index=index,
    )
    if delta.logprobs:
        c.output_logprobs.CopyFrom(output_logprobs([delta]))
    return vpb.GenerateResponse(chunk=c)


def complete(
    finished: pb.JobFinished, output_ids: Sequence[int], logprobs: vpb.OutputLogProbs | None, index: int = 0
) -> vpb.GenerateResponse:
    """Sample `index`'s end: why (finish_reason, the matched stop), its counts and, not streamed,
    its tokens."""
    c = vpb.GenerateComplete(
        index=index,
        output_ids=output_ids,
        finish_reason=FINISH_REASONS.get(finished.stop_reason, "stop"),
        prompt_tokens=finished.prompt_tokens,
        completion_tokens=finished.new_tokens,
        cached_tokens=finished.cached_tokens,
        spec_accepted_tokens=finished.accepted_draft_tokens,
        spec_draft_tokens=finished.accepted_draft_tokens + finished.rejected_draft_tokens,
    )
    if finished.stop_reason == pb.STOP_REASON_STOP_STRING and finished.HasField("stop_string"):
        c.matched_stop_str = finished.stop_string
    elif finished.stop_reason == pb.STOP_REASON_STOP_TOKEN and finished.HasField("stop_token"):
        c.matched_token_id = finished.stop_token
    if logprobs is not None:
        c.output_logprobs.CopyFrom(logprobs)
    return vpb.GenerateResponse(complete=c)


# -- KV events and load -------------------------------------------------------------------------


def int64(h: int) -> int:
    """A 64-bit page hash as the contract's int64 (the same bits, read as signed)."""
    h &= 0xFFFF_FFFF_FFFF_FFFF
    return h - (1 << 64) if h >= 1 << 63 else h


def kv_event(event: KvEvent, event_id: int, page_size: int) -> cpb.KvCacheEvent:
    out = cpb.KvCacheEvent(event_id=event_id)
    match event:
        case BlockStored():
            stored = out.stored
            stored.blocks.add(
                block_hash=int64(event.block_hash), token_ids=event.token_ids, block_size=page_size
            )
            if event.parent_hash is not None:
                stored.parent_block_hash = int64(event.parent_hash)
            stored.tier = cpb.KV_CACHE_TIER_DEVICE
            stored.locality = cpb.KV_CACHE_LOCALITY_LOCAL
        case BlocksRemoved():
            out.removed.block_hashes.extend(int64(h) for h in event.block_hashes)
            out.removed.tier = cpb.KV_CACHE_TIER_DEVICE
            out.removed.locality = cpb.KV_CACHE_LOCALITY_LOCAL
        case AllBlocksCleared():
            out.cleared.SetInParent()
    return out


def engine_load(sample: LoadSample, serial: int, load_only: bool) -> cpb.EngineLoad:
    return cpb.EngineLoad(
        running_requests=sample.running,
        waiting_requests=sample.waiting,
        waiting_uncached_tokens=sample.waiting_prompt_tokens,
        token_usage=sample.token_usage,
        active_token_usage=sample.active_token_usage,
        gen_throughput=sample.gen_throughput,
        max_running_requests=sample.max_running,
        sample=serial,
        load_only=load_only,
        cache_hit_rate=sample.cache_hit_rate,
        num_used_tokens=sample.used_tokens,
        max_total_num_tokens=sample.total_tokens,
        prefill_pending_tokens=sample.waiting_prompt_tokens,
    )


def scheduler_load(sample: LoadSample) -> vpb.SchedulerLoad:
    return vpb.SchedulerLoad(
        dp_rank=0,
        num_running_reqs=sample.running,
        num_waiting_reqs=sample.waiting,
        num_total_reqs=sample.running + sample.waiting,
        num_used_tokens=sample.used_tokens,
        max_total_num_tokens=sample.total_tokens,
        token_usage=sample.token_usage,
        gen_throughput=sample.gen_throughput,
        cache_hit_rate=sample.cache_hit_rate,
        utilization=sample.running / sample.max_running if sample.max_running else 0.0,
        max_running_requests=sample.max_running,
        num_waiting_uncached_tokens=sample.waiting_prompt_tokens,
    )
