"""Entry point of the spawned engine process (kept free of heavy imports until it runs)."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from multiprocessing.connection import Connection

from engine.errors import DyngenError
from engine.onednn_caches import bound_onednn_caches
from service.config import ServiceConfig
from service.ipc import HEARTBEAT_INTERVAL, Heartbeat, Message, Tag
from service.prompts import preload_tokenizer_code


class PipeSender:
    """The engine's one way out: the loop and the heartbeat thread share the pipe under a lock."""

    def __init__(self, out: Connection) -> None:
        self._out = out
        self._lock = threading.Lock()
        self.loop_pass: float | None = None  # monotonic time the engine loop last went round

    def send(self, tag: Tag, request: int, payload: bytes) -> None:
        data = Message(tag, request, payload).encode()
        with self._lock:
            self._out.send_bytes(data)

    def heartbeats(self) -> None:
        """Runs on its own thread: proves the process is scheduled, and says how old the loop's pass is."""
        while True:
            last = self.loop_pass
            age = 0.0 if last is None else time.monotonic() - last
            try:
                self.send(Tag.HEARTBEAT, 0, Heartbeat(age).to_bytes())
            except (OSError, EOFError):
                return  # the front end is gone
            time.sleep(HEARTBEAT_INTERVAL)


def run(config_json: str, commands: Connection, events: Connection, runtime_dir: str) -> None:
    config = ServiceConfig.from_json(config_json)
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
    # The tokenizer's code imports beside torch's (each ~0.7 s; much of torch's is native loading).
    threading.Thread(target=preload_tokenizer_code, name="tokenizer-preload", daemon=True).start()
    import torch

    from service.engine_loop import EngineLoop

    if config.torch_threads > 0:
        torch.set_num_threads(config.torch_threads)
    try:
        loop = EngineLoop(config, sender, runtime_dir)
    except DyngenError as exc:  # missing model, bad config: one line, not a traceback
        print(f"dyngen: engine error: {exc}", file=sys.stderr)
        sys.exit(2)
    try:
        loop.serve(commands)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the front end went away: nothing left to serve
    finally:
        loop.close()
