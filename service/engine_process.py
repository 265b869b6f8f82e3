"""Entry point of the spawned engine process (kept free of heavy imports until it runs)."""

from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection

from engine.errors import DyngenError
from service.config import ServiceConfig


def run(config_json: str, commands: Connection, events: Connection) -> None:
    config = ServiceConfig.from_json(config_json)
    # Spinning OpenMP workers are fastest on a machine the server has to itself (W4: 1.01x of
    # in-process W1 with ACTIVE vs 0.83x with PASSIVE); under outside CPU load they stall every
    # parallel region and PASSIVE measured 3.7x faster. The environment's OMP_WAIT_POLICY wins.
    os.environ.setdefault("OMP_WAIT_POLICY", config.omp_wait_policy.upper())
    if config.torch_threads > 0:
        os.environ["OMP_NUM_THREADS"] = str(config.torch_threads)
    import torch

    from service.engine_loop import EngineLoop

    if config.torch_threads > 0:
        torch.set_num_threads(config.torch_threads)
    try:
        loop = EngineLoop(config, events)
    except DyngenError as exc:  # missing model, bad config: one line, not a traceback
        print(f"dyngen: engine error: {exc}", file=sys.stderr)
        sys.exit(2)
    try:
        loop.serve(commands)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the front end went away: nothing left to serve
    finally:
        loop.close()
