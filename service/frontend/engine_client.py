"""EngineClient: the front end's side of the engine process.

A reader thread drains the engine's pipe all the time and hands each message to the
asyncio loop, which puts job events into per-job buffers; so a slow or vanished consumer
never blocks the engine. Commands go out through a writer thread for the same reason.

Job ids are minted here and a job's channel exists before its SUBMIT leaves, so no event
can arrive for a job nobody listens to, and a caller that goes away before the engine
answered still gets its job cancelled (the CANCEL follows the SUBMIT down the same pipe).

Watchdog: the engine sends a heartbeat from a thread of its own. No heartbeat for
`watchdog_seconds` (the process is stopped, or wedged holding the GIL) turns health
NOT_SERVING; no heartbeat for `hang_seconds`, or a loop that has not gone round for
`loop_stall_seconds` (much longer: a slow iteration is not a hang), gets the process killed.

A dead (crashed, killed or hung) engine loses no job: each open job keeps its checked JobSpec
and the token ids its stream got, waits while the engine restarts (RestartPolicy), and is
submitted again under its own id with that output as JobSpec.resume_output, before the service
is SERVING again: its stream only pauses. job_resume.py holds them from the death to the
resumption, and crash_triage.py decides who resumes at once, who is tried alone first and who is
poisoned. A crash loop (starts that resumed nothing dying young)
ends in `failed`, and then the open jobs end with EngineDownError.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import queue
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

import structlog

from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from engine.ids import new_job_id
from engine.jobs import JobSpec, StopReason
from service.config import ServiceConfig
from service.engine_spawn import EarlyEngine, new_runtime_dir, spawn_engine
from service.frontend.codec import adapter_info, event_to_proto, model_info
from service.frontend.event_buffer import EngineDownError, EngineLostError, EngineRefusedConfigError
from service.frontend.job_channel import JobChannel, short_id
from service.frontend.job_resume import EngineCallError, JobResume, Recovery
from service.frontend.kv_event_relay import KvEventRelay
from service.frontend.limits import ModelBounds
from service.frontend.prompts import PromptTokenizer
from service.frontend.restart_policy import RestartPolicy, RestartTracker
from service.frontend.tokenizer_preload import TokenizerPreload
from service.ipc import (
    Accepted,
    AdapterCommand,
    AdapterOp,
    EngineInfo,
    EngineStats,
    ErrorCode,
    Heartbeat,
    Message,
    Ready,
    Rejection,
    Submit,
    Tag,
    unpack_adapters,
    unpack_events,
    unpack_kv_events,
)

log = structlog.get_logger("dyngen.engine_client")

WATCH_INTERVAL = 0.25
SPARE_DELAY_SECONDS = 10.0  # a spare engine is started this long after the serving one is ready
SPARE_RETRY_SECONDS = 5.0  # a spare engine that died waiting is replaced after this


class EngineRejectedError(Exception):
    def __init__(self, rejection: Rejection) -> None:
        super().__init__(rejection.message)
        self.rejection = rejection


class EngineBusyError(Exception):
    """Too many calls to the engine are waiting for an answer; try again later."""


StateListener = Callable[[bool], None]
EventListener = Callable[[JobChannel, pb.GenerateEvent], None]
StatsListener = Callable[[EngineStats], None]


@dataclass
class _Process:
    process: BaseProcess
    commands: Connection
    events: Connection
    outbox: queue.SimpleQueue[bytes | None]
    generation: int
    started_at: float
    last_heartbeat: float  # monotonic; written by the reader thread
    loop_age: float = 0.0
    ready_at: float | None = None
    killed: bool = False
    gone: bool = False  # its end was handled (_engine_gone): nothing more is sent to it


class EngineClient:
    def __init__(
        self, config: ServiceConfig, loop: asyncio.AbstractEventLoop, early: EarlyEngine | None = None
    ) -> None:
        """`early`: the first engine, already started (`dyngen serve` starts it before the front end's
        imports); used if it was started with this config's engine settings, else discarded."""
        self.config = config
        self.loop = loop
        self.jobs: dict[str, JobChannel] = {}
        # Named in every JobFinished and ModelInfo; the server sets "<hostname>:<port>" once bound.
        self.replica = config.replica_id
        self.model_name = ""
        self.kv_cache_dtype = ""  # the engine's, from its READY (the worker contract reports it)
        self.tokenizer_dir: str | None = None  # the engine's saved tokenizer folder, from its READY
        # The model's vocabulary, context, cache and embedding sizes, from the engine's READY (None before).
        self.bounds: ModelBounds | None = None
        self.prompts: PromptTokenizer | None = None
        self._preload: TokenizerPreload | None = None  # the first engine's tokenizer, loading beside it
        self.ready = False
        self.failed = False  # gave up restarting (crash loop)
        self.stats: EngineStats | None = None
        self.on_state: list[StateListener] = []
        self.on_event: list[EventListener] = []
        self.on_stats: list[StatsListener] = []
        self.on_forget: list[Callable[[str], None]] = []  # a job's id left the table
        # An unfinished job left with nobody to read its end, and why (its stream's end, or none).
        self.on_dropped: list[Callable[[str], None]] = []
        self.on_restart: list[Callable[[], None]] = []
        self.on_failed: list[Callable[[], None]] = []
        self._pending: dict[int, asyncio.Future[Message]] = {}
        self._numbers = itertools.count(1)
        self._proc: _Process | None = None
        self._generation = 0
        self._stopping = False
        self._first_ready: asyncio.Future[None] = loop.create_future()
        self._restarts = RestartTracker(
            RestartPolicy(
                backoff_seconds=config.restart_backoff_seconds,
                max_failures=config.max_restart_failures,
            )
        )
        if early is not None and early.config_json != config.engine_config().to_json():
            early.discard()
            early = None
        self._early = early
        self._runtime_dir = early.runtime_dir if early is not None else new_runtime_dir()
        self._watchdog: asyncio.Task[None] | None = None
        self._spare: _Process | None = None  # --spare-engine: imports done, waiting to replace the engine
        self._stalled = False
        self.restarts = 0
        # Engine name -> folder of each adapter loaded through LoadAdapter (not --lora): loaded again
        # on a restarted engine; written here alone, as the engine answers.
        self.adapter_loads: dict[str, str] = {}
        self.adapter_loading: set[str] = set()  # engine names of LoadAdapter calls awaiting the engine
        # Engine name -> why it could not be loaded again after a restart: requests naming it are
        # NOT_FOUND with that reason until it is loaded again or unloaded.
        self.adapter_lost: dict[str, str] = {}
        self.on_adapter_gone: list[Callable[[str], None]] = []  # an adapter's engine name left the engine
        # The prefix cache's KV events, numbered across engine restarts (SubscribeKvEvents).
        self.kv_events = KvEventRelay()
        self.on_recovered: list[Callable[[Recovery], None]] = []
        self.resume = JobResume(self, loop, self.on_recovered)  # open jobs across engine deaths

    # -- process lifetime ----------------------------------------------------------------------

    def start(self) -> None:
        self._generation += 1
        if self._generation == 1:  # the engine loads for seconds; the front end's tokenizer meanwhile
            self._preload = TokenizerPreload(self.config.model_path)
        spare, self._spare = self._spare, None
        if spare is not None and spare.process.is_alive():
            # Its imports are done: it only loads the model (--spare-engine).
            now = time.monotonic()
            spare.generation, spare.started_at, spare.last_heartbeat = self._generation, now, now
            spare.outbox.put(Message(Tag.START, 0, b"").encode())
            proc = spare
        else:
            if spare is not None:
                self._end_spare(spare)
            proc = self._spawn(spare=False)
        self._proc = proc
        self._stalled = False
        if self._watchdog is None:
            self._watchdog = self.loop.create_task(self._watch())
        log.info("engine_starting", pid=proc.process.pid, generation=self._generation, spare=proc is spare)

    def _spawn(self, spare: bool) -> _Process:
        """A new engine process (a spare: imports done, waiting for START), its reader and writer."""
        if self._early is not None and not spare:
            spawned, self._early = self._early.engine, None
        else:
            spawned = spawn_engine(self.config.engine_config().to_json(), self._runtime_dir, spare)
        generation = 0 if spare else self._generation  # a spare's own is set when it takes over
        at = spawned.started_at
        proc = _Process(
            spawned.process, spawned.commands, spawned.events, queue.SimpleQueue(), generation, at, at
        )
        threading.Thread(target=self._reader, args=(proc,), name="engine-reader", daemon=True).start()
        threading.Thread(target=self._writer, args=(proc,), name="engine-writer", daemon=True).start()
        return proc

    def _keep_spare(self) -> None:
        """With --spare-engine: have a spare engine process waiting (started after the serving one is
        ready, so that the two never load at once)."""
        if self.config.spare_engine and self._spare is None and not self._stopping and not self.failed:
            self._spare = self._spawn(spare=True)
            log.info("engine_spare_started", pid=self._spare.process.pid)

    def _end_spare(self, spare: _Process) -> None:
        spare.outbox.put(Message(Tag.QUIT, 0, b"").encode())
        spare.outbox.put(None)
        spare.process.join(5)
        if spare.process.is_alive():
            spare.process.kill()

    async def wait_ready(self) -> None:
        await self._first_ready

    @property
    def pid(self) -> int | None:
        return self._proc.process.pid if self._proc is not None else None

    def stop(self) -> None:
        self._stopping = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._spare is not None:
            self._end_spare(self._spare)
            self._spare = None
        proc = self._proc
        if proc is not None:
            proc.outbox.put(Message(Tag.QUIT, 0, b"").encode())
            proc.outbox.put(None)
            proc.process.join(10)
            if proc.process.is_alive():
                proc.process.kill()
                proc.process.join(5)
        if self._early is not None:  # stopped before it started any engine
            self._early.discard()
            self._early = None
        if self.prompts is not None:
            self.prompts.close()
        shutil.rmtree(self._runtime_dir, ignore_errors=True)

    def _reader(self, proc: _Process) -> None:
        try:
            while True:
                data = proc.events.recv_bytes()
                msg = Message.decode(data)
                if msg.tag is Tag.HEARTBEAT:
                    # Read by the watchdog; plain attribute writes, no loop wake-up per beat.
                    proc.loop_age = Heartbeat.from_bytes(msg.payload).loop_age
                    proc.last_heartbeat = time.monotonic()
                    continue
                self.loop.call_soon_threadsafe(self._dispatch, msg)
        except (EOFError, OSError):
            pass
        proc.process.join(5)
        self.loop.call_soon_threadsafe(self._engine_gone, proc)

    @staticmethod
    def _writer(proc: _Process) -> None:
        while (data := proc.outbox.get()) is not None:
            try:
                proc.commands.send_bytes(data)
            except OSError:
                return

    async def _watch(self) -> None:
        c = self.config
        while not self._stopping:
            await asyncio.sleep(WATCH_INTERVAL)
            proc = self._proc
            if proc is None or proc.killed or proc.generation != self._generation:
                continue
            silent = time.monotonic() - proc.last_heartbeat
            hung_loop = proc.ready_at is not None and proc.loop_age > c.loop_stall_seconds
            if silent > c.hang_seconds or hung_loop:
                log.error(
                    "engine_hung",
                    pid=proc.process.pid,
                    silent_seconds=round(silent, 2),
                    loop_age_seconds=round(proc.loop_age, 2),
                )
                proc.killed = True
                proc.process.kill()  # the reader sees EOF; _engine_gone restarts it
            elif silent > c.watchdog_seconds and not self._stalled:
                self._stalled = True
                log.warning("engine_unresponsive", pid=proc.process.pid, silent_seconds=round(silent, 2))
                self._set_ready(False)
            elif silent <= c.watchdog_seconds and self._stalled:
                self._stalled = False
                log.info("engine_responsive", pid=proc.process.pid)
                if proc.ready_at is not None:
                    self._set_ready(True)

    def _engine_gone(self, proc: _Process) -> None:
        if proc is self._spare:  # a spare that died waiting: another one later
            self._spare = None
            proc.outbox.put(None)
            log.warning("engine_spare_down", exit_code=proc.process.exitcode)
            self.loop.call_later(SPARE_RETRY_SECONDS, self._keep_spare)
            return
        if proc.generation != self._generation:
            return
        proc.gone = True
        proc.outbox.put(None)
        self._set_ready(False)
        self.kv_events.engine_stopped()
        if self._stopping and not self.jobs:
            return
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(EngineLostError("the engine process stopped"))
        self._pending.clear()
        self.resume.engine_lost()
        if self._stopping or not self._first_ready.done():
            self._drop_open_jobs()
        else:
            self.resume.triage()
        # Jobs whose first SUBMIT it never answered wait too (submit adopts them).
        waiting = sum(1 for j in self.jobs.values() if j.waiting or (j.submitting and not j.accepted))
        log.warning(
            "engine_down",
            exit_code=proc.process.exitcode,
            open_jobs=len(self.jobs),
            waiting=waiting,
            poisoned=self.resume.poisoned,
        )
        if self._stopping:
            return
        if not self._first_ready.done():
            code = proc.process.exitcode
            self._first_ready.set_exception(
                EngineRefusedConfigError(
                    "the engine refused its configuration (exit code 2; the `dyngen: engine error` line "
                    "says why)"
                )
                if code == 2
                else EngineDownError(f"the engine failed to start (exit code {code})")
            )
            return
        if waiting:
            self.resume.outage_begins()
        served = None if proc.ready_at is None else time.monotonic() - proc.ready_at
        delay = self._restarts.after_exit(served, resuming=waiting > 0)
        if delay is None:
            log.error("engine_crash_loop", failures=self._restarts.failures - 1)
            self._drop_open_jobs()
            self.failed = True
            for failed_listener in self.on_failed:
                failed_listener()
            return
        self.restarts += 1
        for restart_listener in self.on_restart:
            restart_listener()
        log.info("engine_restart_scheduled", delay_seconds=delay, failures=self._restarts.failures)
        self.loop.call_later(delay, self._restart)

    def _restart(self) -> None:
        if not self._stopping:
            self.start()

    # -- resuming jobs across engine restarts ---------------------------------------------------

    def _drop_open_jobs(self) -> None:
        """No engine to resume on (stopping, never started, crash loop): the open jobs end UNAVAILABLE."""
        for job in list(self.jobs.values()):
            if not job.finished:
                job.events.put(EngineDownError("the engine process stopped"))
                self._forget(job)

    # -- ResumeHost (job_resume.py) ---------------------------------------------------------------

    def emit(self, event: pb.GenerateEvent) -> None:
        self._job_event(event)

    async def submit_again(self, job_id: str, spec: JobSpec) -> None:
        try:
            await self._call(Tag.SUBMIT, Submit(job_id, spec).to_bytes(), before_ready=True)
        except EngineRejectedError as exc:
            raise EngineCallError(str(exc), exc.rejection.code is ErrorCode.ADAPTER_NOT_FOUND) from exc
        except EngineBusyError as exc:
            raise EngineCallError(str(exc)) from exc

    def engine_serving(self) -> bool:
        proc = self._proc
        return not self._stopping and proc is not None and proc.ready_at is not None and not proc.gone

    def engine_coming(self) -> bool:
        return not self._stopping and not self.failed and self._first_ready.done()

    def start_grace(self, job: JobChannel) -> None:
        job.grace_timer = self.loop.call_later(self.config.stream_grace_seconds, self._grace_expired, job)

    def _set_ready(self, ready: bool) -> None:
        self.ready = ready
        for listener in self.on_state:
            listener(ready)

    # -- messages from the engine --------------------------------------------------------------

    def _dispatch(self, msg: Message) -> None:
        match msg.tag:
            case Tag.EVENTS:
                for event in unpack_events(msg.payload):
                    self._job_event(event_to_proto(event))
            case Tag.KV_EVENTS:
                self.kv_events.publish(unpack_kv_events(msg.payload))
            case Tag.STATS:
                self.stats = EngineStats.from_bytes(msg.payload)
                for stats_listener in self.on_stats:
                    stats_listener(self.stats)
            case Tag.READY:
                self.loop.create_task(self._engine_ready(Ready.from_bytes(msg.payload)))
            case _:
                fut = self._pending.pop(msg.request, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    async def _engine_ready(self, ready: Ready) -> None:
        proc = self._proc
        if self.prompts is None:
            try:
                # Used once: a restarted engine's READY finds the tokenizer loaded.
                preload, self._preload = self._preload or TokenizerPreload(None, load=False), None
                self.prompts = await preload.take(Path(ready.tokenizer_dir))
            except Exception as exc:
                log.error("tokenizer_failed", error=str(exc))
                if proc is not None:
                    proc.process.kill()
                return
        if proc is None or proc is not self._proc:
            return
        proc.ready_at = time.monotonic()
        self.model_name = ready.model
        self.kv_cache_dtype = ready.kv_cache_dtype
        self.tokenizer_dir = ready.tokenizer_dir
        self.bounds = ModelBounds(
            ready.vocab_size, ready.context_length, ready.cache_tokens, ready.hidden_size, ready.page_size
        )
        log.info(
            "engine_ready",
            model=self.model_name,
            pid=self.pid,
            start_seconds=round(proc.ready_at - proc.started_at, 3),  # from spawn to READY handled
            start_parts=ready.start_seconds,  # in the engine: imports, model, warmup, tokenizer
            device=ready.device,
            linears=ready.linears,
            kv_cache=ready.kv_cache,
            prompt_slices=ready.prompt_slices,
            cpu=ready.cpu,
        )
        if self._first_ready.done() and self.adapter_loads:
            await self._reload_adapters()
            if proc is not self._proc:
                return  # it died while reloading
        await self.resume.resume_waiting()  # before new jobs: they are refused until ready
        if proc is not self._proc:
            return
        self._set_ready(not self._stalled)
        # Later, not now: its imports would take a core from the resumed jobs' prefill.
        self.loop.call_later(SPARE_DELAY_SECONDS, self._keep_spare)
        if not self._first_ready.done():
            self._first_ready.set_result(None)

    def _job_event(self, event: pb.GenerateEvent) -> None:
        job = self.jobs.get(event.job_id)
        if job is None:
            return  # its stream is gone and the job was cancelled: nobody to tell
        match event.WhichOneof("event"):
            case "delta":
                job.delivered.extend(event.delta.token_ids)
                self.resume.delivered(job)
            case "started":
                self.resume.started(job)
                if job.started_sent:
                    return  # a resumed job's: its caller saw it start
                job.started_sent, job.cached_tokens = True, event.started.cached_tokens
            case "prefill":
                if job.resumes:
                    return  # the resumed job's prefill of its prompt and output: not the caller's
            case "finished":
                event.finished.replica = self.replica
                if job.resumes:
                    event.finished.cached_tokens = job.cached_tokens  # its first admission's
        for listener in self.on_event:
            listener(job, event)
        job.events.put(event)
        if event.HasField("finished"):
            job.finished = True
            if job.streamed:
                self._forget(job)

    # -- requests ------------------------------------------------------------------------------

    def _send(self, tag: Tag, request: int, payload: bytes) -> None:
        if self._proc is None:
            raise EngineDownError("the engine is not running")
        self._proc.outbox.put(Message(tag, request, payload).encode())

    async def _call(self, tag: Tag, payload: bytes, before_ready: bool = False) -> Message:
        """Send a request and wait for its answer (at most engine_call_timeout_seconds). Refused
        while the engine is not ready, unless `before_ready` (the restart's own calls)."""
        if not (self.ready or before_ready) or self._proc is None:
            raise EngineDownError("the engine is not running")
        # Bounds what waits in the outbox: every pending call is one message there at most.
        if len(self._pending) >= self.config.max_pending_calls:
            raise EngineBusyError(f"{len(self._pending)} calls are waiting for the engine; try again later")
        number = next(self._numbers)
        fut: asyncio.Future[Message] = self.loop.create_future()
        self._pending[number] = fut
        self._send(tag, number, payload)
        try:
            reply = await asyncio.wait_for(fut, self.config.engine_call_timeout_seconds)
        except TimeoutError:
            raise EngineDownError(
                f"the engine did not answer within {self.config.engine_call_timeout_seconds} s"
            ) from None
        finally:
            self._pending.pop(number, None)
        if reply.tag is Tag.REJECTED:
            raise EngineRejectedError(Rejection.from_bytes(reply.payload))
        return reply

    async def submit(self, spec: JobSpec, owner: str, streamed: bool) -> JobChannel:
        """Queue a job the front end built and checked.

        Raises EngineRejectedError, EngineBusyError or EngineDownError. The channel is
        registered before the engine hears of the job; whatever way this call ends without
        the job accepted (refused, caller gone, deadline), nothing is left behind. An engine that
        dies with the SUBMIT unanswered does not end it: it waits for the next engine like any
        open job (JobResume.adopt_unanswered)."""
        job = JobChannel(new_job_id(), owner, time.perf_counter(), streamed=streamed, priority=spec.priority)
        self.jobs[job.job_id] = job
        self.resume.submit_sent(job)
        try:
            reply = await self._call(Tag.SUBMIT, Submit(job.job_id, spec).to_bytes())
        except EngineRejectedError:
            self._forget(job)  # refused: the engine holds nothing
            raise
        except EngineLostError:
            if not self.engine_coming():
                self._forget(job)
                raise
            job.accepted, job.spec, job.prompt_tokens = True, spec, len(spec.prompt_ids)
            self.resume.adopt_unanswered(job)
            if not streamed:
                self.start_grace(job)
            return job
        except BaseException:
            # Cancelled or timed out while waiting: the engine may have queued it; the CANCEL
            # travels behind the SUBMIT, so it finds the job (or nothing, harmlessly).
            self.cancel(job)
            self._forget(job)
            raise
        finally:
            self.resume.submit_answered(job)
        job.accepted, job.spec = True, spec
        job.prompt_tokens = Accepted.from_bytes(reply.payload).prompt_tokens
        if not streamed and not job.finished:
            self.start_grace(job)
        return job

    def _grace_expired(self, job: JobChannel) -> None:
        job.grace_timer = None
        if job.streamed:
            return
        log.info("job_not_streamed", job=short_id(job.job_id), grace_seconds=self.config.stream_grace_seconds)
        self._drop(job, "not_streamed")
        self._forget(job)

    def lookup(self, job_id: str, owner: str) -> JobChannel | None:
        """The job, if it exists and belongs to `owner`; another tenant's job is as good as unknown."""
        job = self.jobs.get(job_id)
        if job is None or job.owner != owner or not job.accepted:
            return None
        return job

    def priority_jobs(self, owner: str) -> int:
        """`owner`'s jobs of priority > 0 that are queued or running: not finished, not cancelled
        (a cancelled job leaves the engine at its next iteration), submitted or being submitted."""
        return sum(
            1
            for j in self.jobs.values()
            if j.priority > 0 and j.owner == owner and not j.finished and not j.cancel_sent
        )

    def attach(self, job_id: str, owner: str) -> JobChannel | None:
        """Claim a job's stream; None if unknown. Raises ValueError if already streamed."""
        job = self.lookup(job_id, owner)
        if job is None:
            return None
        if job.streamed:
            raise ValueError("this job is already being streamed")
        job.streamed = True
        if job.grace_timer is not None:
            job.grace_timer.cancel()
            job.grace_timer = None
        if job.finished:  # finished before anyone streamed it: its events wait in the buffer
            self._forget(job)
        return job

    def release(self, job: JobChannel, why: str) -> None:
        """The stream ended (finished, cancelled, disconnected): cancel the job if still running.
        `why` names how an unfinished job's stream ended, for on_dropped."""
        if not job.finished and job.job_id in self.jobs:
            self._drop(job, why)
        self._forget(job)

    def _drop(self, job: JobChannel, why: str) -> None:
        """Cancel an unfinished job nobody will read; its JobFinished (if any) goes unseen, so
        on_dropped counts it instead (a job waiting for a restarted engine ends at once, counted
        by its own JobFinished)."""
        self.cancel(job)
        if not job.finished:
            for listener in self.on_dropped:
                listener(why)

    def _forget(self, job: JobChannel) -> None:
        if job.grace_timer is not None:
            job.grace_timer.cancel()
            job.grace_timer = None
        if self.jobs.pop(job.job_id, None) is not None:
            for listener in self.on_forget:
                listener(job.job_id)
            self.resume.forgotten(job)

    def cancel(self, job: JobChannel) -> None:
        """Ask the engine to stop the job (once: a job's cancels never pile up in the outbox); a job
        waiting for a restarted engine ends CANCELLED at once."""
        if job.waiting and not job.finished:
            self.resume.end(job, StopReason.CANCELLED)
            return
        if job.cancel_sent or job.finished or self._proc is None:
            return
        job.cancel_sent = True
        self._proc.outbox.put(Message(Tag.CANCEL, 0, job.job_id.encode("ascii")).encode())

    def unfinished_jobs(self) -> int:
        """Jobs the engine still queues or runs, or a restarted one will resume. A finished job whose
        events wait for a `Stream` call (until its grace timer) is not one: a drain waits for these only."""
        return sum(1 for j in self.jobs.values() if not j.finished)

    def cancel_all(self) -> None:
        for job in list(self.jobs.values()):
            self.cancel(job)

    async def adapters(self, command: AdapterCommand) -> pb.ListAdaptersResponse:
        """Load, unload or list the engine's LoRA adapters. Loads made here are made again on a
        restarted engine (the server's own, --lora, are in its configuration); raises
        EngineRejectedError, EngineBusyError or EngineDownError."""
        if command.op is AdapterOp.UNLOAD and command.name in self.adapter_lost:
            # Not in the engine since its restart: forgetting it is all an unload has to do.
            del self.adapter_lost[command.name]
            self._adapter_gone(command.name)
            return pb.ListAdaptersResponse()
        loading = command.op is AdapterOp.LOAD
        if loading:
            self.adapter_loading.add(command.name)  # before any await: the tenant cap counts it
        try:
            reply = await self._call(Tag.ADAPTER, command.to_bytes())
        finally:
            if loading:
                self.adapter_loading.discard(command.name)
        if loading:
            self.adapter_loads[command.name] = command.path
            self.adapter_lost.pop(command.name, None)
        elif command.op is AdapterOp.UNLOAD:
            self.adapter_loads.pop(command.name, None)
            self._adapter_gone(command.name)
        return pb.ListAdaptersResponse(adapters=[adapter_info(v) for v in unpack_adapters(reply.payload)])

    def _adapter_gone(self, name: str) -> None:
        for listener in self.on_adapter_gone:
            listener(name)

    async def _reload_adapters(self) -> None:
        """A restarted engine has only its --lora adapters: load the callers' ones again (before it
        is READY, so no request meets it without them). One that fails is lost: requests naming it
        are NOT_FOUND with the reason, and the log says so."""
        for name, path in list(self.adapter_loads.items()):
            try:
                await self._call(
                    Tag.ADAPTER, AdapterCommand(AdapterOp.LOAD, name, path).to_bytes(), before_ready=True
                )
            except Exception as exc:
                self.adapter_loads.pop(name, None)
                self.adapter_lost[name] = str(exc) or type(exc).__name__
                self._adapter_gone(name)
                log.error("adapter_not_reloaded", adapter=name, path=path, error=self.adapter_lost[name])

    async def flush_cache(self) -> int:
        """Drop the cached prefix pages no job holds; how many were dropped. Raises EngineBusyError
        or EngineDownError."""
        return int(json.loads((await self._call(Tag.FLUSH, b"")).payload)["dropped"])

    async def info(self) -> pb.ModelInfo:
        return model_info(EngineInfo.from_bytes((await self._call(Tag.INFO, b"")).payload), self.replica)

    def kill_engine(self) -> None:
        """For tests and operators: end the engine process abruptly (it is restarted)."""
        if self._proc is not None:
            self._proc.process.kill()
