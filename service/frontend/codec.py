"""The front end's translation between the public contract (dyngen.v1) and the engine's own types.

A tokenized GenerateRequest becomes the JobSpec the engine runs, here and nowhere else; each
JobEvent, EngineInfo and AdapterView the engine reports becomes its GenerateEvent, ModelInfo or
AdapterInfo. The engine process never sees the public proto. Fields the request leaves unset take
the engine's own defaults (JobSpec's, SamplingSettings'), so no default is written a second time.
"""

from __future__ import annotations

from collections.abc import Sequence

from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from engine.errors import ErrorKind, InvalidRequestError
from engine.grammar.response_format import GrammarKind, ResponseFormat
from engine.jobs import (
    JobEvent,
    JobFinished,
    JobSpec,
    JobStarted,
    PrefillProgress,
    SamplingSettings,
    StopReason,
    TokensGenerated,
)
from engine.output.loop_detector import LoopStop
from engine.prompt.guidance import Guidance
from engine.prompt.prompt_embeddings import place_embeddings
from service.embeddings import embedding_placements
from service.ipc import AdapterView, EngineInfo

STOP_REASONS = {
    StopReason.EOS: pb.STOP_REASON_EOS,
    StopReason.STOP_TOKEN: pb.STOP_REASON_STOP_TOKEN,
    StopReason.STOP_STRING: pb.STOP_REASON_STOP_STRING,
    StopReason.MAX_NEW_TOKENS: pb.STOP_REASON_MAX_NEW_TOKENS,
    StopReason.CANCELLED: pb.STOP_REASON_CANCELLED,
    StopReason.ERROR: pb.STOP_REASON_ERROR,
    StopReason.GRAMMAR: pb.STOP_REASON_GRAMMAR,
    StopReason.LOOP: pb.STOP_REASON_LOOP,
}

# The status a failed job's stream ends with (google.rpc.Code numbers, as grpc.StatusCode has them).
ERROR_STATUS = {
    ErrorKind.INVALID_ARGUMENT: 3,
    ErrorKind.NOT_FOUND: 5,
    ErrorKind.RESOURCE_EXHAUSTED: 8,
    ErrorKind.ALREADY_EXISTS: 6,
    ErrorKind.FAILED_PRECONDITION: 9,
    ErrorKind.UNSUPPORTED: 12,
    ErrorKind.INTERNAL: 13,
}

_SAMPLING = SamplingSettings()
_JOB = JobSpec(prompt_ids=(0,))


def _response_format(req: pb.GenerateRequest) -> ResponseFormat | None:
    if not req.HasField("response_format"):
        return None
    f = req.response_format
    match f.WhichOneof("format"):
        case "json_schema":
            return ResponseFormat(GrammarKind.JSON_SCHEMA, f.json_schema)
        case "regex":
            return ResponseFormat(GrammarKind.REGEX, f.regex)
        case "lark_grammar":
            return ResponseFormat(GrammarKind.LARK, f.lark_grammar)
        case "gbnf_grammar":
            return ResponseFormat(GrammarKind.GBNF, f.gbnf_grammar)
        case _:
            raise InvalidRequestError(
                "response_format: set one of json_schema, regex, lark_grammar or gbnf_grammar",
                "response_format",
            )


def sampling_settings(s: pb.SamplingSettings) -> SamplingSettings:
    d = _SAMPLING
    return SamplingSettings(
        temperature=s.temperature if s.HasField("temperature") else d.temperature,
        top_k=s.top_k if s.HasField("top_k") else d.top_k,
        top_p=s.top_p if s.HasField("top_p") else d.top_p,
        min_p=s.min_p if s.HasField("min_p") else d.min_p,
        typical=s.typical if s.HasField("typical") else d.typical,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else d.repetition_penalty,
        frequency_penalty=s.frequency_penalty if s.HasField("frequency_penalty") else d.frequency_penalty,
        presence_penalty=s.presence_penalty if s.HasField("presence_penalty") else d.presence_penalty,
        logit_bias=tuple((b.token_id, b.bias) for b in s.logit_bias),
        banned_token_ids=frozenset(s.banned_token_ids),
        seed=s.seed if s.HasField("seed") else d.seed,
    )


def max_new_tokens(req: pb.GenerateRequest) -> int:
    """The request's max_new_tokens, JobSpec's default when unset."""
    return req.max_new_tokens if req.HasField("max_new_tokens") else _JOB.max_new_tokens


def job_spec(
    req: pb.GenerateRequest,
    prompt_ids: Sequence[int],
    negative_ids: Sequence[int] | None = None,
    tenant: str = "",
    cache_salt: str | None = None,
    adapter: str | None = None,
) -> JobSpec:
    """The job `req` asks for, its prompt (and a guided job's negative prompt) already tokenized;
    `tenant`, the prefix cache's `cache_salt` and the `adapter`'s engine name as the front end
    decided them (None: the request's own). Prompt embeddings placed at placeholder tokens expand
    those tokens here (the job's prompt grows). InvalidRequestError where it cannot be a job."""
    ids, embeddings = place_embeddings(prompt_ids, embedding_placements(req))
    guidance = None
    if req.HasField("guidance"):
        if negative_ids is None:
            raise InvalidRequestError("guidance: the negative prompt is not tokenized", "guidance")
        guidance = Guidance(req.guidance.scale, tuple(negative_ids))
    return JobSpec(
        prompt_ids=ids,
        max_new_tokens=max_new_tokens(req),
        min_new_tokens=req.min_new_tokens,
        stop_token_ids=frozenset(req.stop_token_ids),
        stop_strings=tuple(req.stop_strings),
        ignore_eos=req.ignore_eos,
        decode_special_tokens=req.decode_special_tokens,
        return_logprobs=req.return_logprobs,
        top_logprobs=req.top_logprobs,
        identifier=req.identifier or None,
        cache_salt=req.cache_salt if cache_salt is None else cache_salt,
        sampling=sampling_settings(req.sampling),
        response_format=_response_format(req),
        banned_strings=tuple(req.banned_strings),
        token_healing=req.token_healing,
        adapter=(req.adapter or None) if adapter is None else adapter,
        stop_on_loop=LoopStop(req.stop_on_loop.window, req.stop_on_loop.min_repetitions)
        if req.HasField("stop_on_loop")
        else None,
        priority=req.priority,
        tenant=tenant,
        guidance=guidance,
        embeddings=embeddings,
    )


def event_to_proto(event: JobEvent) -> pb.GenerateEvent:
    out = pb.GenerateEvent(job_id=event.job_id, identifier=event.identifier or "")
    match event:
        case JobStarted():
            out.started.prompt_tokens = event.prompt_tokens
            out.started.cached_tokens = event.cached_tokens
        case PrefillProgress():
            out.prefill.done_tokens = event.done_tokens
            out.prefill.total_tokens = event.total_tokens
        case TokensGenerated():
            out.delta.text = event.text
            out.delta.token_ids.extend(event.token_ids)
            for lp in event.logprobs:
                out.delta.logprobs.append(
                    pb.TokenLogprob(
                        token_id=lp.token_id,
                        logprob=lp.logprob,
                        top=[pb.TopLogprob(token_id=t, logprob=p) for t, p in lp.top],
                        final_prob=lp.final_prob,
                        final_top=[pb.TopProb(token_id=t, prob=p) for t, p in lp.final_top],
                    )
                )
        case JobFinished():
            f = out.finished
            f.stop_reason = STOP_REASONS[event.stop_reason]
            if event.stop_token is not None:
                f.stop_token = event.stop_token
            if event.stop_string is not None:
                f.stop_string = event.stop_string
            f.prompt_tokens = event.prompt_tokens
            f.new_tokens = event.new_tokens
            f.cached_tokens = event.cached_tokens
            f.timings.queued_seconds = event.timings.queued
            f.timings.prefill_seconds = event.timings.prefill
            f.timings.decode_seconds = event.timings.decode
            f.text = event.text
            f.accepted_draft_tokens = event.accepted_draft_tokens
            f.rejected_draft_tokens = event.rejected_draft_tokens
            if event.error is not None:
                f.error = event.error.message
                f.error_code = ERROR_STATUS[event.error.kind]
            f.adapter = event.adapter or ""
    return out


def model_info(info: EngineInfo, replica: str) -> pb.ModelInfo:
    return pb.ModelInfo(
        model=info.model,
        vocab_size=info.vocab_size,
        context_length=info.context_length,
        page_size=info.page_size,
        num_pages=info.num_pages,
        max_batch_size=info.max_batch_size,
        max_queue_size=info.max_queue_size,
        max_chunk_size=info.max_chunk_size,
        dtype=info.dtype,
        queued_jobs=info.queued_jobs,
        running_jobs=info.running_jobs,
        pages_free=info.pages_free,
        pages_cached=info.pages_cached,
        pages_used=info.pages_used,
        quant=info.quant,
        linears=info.linears,
        cpu=info.cpu,
        kv_cache=info.kv_cache,
        replica=replica,
        max_adapters=info.max_adapters,
        hidden_size=info.hidden_size,
        device=info.device,
        iterations=info.iterations,
    )


def adapter_info(view: AdapterView) -> pb.AdapterInfo:
    return pb.AdapterInfo(
        name=view.name, path=view.path, description=view.description, jobs=view.jobs, shared=view.shared
    )
