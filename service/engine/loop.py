"""EngineLoop: the DynamicGenerator behind the pipe (runs inside the engine process)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from multiprocessing.connection import Connection
from pathlib import Path

from engine.adapters.adapter_folder import AdapterPathError
from engine.adapters.adapter_registry import AdapterInfo
from engine.cache.kv_events import AllBlocksCleared, KvEvent
from engine.device import describe_device
from engine.errors import (
    AdapterExistsError,
    AdapterInUseError,
    AdapterLimitError,
    AdapterNotFoundError,
    DyngenError,
    FailedPreconditionError,
    InvalidRequestError,
    JobNotFoundError,
    ModelNotFoundError,
    PromptTooLongError,
    QueueFullError,
)
from engine.jobs import JobEvent, JobId
from engine.startup_objects import freeze_startup_objects
from kernels.cache_dir import default_cache_dir
from kernels.cpu_features import cpu_features
from service.engine.adapter_loads import AdapterLoads
from service.engine.build import build_engine
from service.engine_config import EngineConfig
from service.ipc import (
    Accepted,
    AdapterCommand,
    AdapterOp,
    AdapterView,
    EngineInfo,
    EngineStats,
    ErrorCode,
    Message,
    Ready,
    Rejection,
    Submit,
    Tag,
    pack_adapters,
    pack_events,
    pack_kv_events,
)
from service.pipe_sender import PipeSender
from service.speculation_flags import options_from_flags
from service.tokenizer_folder import write_model_files

log = logging.getLogger("dyngen.engine")

# Why the engine refused a request, by the error it raised (the first match; any other
# DyngenError is INVALID_ARGUMENT). A missing adapter folder is ModelNotFoundError.
_REFUSALS: tuple[tuple[type[DyngenError], ErrorCode], ...] = (
    (QueueFullError, ErrorCode.QUEUE_FULL),
    (AdapterPathError, ErrorCode.ADAPTER_PATH),
    (FailedPreconditionError, ErrorCode.FAILED_PRECONDITION),
    (PromptTooLongError, ErrorCode.PROMPT_TOO_LONG),
    (AdapterNotFoundError, ErrorCode.ADAPTER_NOT_FOUND),
    (ModelNotFoundError, ErrorCode.ADAPTER_NOT_FOUND),
    (AdapterExistsError, ErrorCode.ADAPTER_EXISTS),
    (AdapterInUseError, ErrorCode.ADAPTER_IN_USE),
    (AdapterLimitError, ErrorCode.ADAPTER_LIMIT),
)

STATS_INTERVAL = 0.5
IDLE_POLL = 0.25
LOAD_POLL = 0.005  # idle, with an adapter being read: how soon its install is seen


class EngineLoop:
    def __init__(
        self, config: EngineConfig, out: PipeSender, runtime_dir: str, imports_seconds: float = 0.0
    ) -> None:
        self.config = config
        start = {"imports": imports_seconds}  # the start's parts, in the engine_ready log
        t = time.monotonic()
        self.out = out
        speculation = options_from_flags(config.speculation)
        loaded, self.generator = build_engine(config.settings, speculation, progress=False)
        start["model"], t = time.monotonic() - t, time.monotonic()
        self.loaded = loaded
        # The server's own adapters (--lora), loaded at every start: every tenant sees them.
        self.shared_adapters = frozenset(name for name, _ in config.settings.lora_pairs())
        self.loads = AdapterLoads(self.generator.adapters)
        if config.warmup:
            self.generator.warmup(step_costs=default_cache_dir())  # the step-cost table kept there
        start["warmup"], t = time.monotonic() - t, time.monotonic()
        # The front end tokenizes (so a huge prompt never stalls decoding here): it loads the
        # model's tokenizer from this folder, far faster than parsing the model file again.
        tokenizer_dir = Path(runtime_dir) / "tokenizer"
        loaded.tokenizer.save(tokenizer_dir)
        write_model_files(
            tokenizer_dir, loaded.model.config, self.generator.eos_token_ids, self.generator.max_seq_len
        )
        start["tokenizer"] = time.monotonic() - t
        self._last_stats = 0.0
        self._kv_next = 0  # the first KV event not yet sent
        ready = Ready(
            loaded.path.name,
            str(tokenizer_dir),
            self.generator.max_seq_len,
            loaded.model.describe(),
            cpu_features().summary(),
            self.generator.cache.describe(),
            self.generator.cache.stored_dtype,
            loaded.model.config.vocab_size,
            self.generator.pool.num_pages * self.generator.pool.page_size,
            loaded.model.config.hidden_size,
            describe_device(loaded.model.device),
            self.generator.pool.page_size,
            self.generator.scheduler.describe_slices(),
            {k: round(v, 3) for k, v in start.items()},
        )
        self._send(Tag.READY, 0, ready.to_bytes())
        # After READY, not before: the collection (~0.1 s on 2 cores, walking torch's ~180k objects)
        # then runs while the front end turns to SERVING and sends the first jobs, which wait for it
        # in the pipe as they would have waited for READY.
        freeze_startup_objects()

    def close(self) -> None:
        self.loads.close()
        self.generator.close()

    def _send(self, tag: Tag, request: int, payload: bytes) -> None:
        self.out.send(tag, request, payload)

    def serve(self, commands: Connection) -> None:
        gen = self.generator
        while True:
            self.out.loop_pass = time.monotonic()
            # Never wait for commands while jobs are running; sleep on the pipe only when idle.
            idle_wait = LOAD_POLL if self.loads.busy else IDLE_POLL
            if commands.poll(0 if gen.has_work() else idle_wait):
                while True:
                    if not self._handle(Message.decode(commands.recv_bytes())):
                        return
                    if not commands.poll(0):
                        break
            if self.loads.busy:
                self._install_loaded()
            if gen.has_work():
                # A fault of one job is contained by the generator (that job finishes with
                # StopReason.ERROR); anything escaping it is a bug in the engine itself, and the
                # process ends so the front end restarts it rather than serve from broken state.
                events = gen.iterate(self._send_events)
                if self.config.fault_crash_marker:
                    self._fault_hook()
                self._send_events(events)
            self._send_kv_events()
            now = time.monotonic()
            if now - self._last_stats >= STATS_INTERVAL:
                self._last_stats = now
                self._send(Tag.STATS, 0, self._stats().to_bytes())

    def _send_events(self, events: list[JobEvent]) -> None:
        if events:
            self._send(Tag.EVENTS, 0, pack_events(events))

    def _fault_hook(self) -> None:
        """Tests only (--fault-crash-marker): die as a crash would, after a step that ran the marked job
        and before its results leave, so the job never gets past this step."""
        marker = self.config.fault_crash_marker
        if any(j.spec.identifier == marker for j in self.generator.scheduler.running):
            log.warning("fault hook: a job marked %r ran; the engine kills itself", marker)
            os.kill(os.getpid(), signal.SIGKILL)

    def _send_kv_events(self) -> None:
        """The prefix cache's new KV events, after the job events of the same iteration (a job's
        pages are announced no later than its last token). One that fell out of the log (more in
        one pass than it holds) is replaced by a snapshot: cleared, then every findable page."""
        gen = self.generator
        if gen.kv_events_next() == self._kv_next:
            return  # nothing new: most iterations of a decode
        events = gen.kv_events(self._kv_next)
        if events is None:
            snapshot: list[KvEvent] = [AllBlocksCleared(), *gen.kv_snapshot()]
            self._kv_next = gen.kv_events_next()
            self._send(Tag.KV_EVENTS, 0, pack_kv_events(snapshot))
        elif events:
            self._kv_next = events[-1][0] + 1
            self._send(Tag.KV_EVENTS, 0, pack_kv_events([e for _, e in events]))

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
            preemptions=s.preemptions,
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
                self._send(Tag.INFO_REPLY, msg.request, self._info().to_bytes())
            case Tag.FLUSH:
                dropped = self.generator.flush_prefix_cache()
                self._send_kv_events()  # the removals reach subscribers before the answer
                self._send(Tag.FLUSHED, msg.request, json.dumps({"dropped": dropped}).encode())
            case Tag.ADAPTER:
                self._adapter(msg)
            case Tag.QUIT:
                return False
            case _:
                pass  # engine-to-front-end tags never arrive here
        return True

    def _reject(self, request: int, code: ErrorCode, message: str, field: str | None = None) -> None:
        self._send(Tag.REJECTED, request, Rejection(code, message, field).to_bytes())

    def _refuse(self, request: int, exc: Exception, label: str) -> None:
        """Answer a request the engine refused; a malformed one must never take the engine down."""
        if isinstance(exc, DyngenError):
            code = next((c for kind, c in _REFUSALS if isinstance(exc, kind)), ErrorCode.INVALID_ARGUMENT)
            field = exc.field if isinstance(exc, InvalidRequestError) else None
            self._reject(request, code, str(exc), field)
        else:
            log.exception(label)
            self._reject(request, ErrorCode.INVALID_ARGUMENT, f"{label}: {type(exc).__name__}")

    def _submit(self, msg: Message) -> None:
        try:
            submit = Submit.from_bytes(msg.payload)
            spec = submit.spec
            job_id = self.generator.enqueue(spec, JobId(submit.job_id))
        except Exception as exc:
            self._refuse(msg.request, exc, "bad request")
        else:
            # The job's own count: less a token-healed prompt's taken-back token, as its events say.
            prompt_tokens = self.generator.jobs[job_id].prompt_len
            self._send(Tag.ACCEPTED, msg.request, Accepted(job_id, prompt_tokens).to_bytes())

    def _adapter(self, msg: Message) -> None:
        """Load, unload or list LoRA adapters. A load's files are read in a worker thread while jobs
        keep stepping (answered once installed, between iterations); the rest answer at once."""
        gen = self.generator
        try:
            cmd = AdapterCommand.from_bytes(msg.payload)
            match cmd.op:
                case AdapterOp.LOAD:
                    self.loads.start(msg.request, cmd.name, cmd.path)
                    return
                case AdapterOp.UNLOAD:
                    gen.unload_adapter(cmd.name)
                    infos = []
                case AdapterOp.LIST:
                    infos = gen.adapter_infos()
        except Exception as exc:
            self._refuse(msg.request, exc, "adapter command failed")
        else:
            self._send_adapters(msg.request, infos)

    def _install_loaded(self) -> None:
        for load in self.loads.finished():
            if load.error is not None:
                self._refuse(load.request, _exception(load.error), "adapter load failed")
            else:
                infos = [i for i in self.generator.adapter_infos() if i.name == load.name]
                self._send_adapters(load.request, infos)

    def _send_adapters(self, request: int, infos: list[AdapterInfo]) -> None:
        # The server's own adapters show no path: tenants never see the server's folders.
        views = [
            AdapterView(
                name=i.name,
                path="" if i.name in self.shared_adapters else i.label,
                description=i.description,
                jobs=i.jobs,
                shared=i.name in self.shared_adapters,
            )
            for i in infos
        ]
        self._send(Tag.ADAPTERS, request, pack_adapters(views))

    def _info(self) -> EngineInfo:
        g = self.generator
        s = g.stats()
        sc = g.scheduler.config
        return EngineInfo(
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
            quant=self.config.settings.quant,
            linears=self.loaded.model.describe(),
            cpu=cpu_features().summary(),
            kv_cache=g.cache.describe(),
            max_adapters=g.adapters.max_adapters,
            hidden_size=self.loaded.model.config.hidden_size,
            device=describe_device(self.loaded.model.device),
            iterations=s.iterations,
        )


def _exception(error: BaseException) -> Exception:
    """A worker's failure as an exception to refuse with (a BaseException that is not one, such as
    a cancelled read at shutdown, becomes a plain refusal)."""
    return error if isinstance(error, Exception) else RuntimeError(type(error).__name__)
