"""EngineLoop: the DynamicGenerator behind the pipe (runs inside the engine process)."""

from __future__ import annotations

import contextlib
import logging
import time
from multiprocessing.connection import Connection
from pathlib import Path

from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from engine.constraints import GrammarKind, ResponseFormat
from engine.errors import (
    DyngenError,
    ErrorKind,
    InvalidRequestError,
    JobNotFoundError,
    PromptTooLongError,
    QueueFullError,
)
from engine.jobs import (
    JobEvent,
    JobFinished,
    JobId,
    JobSpec,
    JobStarted,
    PrefillProgress,
    SamplingSettings,
    StopReason,
    TokensGenerated,
)
from kernels.cpu_features import cpu_features
from service.config import ServiceConfig
from service.engine_build import EngineSettings, build_engine
from service.ipc import Accepted, EngineStats, ErrorCode, Message, Ready, Rejection, Submit, Tag, pack_frames
from service.pipe_sender import PipeSender
from service.speculation_flags import speculation_options

log = logging.getLogger("dyngen.engine")

STATS_INTERVAL = 0.5
IDLE_POLL = 0.25

STOP_REASONS = {
    StopReason.EOS: pb.STOP_REASON_EOS,
    StopReason.STOP_TOKEN: pb.STOP_REASON_STOP_TOKEN,
    StopReason.STOP_STRING: pb.STOP_REASON_STOP_STRING,
    StopReason.MAX_NEW_TOKENS: pb.STOP_REASON_MAX_NEW_TOKENS,
    StopReason.CANCELLED: pb.STOP_REASON_CANCELLED,
    StopReason.ERROR: pb.STOP_REASON_ERROR,
    StopReason.GRAMMAR: pb.STOP_REASON_GRAMMAR,
}

# The status a failed job's stream ends with (google.rpc.Code numbers, as grpc.StatusCode has them).
ERROR_STATUS = {
    ErrorKind.INVALID_ARGUMENT: 3,
    ErrorKind.NOT_FOUND: 5,
    ErrorKind.RESOURCE_EXHAUSTED: 8,
    ErrorKind.UNSUPPORTED: 12,
    ErrorKind.INTERNAL: 13,
}


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
        case _:
            raise InvalidRequestError("response_format: set one of json_schema, regex or lark_grammar")


class EngineLoop:
    def __init__(self, config: ServiceConfig, out: PipeSender, runtime_dir: str) -> None:
        self.config = config
        self.out = out
        speculation = speculation_options(
            config.speculate,
            config.num_draft_tokens,
            config.max_ngram,
            config.speculate_max_batch,
            config.draft_model,
            config.draft_layers,
            config.draft_dtype,
        )
        settings = EngineSettings(
            model=config.model_path,
            dtype=config.dtype,
            quant=config.quant,
            page_size=config.page_size,
            cache_tokens=config.cache_tokens,
            kv_cache=config.kv_cache,
            max_batch_size=config.max_batch_size,
            chunk_size=config.chunk_size,
            max_queue=config.max_queue,
            sampling_threads=config.sampling_threads,
        )
        loaded, self.generator = build_engine(settings, speculation, progress=False)
        self.loaded = loaded
        if config.warmup:
            self.generator.warmup()
        # The front end tokenizes (so a huge prompt never stalls decoding here): it loads the
        # model's tokenizer from this folder, far faster than parsing the model file again.
        tokenizer_dir = Path(runtime_dir) / "tokenizer"
        loaded.tokenizer.save(tokenizer_dir)
        self._last_stats = 0.0
        ready = Ready(
            loaded.path.name,
            str(tokenizer_dir),
            self.generator.max_seq_len,
            loaded.model.describe(),
            cpu_features().summary(),
            self.generator.cache.describe(),
        )
        self._send(Tag.READY, 0, ready.to_bytes())

    def close(self) -> None:
        self.generator.close()

    def _send(self, tag: Tag, request: int, payload: bytes) -> None:
        self.out.send(tag, request, payload)

    def serve(self, commands: Connection) -> None:
        gen = self.generator
        while True:
            self.out.loop_pass = time.monotonic()
            # Never wait for commands while jobs are running; sleep on the pipe only when idle.
            if commands.poll(0 if gen.has_work() else IDLE_POLL):
                while True:
                    if not self._handle(Message.decode(commands.recv_bytes())):
                        return
                    if not commands.poll(0):
                        break
            if gen.has_work():
                # A fault of one job is contained by the generator (that job finishes with
                # StopReason.ERROR); anything escaping it is a bug in the engine itself, and the
                # process ends so the front end restarts it rather than serve from broken state.
                events = gen.iterate()
                if events:
                    frames = [event_to_proto(e).SerializeToString() for e in events]
                    self._send(Tag.EVENTS, 0, pack_frames(frames))
            now = time.monotonic()
            if now - self._last_stats >= STATS_INTERVAL:
                self._last_stats = now
                self._send(Tag.STATS, 0, self._stats().to_bytes())

    def _stats(self) -> EngineStats:
        s = self.generator.stats()
        return EngineStats(
            queued=s.queued,
            running=s.running,
            pages_free=s.pages_free,
            pages_cached=s.pages_cached,
            pages_used=s.pages_used,
            forwarded_tokens=s.forwarded_tokens,
            prefix_hit_tokens=s.prefix_hit_tokens,
            prefix_query_tokens=s.prefix_query_tokens,
        )

    def _handle(self, msg: Message) -> bool:
        match msg.tag:
            case Tag.SUBMIT:
                self._submit(msg)
            case Tag.CANCEL:
                # A job that finished (or was refused) meanwhile is fine: nothing left to stop.
                with contextlib.suppress(JobNotFoundError):
                    self.generator.cancel(JobId(msg.payload.decode("ascii")))
            case Tag.INFO:
                self._send(Tag.INFO_REPLY, msg.request, self._info().SerializeToString())
            case Tag.QUIT:
                return False
            case _:
                pass  # engine-to-front-end tags never arrive here
        return True

    def _reject(self, request: int, code: ErrorCode, message: str) -> None:
        self._send(Tag.REJECTED, request, Rejection(code, message).to_bytes())

    def _submit(self, msg: Message) -> None:
        try:
            submit = Submit.from_bytes(msg.payload)
            spec = self._spec(pb.GenerateRequest.FromString(submit.request))
            job_id = self.generator.enqueue(spec, JobId(submit.job_id))
        except QueueFullError as exc:
            self._reject(msg.request, ErrorCode.QUEUE_FULL, str(exc))
        except PromptTooLongError as exc:
            self._reject(msg.request, ErrorCode.PROMPT_TOO_LONG, str(exc))
        except DyngenError as exc:
            self._reject(msg.request, ErrorCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:  # a malformed request must never take the engine down
            log.exception("submit failed")
            self._reject(msg.request, ErrorCode.INVALID_ARGUMENT, f"bad request: {type(exc).__name__}")
        else:
            self._send(Tag.ACCEPTED, msg.request, Accepted(job_id, len(spec.prompt_ids)).to_bytes())

    def _spec(self, req: pb.GenerateRequest) -> JobSpec:
        s = req.sampling
        defaults = SamplingSettings()
        sampling = SamplingSettings(
            temperature=s.temperature if s.HasField("temperature") else defaults.temperature,
            top_k=s.top_k if s.HasField("top_k") else defaults.top_k,
            top_p=s.top_p if s.HasField("top_p") else defaults.top_p,
            min_p=s.min_p if s.HasField("min_p") else defaults.min_p,
            typical=s.typical if s.HasField("typical") else defaults.typical,
            repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
            frequency_penalty=s.frequency_penalty if s.HasField("frequency_penalty") else 0.0,
            presence_penalty=s.presence_penalty if s.HasField("presence_penalty") else 0.0,
            logit_bias=tuple((b.token_id, b.bias) for b in s.logit_bias),
            banned_token_ids=frozenset(s.banned_token_ids),
            seed=s.seed if s.HasField("seed") else None,
        )
        if req.WhichOneof("prompt") != "token_ids":
            raise InvalidRequestError("the engine takes prompts as token ids (the front end tokenizes)")
        return JobSpec(
            prompt_ids=tuple(req.token_ids.ids),
            max_new_tokens=req.max_new_tokens if req.HasField("max_new_tokens") else 256,
            min_new_tokens=req.min_new_tokens,
            stop_token_ids=frozenset(req.stop_token_ids),
            stop_strings=tuple(req.stop_strings),
            ignore_eos=req.ignore_eos,
            decode_special_tokens=req.decode_special_tokens,
            return_logprobs=req.return_logprobs,
            top_logprobs=req.top_logprobs,
            identifier=req.identifier or None,
            cache_salt=req.cache_salt,
            sampling=sampling,
            response_format=_response_format(req),
            banned_strings=tuple(req.banned_strings),
            token_healing=req.token_healing,
        )

    def _info(self) -> pb.ModelInfo:
        g = self.generator
        s = g.stats()
        sc = g.scheduler.config
        return pb.ModelInfo(
            model=self.loaded.path.name,
            vocab_size=self.loaded.model.config.vocab_size,
            context_length=g.max_seq_len,
            page_size=g.config.page_size,
            num_pages=g.config.num_pages,
            max_batch_size=sc.max_batch_size,
            max_queue_size=sc.max_q_size,
            max_chunk_size=sc.max_chunk_size,
            dtype=str(self.loaded.model.dtype).removeprefix("torch."),  # auto resolved
            queued_jobs=s.queued,
            running_jobs=s.running,
            pages_free=s.pages_free,
            pages_cached=s.pages_cached,
            pages_used=s.pages_used,
            quant=self.config.quant,
            linears=self.loaded.model.describe(),
            cpu=cpu_features().summary(),
            kv_cache=g.cache.describe(),
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
    return out
