"""EngineClient: the front end's side of the engine process.

A reader thread drains the engine's pipe all the time and hands each message to the
asyncio loop, which puts job events into per-job queues; so a slow or vanished consumer
never blocks the engine. Commands go out through a writer thread for the same reason.
When the process dies, every open job and pending request fails with EngineDownError and a
new process is started.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import structlog

from service.config import ServiceConfig
from service.engine_process import run as engine_main
from service.ipc import Accepted, EngineStats, Message, Rejection, Tag, unpack_frames
from service.proto.dyngen.v1 import generator_pb2 as pb

log = structlog.get_logger("dyngen.engine_client")


class EngineDownError(Exception):
    """The engine process is not running (starting, restarting, or stopped)."""


class EngineRejectedError(Exception):
    def __init__(self, rejection: Rejection) -> None:
        super().__init__(rejection.message)
        self.rejection = rejection


JobItem = pb.GenerateEvent | EngineDownError


@dataclass
class JobChannel:
    """Where one job's events wait for its (single) stream."""

    job_id: str
    prompt_tokens: int
    submitted_at: float
    events: asyncio.Queue[JobItem] = field(default_factory=asyncio.Queue)
    streamed: bool = False
    finished: bool = False
    grace_timer: asyncio.TimerHandle | None = None


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


class EngineClient:
    def __init__(self, config: ServiceConfig, loop: asyncio.AbstractEventLoop) -> None:
        self.config = config
        self.loop = loop
        self.jobs: dict[str, JobChannel] = {}
        self.model_name = ""
        self.ready = False
        self.stats: EngineStats | None = None
        self.on_state: list[StateListener] = []
        self.on_event: list[EventListener] = []
        self.on_stats: list[StatsListener] = []
        self.on_forget: list[Callable[[str], None]] = []  # a job's id left the table
        self._pending: dict[int, asyncio.Future[Message]] = {}
        self._numbers = itertools.count(1)
        self._proc: _Process | None = None
        self._generation = 0
        self._stopping = False
        self._first_ready: asyncio.Future[None] = loop.create_future()
        self.restarts = 0

    # -- process lifetime ----------------------------------------------------------------------

    def start(self) -> None:
        self._generation += 1
        ctx = mp.get_context("spawn")
        cmd_recv, cmd_send = ctx.Pipe(duplex=False)
        evt_recv, evt_send = ctx.Pipe(duplex=False)
        process = ctx.Process(
            target=engine_main,
            args=(self.config.to_json(), cmd_recv, evt_send),
            name="dyngen-engine",
            daemon=True,
        )
        process.start()
        cmd_recv.close()
        evt_send.close()
        proc = _Process(process, cmd_send, evt_recv, queue.SimpleQueue(), self._generation)
        self._proc = proc
        threading.Thread(target=self._reader, args=(proc,), name="engine-reader", daemon=True).start()
        threading.Thread(target=self._writer, args=(proc,), name="engine-writer", daemon=True).start()
        log.info("engine_starting", pid=process.pid)

    async def wait_ready(self) -> None:
        await self._first_ready

    @property
    def pid(self) -> int | None:
        return self._proc.process.pid if self._proc is not None else None

    def stop(self) -> None:
        self._stopping = True
        proc = self._proc
        if proc is None:
            return
        proc.outbox.put(Message(Tag.QUIT, 0, b"").encode())
        proc.outbox.put(None)
        proc.process.join(10)
        if proc.process.is_alive():
            proc.process.kill()
            proc.process.join(5)

    def _reader(self, proc: _Process) -> None:
        try:
            while True:
                data = proc.events.recv_bytes()
                self.loop.call_soon_threadsafe(self._dispatch, Message.decode(data))
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

    def _engine_gone(self, proc: _Process) -> None:
        if proc.generation != self._generation:
            return
        proc.outbox.put(None)
        self._set_ready(False)
        if self._stopping and not self.jobs:
            return
        log.warning("engine_down", exit_code=proc.process.exitcode, open_jobs=len(self.jobs))
        for job in list(self.jobs.values()):
            job.events.put_nowait(EngineDownError("the engine process stopped"))
            self._forget(job)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(EngineDownError("the engine process stopped"))
        self._pending.clear()
        if self._stopping:
            return
        if not self._first_ready.done():
            self._first_ready.set_exception(
                EngineDownError(f"the engine failed to start (exit code {proc.process.exitcode})")
            )
            return
        self.restarts += 1
        self.start()

    def _set_ready(self, ready: bool) -> None:
        self.ready = ready
        for listener in self.on_state:
            listener(ready)

    # -- messages from the engine --------------------------------------------------------------

    def _dispatch(self, msg: Message) -> None:
        match msg.tag:
            case Tag.EVENTS:
                for frame in unpack_frames(msg.payload):
                    self._job_event(pb.GenerateEvent.FromString(frame))
            case Tag.STATS:
                self.stats = EngineStats.from_bytes(msg.payload)
                for stats_listener in self.on_stats:
                    stats_listener(self.stats)
            case Tag.READY:
                self.model_name = msg.payload.decode()
                log.info("engine_ready", model=self.model_name, pid=self.pid)
                self._set_ready(True)
                if not self._first_ready.done():
                    self._first_ready.set_result(None)
            case _:
                fut = self._pending.pop(msg.request, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    def _job_event(self, event: pb.GenerateEvent) -> None:
        job = self.jobs.get(event.job_id)
        if job is None:
            return  # its stream is gone and the job was cancelled: nobody to tell
        for listener in self.on_event:
            listener(job, event)
        job.events.put_nowait(event)
        if event.HasField("finished"):
            job.finished = True
            if job.streamed:
                self._forget(job)

    # -- requests ------------------------------------------------------------------------------

    async def _call(self, tag: Tag, payload: bytes) -> Message:
        if not self.ready or self._proc is None:
            raise EngineDownError("the engine is not running")
        number = next(self._numbers)
        fut: asyncio.Future[Message] = self.loop.create_future()
        self._pending[number] = fut
        self._proc.outbox.put(Message(tag, number, payload).encode())
        try:
            reply = await fut
        finally:
            self._pending.pop(number, None)
        if reply.tag is Tag.REJECTED:
            raise EngineRejectedError(Rejection.from_bytes(reply.payload))
        return reply

    async def submit(self, request: pb.GenerateRequest, streamed: bool) -> JobChannel:
        """Queue a job; raises EngineRejectedError or EngineDownError. Unstreamed jobs get a grace timer."""
        reply = await self._call(Tag.SUBMIT, request.SerializeToString())
        accepted = Accepted.from_bytes(reply.payload)
        job = JobChannel(accepted.job_id, accepted.prompt_tokens, time.perf_counter(), streamed=streamed)
        self.jobs[job.job_id] = job
        if not streamed:
            job.grace_timer = self.loop.call_later(self.config.stream_grace_seconds, self._grace_expired, job)
        return job

    def _grace_expired(self, job: JobChannel) -> None:
        job.grace_timer = None
        if job.streamed:
            return
        log.info("job_not_streamed", job_id=job.job_id, grace_seconds=self.config.stream_grace_seconds)
        self.cancel(job.job_id)
        self._forget(job)

    def attach(self, job_id: str) -> JobChannel | None:
        """Claim a job's stream; None if unknown. Raises ValueError if already streamed."""
        job = self.jobs.get(job_id)
        if job is None:
            return None
        if job.streamed:
            raise ValueError(f"job {job_id} is already being streamed")
        job.streamed = True
        if job.grace_timer is not None:
            job.grace_timer.cancel()
            job.grace_timer = None
        return job

    def release(self, job: JobChannel) -> None:
        """The stream ended (finished, cancelled, disconnected): cancel the job if still running."""
        if not job.finished and job.job_id in self.jobs:
            self.cancel(job.job_id)
        self._forget(job)

    def _forget(self, job: JobChannel) -> None:
        if job.grace_timer is not None:
            job.grace_timer.cancel()
            job.grace_timer = None
        if self.jobs.pop(job.job_id, None) is not None:
            for listener in self.on_forget:
                listener(job.job_id)

    def cancel(self, job_id: str) -> None:
        if self._proc is not None:
            self._proc.outbox.put(Message(Tag.CANCEL, 0, job_id.encode("ascii")).encode())

    async def info(self) -> pb.ModelInfo:
        return pb.ModelInfo.FromString((await self._call(Tag.INFO, b"")).payload)

    async def tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        return pb.TokenizeResponse.FromString(
            (await self._call(Tag.TOKENIZE, request.SerializeToString())).payload
        )

    def kill_engine(self) -> None:
        """For tests and operators: end the engine process abruptly (it is restarted)."""
        if self._proc is not None:
            self._proc.process.kill()
