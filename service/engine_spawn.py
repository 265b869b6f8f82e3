"""Starting an engine process: a spawned interpreter running service.engine.process.run, with a
pipe for commands to it and one for events from it.

`dyngen serve` starts its first engine before it imports the front end (grpc, the servicers,
the metrics: about 0.25 s on 2 cores here, more on slower parts), so the engine's own imports,
most of a warm start, begin at once and go on beside the front end's (EarlyEngine).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import multiprocessing.util  # its exit hook first, so that ours (below) runs before it
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path


def engine_main(
    config_json: str, commands: Connection, events: Connection, runtime_dir: str, spare: bool
) -> None:
    """The spawn target. The engine's entry module is imported here, in the child alone: the parent
    starts the child before importing that module's chain (~50 ms of a warm start's path)."""
    from service.engine.process import run

    run(config_json, commands, events, runtime_dir, spare)


@dataclass(frozen=True)
class SpawnedEngine:
    process: BaseProcess
    commands: Connection  # the front end's end: commands go in
    events: Connection  # the front end's end: events come out
    started_at: float  # monotonic, at spawn


# Engines this process started. An engine ignores SIGTERM (service/engine/process.py), and at exit
# multiprocessing ends its daemon children with SIGTERM and then waits for them: one still running
# when the front end exits without stopping it (an error on the way out) is killed first instead.
_SPAWNED: weakref.WeakSet[BaseProcess] = weakref.WeakSet()


@atexit.register
def _kill_left_over() -> None:
    for process in list(_SPAWNED):
        if process.is_alive():
            process.kill()
            process.join(5)


def spawn_engine(config_json: str, runtime_dir: Path, spare: bool) -> SpawnedEngine:
    """A new engine process (a spare: imports done, then waiting for START)."""
    ctx = mp.get_context("spawn")
    cmd_recv, cmd_send = ctx.Pipe(duplex=False)
    evt_recv, evt_send = ctx.Pipe(duplex=False)
    process = ctx.Process(
        target=engine_main,
        args=(config_json, cmd_recv, evt_send, str(runtime_dir), spare),
        name="dyngen-engine",
        daemon=True,
    )
    process.start()
    _SPAWNED.add(process)
    cmd_recv.close()
    evt_send.close()
    return SpawnedEngine(process, cmd_send, evt_recv, time.monotonic())


def new_runtime_dir() -> Path:
    """The folder a server's engines write to (the saved tokenizer), removed when it stops."""
    return Path(tempfile.mkdtemp(prefix="dyngen-"))


@dataclass(frozen=True)
class EarlyEngine:
    """A server's first engine, started before the front end exists, with the folder it writes to.
    The front end takes both over (EngineClient), or discards them if it never starts."""

    engine: SpawnedEngine
    runtime_dir: Path
    config_json: str  # what it was started with

    @staticmethod
    def start(config_json: str) -> EarlyEngine:
        runtime_dir = new_runtime_dir()
        return EarlyEngine(spawn_engine(config_json, runtime_dir, spare=False), runtime_dir, config_json)

    def discard(self) -> None:
        """End it unused (the server did not start): it holds nothing yet, so it is killed."""
        self.engine.process.kill()
        self.engine.process.join(5)
        self.engine.commands.close()
        self.engine.events.close()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
