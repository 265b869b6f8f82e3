"""Soak: many concurrent streams against a real `dyngen serve` for N minutes, with random
cancels, disconnects and short deadlines, watching for errors, lost events, leaked jobs and
memory growth.

`python -m benchmarks soak --minutes N` starts `dyngen serve` on 127.0.0.1 (or drives
`--target host:port`) and runs `--streams` workers. Each worker loops: it draws a request
(random prompt form and length, random max_new_tokens, greedy or seeded sampling, sometimes
a shared prefix) and one of five behaviours, all from one seeded generator per worker:

- complete:    Generate, read every event
- cancel:      Generate, cancel the call after k events (k = 0: before the first one)
- disconnect:  Generate on its own channel, close the channel after k events
- deadline:    Generate with a deadline of 20 ms to 2 s
- cancel_rpc:  Enqueue, Stream, the Cancel RPC after k events, read to the end

Calls still open 30 s after the end are cancelled (outcome cut_at_end), so a run takes its
minutes plus at most that; a call that is not a deadline request gets 600 s before it
counts as hung.

Expected: OK; CANCELLED for calls this client cancelled or whose channel it closed;
DEADLINE_EXCEEDED for deadline requests; RESOURCE_EXHAUSTED at admission (queue or stream
limit full); NOT_FOUND from a Cancel that raced its job's own finish. Everything else is an
unexpected error, and so is an OK stream that does not end with exactly one JobFinished
whose token count matches the deltas (a lost event).

The RSS of the front-end process and of the engine process (its spawned child) is sampled
every second: growth is the median of the last tenth of the run over the median of the
tenth right after warm-up (the first quarter). At the end the engine's pool must be idle
(GetModelInfo: no running or queued job, no page in use). With the RSS, the engine's job
count (running + queued) is sampled against the calls open in this client (plus those that
ended in the last second, whose cancels may be on their way): a job outlives its call only
for the moment its cancel takes, so a median above 0 means orphaned jobs (a caller gone,
its job still running). Exit status 1 if any unexpected error, RSS growth
>= 5 % in either process, orphans, or a pool not idle.

Fault mode (`--kill-every S`): the engine process is SIGKILLed every S seconds. Open jobs must
resume on the restarted engine (an OK stream with a token lost or sent twice is unexpected);
UNAVAILABLE at admission while it restarts is expected (outcome `restarting`), and only the
front end's RSS is gated (every engine is young).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import grpc
import psutil  # type: ignore[import-untyped, unused-ignore]

from benchmarks.served.service_load import START_TIMEOUT, wait_serving
from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from dyngen_client.proto.dyngen.v1 import generator_pb2_grpc as pb_grpc
from service.cluster import free_port

MAX_RSS_GROWTH_PERCENT = 5.0
CANCEL_SETTLE_SECONDS = 1.0  # a call that ended this recently may still have its job in the engine
KINDS = ("complete", "cancel", "disconnect", "deadline", "cancel_rpc")
KIND_WEIGHTS = (0.40, 0.20, 0.15, 0.15, 0.10)
_COMMON_WORDS = (
    "the a of and to in is it you that he was for on are with as his they be at one have this from or "
    "had by hot word but what some we can out other were all there when up use your how said an each "
    "she which do their time if will way about many then them write would like so these her long make "
    "thing see him two has look more day could go come did number sound no most people my over know "
    "water than call first who may down side been now find any new work part take get place made live "
    "where after back little only round man year came show every good me give our under name very "
    "through just form sentence great think say help low line differ turn cause much mean before move "
    "right boy old too same tell does set three want air well also play small end put home read hand "
    "port large spell add even land here must big high such follow act why ask men change went light "
)
WORDS = tuple(_COMMON_WORDS.split())


class Outcome(Enum):
    FINISHED = "finished"  # OK, a well-formed stream to its JobFinished
    CANCELLED = "cancelled"  # we cancelled the call (or closed its channel) before it ended
    CANCEL_RPC = "cancel_rpc"  # the Cancel RPC ended the job (finish reason CANCELLED)
    DEADLINE = "deadline"  # DEADLINE_EXCEEDED on a deadline request
    QUEUE_FULL = "queue_full"  # RESOURCE_EXHAUSTED at admission
    RESTARTING = "restarting"  # UNAVAILABLE at admission while the engine restarts (fault mode only)
    CUT = "cut_at_end"  # still open `end_grace` after the end of the run: we cancelled it
    UNEXPECTED = "unexpected"


@dataclass(frozen=True)
class SoakSettings:
    seconds: float
    streams: int = 64
    seed: int = 0
    max_new_tokens: int = 256  # each request draws 1..this
    max_prompt_words: int = 300  # each prompt draws 1..this words (or as many random token ids)
    warmup_fraction: float = 0.25
    sample_interval: float = 1.0
    call_timeout: float = 600.0  # any request not meant to hit a deadline; past it = a hang
    end_grace: float = 30.0  # requests still open this long after the end are cancelled (by us)
    idle_timeout: float = 20.0  # after the run: how long the pool may take to become idle
    cut_is_error: bool = False  # a call still open `end_grace` after the end is unexpected (fast models)
    kill_every: float = 0.0  # fault mode: SIGKILL the engine process this often (seconds; 0 = never)


@dataclass(frozen=True)
class RssSample:
    t: float  # seconds since the run started
    front_end: int  # bytes
    engine: int  # bytes (0 if no engine process was found)
    engine_pid: int


@dataclass
class SoakReport:
    settings: SoakSettings
    seconds: float = 0.0
    requests: Counter[tuple[str, str]] = field(default_factory=Counter)  # (kind, outcome)
    statuses: Counter[str] = field(default_factory=Counter)  # gRPC status name of each call
    unexpected: list[str] = field(default_factory=list)  # first few, with details
    unexpected_count: int = 0
    tokens: int = 0
    samples: list[RssSample] = field(default_factory=list)
    final_info: pb.ModelInfo | None = None
    engine_pids: set[int] = field(default_factory=set)
    # Sampled with the RSS: jobs the engine holds (running + queued) beyond the calls open here.
    # A job is ours only while its call is open (plus the moment its cancel takes), so a value
    # that stays positive or grows means jobs outliving their callers (orphans).
    excess_jobs: list[int] = field(default_factory=list)
    kills: int = 0  # engine processes this run killed (fault mode)

    @property
    def total_requests(self) -> int:
        return sum(self.requests.values())

    @property
    def pool_idle(self) -> bool:
        i = self.final_info
        return i is not None and i.running_jobs == 0 and i.queued_jobs == 0 and i.pages_used == 0

    def rss_growth(self, which: str) -> float | None:
        """Percent growth of `which` ('front_end' or 'engine') from just after warm-up to the end."""
        if not self.samples:
            return None
        warm = self.settings.warmup_fraction * self.seconds
        window = max(0.1 * self.seconds, 2 * self.settings.sample_interval)
        samples = self.present(which)
        early = [getattr(s, which) for s in samples if warm <= s.t < warm + window]
        late = [getattr(s, which) for s in samples if s.t >= self.seconds - window]
        if not early or not late or statistics.median(early) <= 0:
            return None
        return float(100.0 * (statistics.median(late) / statistics.median(early) - 1.0))

    def present(self, which: str) -> list[RssSample]:
        """The samples where the process existed (no engine while it restarts)."""
        return [s for s in self.samples if getattr(s, which) > 0]

    @property
    def orphans(self) -> bool:
        """More jobs in the engine than calls open here in most samples (the median)."""
        return bool(self.excess_jobs) and statistics.median(self.excess_jobs) > 0

    @property
    def passed(self) -> bool:
        # In fault mode every engine is young: its RSS says nothing of growth.
        growth = [self.rss_growth(w) for w in ("front_end", "engine")[: 1 if self.settings.kill_every else 2]]
        return (
            self.unexpected_count == 0
            and self.pool_idle
            and not self.orphans
            and all(g is None or g < MAX_RSS_GROWTH_PERCENT for g in growth)
        )


# -- requests -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    kind: str
    request: pb.GenerateRequest
    after_events: int  # cancel / disconnect / Cancel RPC after this many events
    pause: float  # with after_events 0: seconds between starting the call and ending it
    deadline: float  # seconds, for 'deadline'


class RequestMaker:
    """One worker's requests, all drawn from its own seeded generator."""

    def __init__(self, seed: int, settings: SoakSettings, vocab_size: int, preamble: str) -> None:
        self.rng = random.Random(seed)
        self.settings = settings
        self.vocab_size = vocab_size
        self.preamble = preamble

    def words(self) -> str:
        n = max(1, int(self.settings.max_prompt_words ** self.rng.random()))  # log-uniform 1..max
        text = " ".join(self.rng.choice(WORDS) for _ in range(n))
        return self.preamble + " " + text if self.rng.random() < 0.3 else text

    def request(self) -> pb.GenerateRequest:
        rng = self.rng
        req = pb.GenerateRequest(max_new_tokens=rng.randint(1, self.settings.max_new_tokens))
        form = rng.random()
        if form < 0.5:
            req.chat.messages.add(role="user", content=self.words())
        elif form < 0.85:
            req.text = self.words()
        else:
            n = max(1, int(self.settings.max_prompt_words ** rng.random()))
            req.token_ids.ids.extend(rng.randrange(3, self.vocab_size) for _ in range(n))
        if rng.random() < 0.5:
            req.ignore_eos = True
        if rng.random() < 0.5:
            req.sampling.temperature = rng.choice((0.5, 0.8, 1.0))
            req.sampling.top_p = 0.95
            req.sampling.seed = rng.getrandbits(32)
        if rng.random() < 0.1:
            req.stop_strings.append(rng.choice(WORDS))
        if rng.random() < 0.1:
            req.return_logprobs = True
            req.top_logprobs = rng.randint(0, 5)
        req.identifier = f"soak-{rng.getrandbits(32):08x}"
        return req

    def plan(self) -> Plan:
        kind = self.rng.choices(KINDS, KIND_WEIGHTS)[0]
        req = self.request()
        after = self.rng.choice((0, 1, 2, self.rng.randint(0, max(1, req.max_new_tokens))))
        pause = 0.05 * self.rng.random()
        deadline = 0.02 * 100 ** self.rng.random()  # 20 ms .. 2 s, log-uniform
        if kind == "deadline" or (kind in ("cancel", "disconnect") and after == 0):
            # Ended around admission, where a job can lose its caller: make it long, so an
            # orphan would run for many seconds and show in the job count, not hide in a blink.
            req.max_new_tokens = 4 * self.settings.max_new_tokens
            req.ignore_eos = True
        return Plan(kind, req, after, pause, deadline)


# -- one request ----------------------------------------------------------------------------------


@dataclass
class Verdict:
    outcome: Outcome
    status: str  # gRPC status name of the main call
    tokens: int = 0
    detail: str = ""


def check_stream(request: pb.GenerateRequest, events: Sequence[pb.GenerateEvent]) -> str:
    """Why a stream that ended OK is malformed ('' if it is well formed)."""
    if not events or not events[-1].HasField("finished"):
        return f"OK stream without a JobFinished at the end ({len(events)} events)"
    finishes = sum(1 for e in events if e.HasField("finished"))
    if finishes != 1:
        return f"{finishes} JobFinished events"
    f = events[-1].finished
    ids = sum(len(e.delta.token_ids) for e in events if e.HasField("delta"))
    if pb.StopReason.Name(f.stop_reason) in ("STOP_REASON_UNSPECIFIED", "STOP_REASON_ERROR"):
        return f"finish reason {pb.StopReason.Name(f.stop_reason)}"
    if f.stop_reason != pb.STOP_REASON_CANCELLED and ids != f.new_tokens:
        return f"deltas hold {ids} tokens, JobFinished says {f.new_tokens}"
    if f.new_tokens > request.max_new_tokens:
        return f"{f.new_tokens} new tokens > max_new_tokens {request.max_new_tokens}"
    if (
        f.stop_reason != pb.STOP_REASON_CANCELLED
        and request.ignore_eos
        and not request.stop_strings
        and f.stop_reason != pb.STOP_REASON_MAX_NEW_TOKENS
    ):
        return f"ignore_eos job stopped by {pb.StopReason.Name(f.stop_reason)}"
    job_ids = {e.job_id for e in events}
    if len(job_ids) != 1 or not next(iter(job_ids)):
        return f"job ids {sorted(job_ids)[:3]}"
    if any(e.identifier != request.identifier for e in events):
        return "an event without the request's identifier"
    return ""


def _tokens(events: Sequence[pb.GenerateEvent]) -> int:
    return sum(len(e.delta.token_ids) for e in events if e.HasField("delta"))


async def _status(call: grpc.aio.Call) -> str:
    try:
        return str((await call.code()).name)
    except (asyncio.CancelledError, grpc.aio.AioRpcError):
        return "CANCELLED"


async def run_plan(stub: pb_grpc.GeneratorAsyncStub, target: str, plan: Plan, timeout: float) -> Verdict:
    match plan.kind:
        case "complete" | "deadline":
            return await _complete(stub, plan, plan.deadline if plan.kind == "deadline" else timeout)
        case "cancel":
            return await _cancel(stub, plan, timeout)
        case "disconnect":
            return await _disconnect(target, plan, timeout)
        case _:
            return await _cancel_rpc(stub, plan, timeout)


def _admission_or_unexpected(kind: str, exc: grpc.aio.AioRpcError, events: int, tokens: int) -> Verdict:
    code = exc.code()
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and events == 0:
        return Verdict(Outcome.QUEUE_FULL, code.name)
    if code == grpc.StatusCode.UNAVAILABLE and events == 0:
        return Verdict(
            Outcome.RESTARTING, code.name, 0, f"{kind}: UNAVAILABLE at admission: {exc.details()!r}"
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and kind == "deadline":
        return Verdict(Outcome.DEADLINE, code.name, tokens)
    return Verdict(Outcome.UNEXPECTED, code.name, tokens, f"{kind}: {code.name}: {exc.details()!r}")


async def _complete(stub: pb_grpc.GeneratorAsyncStub, plan: Plan, timeout: float) -> Verdict:
    events: list[pb.GenerateEvent] = []
    call = stub.Generate(plan.request, timeout=timeout)
    try:
        async for event in call:
            events.append(event)
    except grpc.aio.AioRpcError as exc:
        return _admission_or_unexpected(plan.kind, exc, len(events), _tokens(events))
    problem = check_stream(plan.request, events)
    if problem:
        return Verdict(Outcome.UNEXPECTED, "OK", _tokens(events), f"{plan.kind}: {problem}")
    return Verdict(Outcome.FINISHED, "OK", _tokens(events))


async def _read_some(
    call: grpc.aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateEvent]
    | grpc.aio.UnaryStreamCall[pb.StreamRequest, pb.GenerateEvent],
    plan: Plan,
    events: list[pb.GenerateEvent],
) -> bool:
    """Read until `plan.after_events` events (True) or the stream's end (False)."""
    if plan.after_events == 0:
        await asyncio.sleep(plan.pause)
        return True
    async for event in call:
        events.append(event)
        if len(events) >= plan.after_events:
            return True
    return False


async def _cancel(stub: pb_grpc.GeneratorAsyncStub, plan: Plan, timeout: float) -> Verdict:
    events: list[pb.GenerateEvent] = []
    call = stub.Generate(plan.request, timeout=timeout)
    try:
        more = await _read_some(call, plan, events)
    except grpc.aio.AioRpcError as exc:
        return _admission_or_unexpected(plan.kind, exc, len(events), _tokens(events))
    if not more:
        problem = check_stream(plan.request, events)
        verdict = Outcome.UNEXPECTED if problem else Outcome.FINISHED
        return Verdict(verdict, "OK", _tokens(events), f"{plan.kind}: {problem}" if problem else "")
    call.cancel()
    status = await _status(call)
    if status in ("CANCELLED", "OK"):
        return Verdict(Outcome.CANCELLED, status, _tokens(events))
    if status == "RESOURCE_EXHAUSTED" and not events:
        return Verdict(Outcome.QUEUE_FULL, status)
    if status == "UNAVAILABLE" and not events:  # refused at admission before the cancel took effect
        return Verdict(Outcome.RESTARTING, status, 0, "cancel: UNAVAILABLE at admission")
    return Verdict(Outcome.UNEXPECTED, status, _tokens(events), f"cancel: {status} after our cancel")


async def _disconnect(target: str, plan: Plan, timeout: float) -> Verdict:
    events: list[pb.GenerateEvent] = []
    channel = grpc.aio.insecure_channel(target)
    try:
        stub = pb_grpc.GeneratorStub(channel)
        call = stub.Generate(plan.request, timeout=timeout)
        try:
            more = await _read_some(call, plan, events)
        except grpc.aio.AioRpcError as exc:
            return _admission_or_unexpected(plan.kind, exc, len(events), _tokens(events))
        if not more:
            problem = check_stream(plan.request, events)
            verdict = Outcome.UNEXPECTED if problem else Outcome.FINISHED
            return Verdict(verdict, "OK", _tokens(events), f"{plan.kind}: {problem}" if problem else "")
    finally:
        await channel.close()  # with the call still open: the server sees the connection go
    return Verdict(Outcome.CANCELLED, "CANCELLED", _tokens(events))


async def _cancel_rpc(stub: pb_grpc.GeneratorAsyncStub, plan: Plan, timeout: float) -> Verdict:
    try:
        job_id = (await stub.Enqueue(plan.request, timeout=timeout)).job_id
    except grpc.aio.AioRpcError as exc:
        return _admission_or_unexpected(plan.kind, exc, 0, 0)
    events: list[pb.GenerateEvent] = []
    call = stub.Stream(pb.StreamRequest(job_id=job_id), timeout=timeout)
    cancel_status = ""
    try:
        more = await _read_some(call, plan, events)
        if more:
            try:
                await stub.Cancel(pb.CancelRequest(job_id=job_id), timeout=timeout)
                cancel_status = "OK"
            except grpc.aio.AioRpcError as exc:
                cancel_status = exc.code().name
            async for event in call:
                events.append(event)
    except grpc.aio.AioRpcError as exc:
        return _admission_or_unexpected(plan.kind, exc, len(events), _tokens(events))
    problem = check_stream(plan.request, events)
    if problem:
        return Verdict(Outcome.UNEXPECTED, "OK", _tokens(events), f"cancel_rpc: {problem}")
    reason = events[-1].finished.stop_reason
    if cancel_status not in ("", "OK", "NOT_FOUND") or (
        cancel_status == "NOT_FOUND" and reason == pb.STOP_REASON_CANCELLED
    ):
        return Verdict(
            Outcome.UNEXPECTED,
            cancel_status,
            _tokens(events),
            f"cancel_rpc: Cancel gave {cancel_status}, the job finished {pb.StopReason.Name(reason)}",
        )
    outcome = Outcome.CANCEL_RPC if reason == pb.STOP_REASON_CANCELLED else Outcome.FINISHED
    return Verdict(outcome, "OK", _tokens(events))


# -- the run --------------------------------------------------------------------------------------


def engine_process(front_end_pid: int) -> psutil.Process | None:
    """The spawned engine: the front end's multiprocessing child (not its resource tracker)."""
    try:
        children = psutil.Process(front_end_pid).children()
    except psutil.Error:
        return None
    for child in children:
        with contextlib.suppress(psutil.Error):
            cmdline = " ".join(child.cmdline())
            if "spawn_main" in cmdline:
                return child
    return None


def listening_pid(target: str) -> int | None:
    """The local process listening on `target`'s port (for --target on this machine)."""
    host, _, port = target.rpartition(":")
    if host not in ("127.0.0.1", "localhost", "[::1]", "0.0.0.0"):
        return None
    with contextlib.suppress(psutil.Error, OSError):
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == int(port):
                return int(conn.pid) if conn.pid is not None else None
    return None


async def wait_pool_idle(stub: pb_grpc.GeneratorAsyncStub, timeout: float) -> pb.ModelInfo | None:
    """GetModelInfo until no job runs or waits and no page is in use (or `timeout`); the last reply."""
    deadline = time.monotonic() + timeout
    info: pb.ModelInfo | None = None
    while True:
        with contextlib.suppress(grpc.aio.AioRpcError):
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
            if info.running_jobs == 0 and info.queued_jobs == 0 and info.pages_used == 0:
                return info
        if time.monotonic() > deadline:
            return info
        await asyncio.sleep(0.1)


async def soak_async(target: str, settings: SoakSettings, server_pid: int | None) -> SoakReport:
    report = SoakReport(settings)
    channels = [grpc.aio.insecure_channel(target) for _ in range(max(1, settings.streams // 16))]
    stubs = [pb_grpc.GeneratorStub(c) for c in channels]
    info = await stubs[0].GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    preamble_rng = random.Random(settings.seed)
    preamble = " ".join(preamble_rng.choice(WORDS) for _ in range(120))
    t0 = time.monotonic()
    end = t0 + settings.seconds

    def sample() -> None:
        if server_pid is None:
            return
        with contextlib.suppress(psutil.Error):
            front_end = psutil.Process(server_pid)
            if not front_end.is_running() or front_end.status() == psutil.STATUS_ZOMBIE:
                return
            front = int(front_end.memory_info().rss)
            engine = engine_process(server_pid)
            engine_rss = int(engine.memory_info().rss) if engine is not None else 0
            engine_pid = int(engine.pid) if engine is not None else 0
            if engine_pid:
                report.engine_pids.add(engine_pid)
            report.samples.append(RssSample(time.monotonic() - t0, front, engine_rss, engine_pid))

    finished = asyncio.Event()
    open_calls = 0
    ended: deque[float] = deque()  # when recent calls ended (their cancels may still be on the way)

    async def jobs_sample() -> None:
        before, asked = open_calls, time.monotonic()
        with contextlib.suppress(grpc.aio.AioRpcError):
            i = await stubs[0].GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
            while ended and ended[0] < asked - CANCEL_SETTLE_SECONDS:
                ended.popleft()
            ours = max(before, open_calls) + len(ended)
            report.excess_jobs.append(i.running_jobs + i.queued_jobs - ours)

    async def sampler() -> None:
        while not finished.is_set():
            sample()
            await jobs_sample()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(finished.wait(), settings.sample_interval)

    async def worker(n: int) -> None:
        nonlocal open_calls
        maker = RequestMaker(settings.seed * 1_000_003 + n, settings, info.vocab_size, preamble)
        stub = stubs[n % len(stubs)]
        while time.monotonic() < end:
            plan = maker.plan()
            open_calls += 1
            try:
                verdict = await run_plan(stub, target, plan, settings.call_timeout)
            except asyncio.CancelledError:
                report.requests[(plan.kind, Outcome.CUT.value)] += 1
                report.statuses["CANCELLED"] += 1
                if settings.cut_is_error:
                    report.unexpected_count += 1
                    report.unexpected.append(
                        f"{plan.kind}: still open {settings.end_grace:.0f} s after the end "
                        f"(request: {_short(plan.request)})"
                    )
                raise
            except Exception as exc:  # a client-side surprise is a finding too, not a crash of the run
                verdict = Verdict(
                    Outcome.UNEXPECTED, "CLIENT", 0, f"{plan.kind}: {type(exc).__name__}: {exc}"
                )
            finally:
                open_calls -= 1
                ended.append(time.monotonic())
            if verdict.outcome is Outcome.RESTARTING and not settings.kill_every:
                verdict = Verdict(
                    Outcome.UNEXPECTED, verdict.status, 0, verdict.detail + " (no engine was killed)"
                )
            report.requests[(plan.kind, verdict.outcome.value)] += 1
            report.statuses[verdict.status] += 1
            report.tokens += verdict.tokens
            if verdict.outcome is Outcome.UNEXPECTED:
                report.unexpected_count += 1
                if len(report.unexpected) < 20:
                    report.unexpected.append(f"{verdict.detail} (request: {_short(plan.request)})")
            if verdict.outcome in (Outcome.QUEUE_FULL, Outcome.RESTARTING, Outcome.UNEXPECTED):
                await asyncio.sleep(0.05 + 0.1 * maker.rng.random())  # no hot loop on a refusing server

    async def killer() -> None:
        """Fault mode: SIGKILL the engine every `kill_every` seconds; its open jobs must resume."""
        while time.monotonic() + settings.kill_every < end:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(finished.wait(), settings.kill_every)
            engine = engine_process(server_pid) if server_pid is not None else None
            if finished.is_set() or engine is None:
                return
            with contextlib.suppress(psutil.Error):
                engine.kill()
                report.kills += 1

    sampling = asyncio.create_task(sampler())
    killing = asyncio.create_task(killer()) if settings.kill_every > 0 else None
    try:
        workers = [asyncio.create_task(worker(n)) for n in range(settings.streams)]
        _, late = await asyncio.wait(workers, timeout=end + settings.end_grace - time.monotonic())
        for task in late:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        report.seconds = time.monotonic() - t0
        finished.set()
        await sampling
        sample()
        report.final_info = await wait_pool_idle(stubs[0], settings.idle_timeout)
    finally:
        sampling.cancel()
        if killing is not None:
            killing.cancel()
        for c in channels:
            await c.close()
    return report


def _short(req: pb.GenerateRequest) -> str:
    prompt = req.WhichOneof("prompt")
    size = (
        len(req.text)
        if prompt == "text"
        else sum(len(m.content) for m in req.chat.messages)
        if prompt == "chat"
        else len(req.token_ids.ids)
    )
    return f"{prompt}[{size}], max_new_tokens={req.max_new_tokens}, ignore_eos={req.ignore_eos}"


def soak(target: str, settings: SoakSettings, server_pid: int | None = None) -> SoakReport:
    """Run the soak against a SERVING server; `server_pid` (the front end) enables RSS sampling."""
    return asyncio.run(soak_async(target, settings, server_pid))


# -- report ---------------------------------------------------------------------------------------


def cpu_line() -> str:
    """The CPU line the other benchmarks print (kernels/cpu_features.py; imports torch)."""
    from kernels.cpu_features import cpu_features

    return f"CPU: {cpu_features().summary()}"


def _excess(values: Sequence[int]) -> str:
    if not values:
        return "n/a"
    return f"max {max(values)}, median {statistics.median(values):g}, last {values[-1]}"


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def _growth(g: float | None) -> str:
    return "n/a" if g is None else f"{g:+.2f} %"


def rss_curve(report: SoakReport, points: int = 10) -> list[str]:
    """RSS over the run: the median of each tenth (front end, engine), so growth shows its shape."""
    if not report.samples or report.seconds <= 0:
        return []
    width = report.seconds / points
    lines = ["| minutes | front end | engine |", "| ---: | ---: | ---: |"]
    for k in range(points):
        part = [x for x in report.samples if k * width <= x.t < (k + 1) * width]
        front = [x.front_end for x in part if x.front_end > 0]
        engine = [x.engine for x in part if x.engine > 0]
        lines.append(
            f"| {(k + 1) * width / 60:.1f} | {_mib(statistics.median(front)) if front else 'n/a'} "
            f"| {_mib(statistics.median(engine)) if engine else 'n/a'} |"
        )
    return lines


def render_report(report: SoakReport, title: str, log_path: Path | None = None) -> str:
    s = report.settings
    lines = [
        f"### {title}",
        "",
        cpu_line(),
        f"{s.streams} streams, {report.seconds:.0f} s, seed {s.seed}, max_new_tokens 1..{s.max_new_tokens}, "
        f"{report.total_requests} requests, {report.tokens} tokens streamed "
        f"({report.tokens / max(report.seconds, 1e-9):.1f} tok/s)",
        "",
        "| kind | outcome | requests |",
        "| --- | --- | ---: |",
    ]
    for (kind, outcome), n in sorted(report.requests.items()):
        lines.append(f"| {kind} | {outcome} | {n} |")
    lines += ["", "| gRPC status | calls |", "| --- | ---: |"]
    for status, n in sorted(report.statuses.items()):
        lines.append(f"| {status} | {n} |")
    lines += [
        "",
        "| process | RSS after warm-up | RSS at end | peak | growth |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for which, label in (("front_end", "front end"), ("engine", "engine")):
        present = report.present(which)
        values = [getattr(x, which) for x in present]
        warm = [getattr(x, which) for x in present if x.t >= s.warmup_fraction * report.seconds]
        if values and warm:
            lines.append(
                f"| {label} | {_mib(warm[0])} | {_mib(values[-1])} | {_mib(max(values))} "
                f"| {_growth(report.rss_growth(which))}"
                f"{' (engines killed: not gated)' if which == 'engine' and s.kill_every else ''} |"
            )
        else:
            lines.append(f"| {label} | n/a | n/a | n/a | n/a |")
    lines += ["", *rss_curve(report)]
    info = report.final_info
    pool = (
        "no GetModelInfo reply"
        if info is None
        else f"running {info.running_jobs}, queued {info.queued_jobs}, pages used {info.pages_used}, "
        f"cached {info.pages_cached}, free {info.pages_free}"
    )
    lines += [
        "",
        f"Engine processes seen: {len(report.engine_pids)} ({sorted(report.engine_pids)})"
        + (f"; {report.kills} killed by this run (every {s.kill_every:g} s)" if s.kill_every else ""),
        f"Engine jobs beyond open calls (sampled; a median > 0 means orphaned jobs): "
        f"{_excess(report.excess_jobs)} -> {'ORPHANS' if report.orphans else 'none'}",
        f"Pool at the end: {pool} -> {'idle' if report.pool_idle else 'NOT IDLE'}",
        f"Unexpected errors: {report.unexpected_count}",
        *(f"  - {u}" for u in report.unexpected),
        f"Result: {'PASS' if report.passed else 'FAIL'} "
        f"(passes with 0 unexpected errors, RSS growth < {MAX_RSS_GROWTH_PERCENT:.0f} % in both "
        "(the front end only with engine kills), no orphans, pool idle; an OK stream whose deltas do not "
        "hold exactly its JobFinished's new_tokens, a token lost or sent twice, is an unexpected error)",
        *([f"Server log: {log_path}"] if log_path else []),
    ]
    return "\n".join(lines)


# -- the server -----------------------------------------------------------------------------------


def run(
    minutes: float,
    streams: int = 64,
    model: Path | None = None,
    seed: int = 0,
    target: str | None = None,
    max_new_tokens: int = 256,
    extra_flags: Sequence[str] = (),
    kill_every: float = 0.0,
) -> tuple[str, int]:
    """The soak as `python -m benchmarks soak` runs it: (the report, the exit status)."""
    settings = SoakSettings(
        seconds=minutes * 60, streams=streams, seed=seed, max_new_tokens=max_new_tokens, kill_every=kill_every
    )
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    if target is None:
        port = free_port()
        target = f"127.0.0.1:{port}"
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        command = [sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
        command += [
            "--max-batch-size",
            str(streams),
            *(["--model", str(model)] if model else []),
            *extra_flags,
        ]
        log_path = Path(tempfile.gettempdir()) / f"dyngen-soak-{port}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log)
    try:
        wait_serving(target, process, START_TIMEOUT)
        pid = process.pid if process is not None else listening_pid(target)
        report = soak(target, settings, pid)
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
    name = model.name if model else "the shipped model"
    text = render_report(report, f"Soak: {target}, {name}", log_path)
    return text, 0 if report.passed else 1
