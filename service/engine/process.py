"""Entry point of the spawned engine process (kept free of heavy imports until it runs)."""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

from engine.errors import DyngenError
from engine.onednn_caches import bound_onednn_caches
from service.engine_config import EngineConfig
from service.ipc import Message, Tag
from service.pipe_sender import PipeSender


def run(
    config_json: str, commands: Connection, events: Connection, runtime_dir: str, spare: bool = False
) -> None:
    """The engine process. `spare`: do the imports (most of a start), then wait for START before
    loading the model: the front end keeps one such process to replace a dead engine in about the
    model's load time (--spare-engine)."""
    started = time.monotonic()
    # No cyclic collection until the start is done (freeze_startup_objects turns it back on): the
    # imports alone ran three full ones over torch's growing heap, ~0.2 s of a 1.3 s import.
    gc.disable()
    # The front end alone ends this process (QUIT, or its pipe closing; SIGKILL for a hang). A
    # terminal's Ctrl-C or hangup or a service manager's SIGTERM reaches the whole process group:
    # ignored here, the engine goes on running the front end's drain instead of dying under it.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    config = EngineConfig.from_json(config_json)
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="engine %(levelname)s %(message)s")
    sender = PipeSender(events)
    # Heartbeats start before the model loads, so a load that hangs is seen too.
    threading.Thread(target=sender.heartbeats, name="engine-heartbeat", daemon=True).start()
    # Spinning OpenMP workers are fastest on a machine the server has to itself (W4: 1.01x of
    # in-process W1 with ACTIVE vs 0.83x with PASSIVE); under outside CPU load they stall every
    # parallel region and PASSIVE measured 3.7x faster. The environment's OMP_WAIT_POLICY wins.
    os.environ.setdefault("OMP_WAIT_POLICY", config.omp_wait_policy.upper())
    # Active waiting is bounded, so an idle engine's workers go to sleep: unbounded (libgomp's
    # default under ACTIVE, ~30e9 spins), an idle server held a core at 100%.
    if config.omp_spin_count > 0:
        os.environ.setdefault("GOMP_SPINCOUNT", str(config.omp_spin_count))
    if config.torch_threads > 0:
        os.environ["OMP_NUM_THREADS"] = str(config.torch_threads)
    bound_onednn_caches()  # else the engine grows with every new matmul shape
    import torch

    from service.engine.loop import EngineLoop

    if config.torch_threads > 0:
        torch.set_num_threads(config.torch_threads)
    imports = time.monotonic() - started
    if spare:
        try:
            if Message.decode(commands.recv_bytes()).tag is not Tag.START:
                return  # QUIT: never needed
        except (EOFError, OSError):
            return  # the front end went away
        imports = 0.0  # done before it was needed
    try:
        loop = EngineLoop(config, sender, runtime_dir, imports_seconds=imports)
    except DyngenError as exc:  # missing model, bad config: one line, not a traceback
        print(f"dyngen: engine error: {exc}", file=sys.stderr)
        sys.exit(2)
    try:
        loop.serve(commands)
    except (EOFError, BrokenPipeError):
        pass  # the front end went away: nothing left to serve
    finally:
        loop.close()
