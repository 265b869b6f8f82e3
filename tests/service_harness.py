"""A real `dyngen serve` in a subprocess on 127.0.0.1 and a free port, for end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from dyngen_client import Client
from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from service.cluster import free_port
from service.health_probe import NotServingError, health_status, wait_serving


@dataclass
class ServerProcess:
    process: subprocess.Popen[str]
    port: int
    metrics_port: int
    logs: list[dict[str, object]] = field(default_factory=list)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            try:
                self.logs.append(json.loads(line))
            except json.JSONDecodeError:
                self.logs.append({"event": "raw", "line": line.rstrip()})

    def wait_log(self, event: str, after: int = 0, timeout: float = 120.0) -> dict[str, object]:
        """The first log record named `event` at index >= after."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for record in self.logs[after:]:
                if record.get("event") == event:
                    return record
            if self.process.poll() is not None:
                raise AssertionError(f"server exited ({self.process.returncode}): {self.logs[-5:]}")
            time.sleep(0.05)
        raise AssertionError(f"no {event!r} log within {timeout} s: {self.logs[-5:]}")

    def health(self) -> int:
        return health_status(self.target, timeout=5)

    def wait_serving(self, timeout: float = 120.0) -> None:
        try:
            wait_serving(self.target, timeout, self.process.poll)
        except NotServingError as e:
            raise AssertionError(f"{e}: {self.logs[-5:]}") from None

    def client(self) -> Client:
        return Client(self.target)

    def engine_pid(self, nth: int = -1) -> int:
        """The pid of the nth engine process started (the latest by default), from the logs."""
        starts = [r for r in list(self.logs) if r.get("event") == "engine_starting"]
        pid = starts[nth]["pid"]
        assert isinstance(pid, int)
        return pid

    def kill_engine(self) -> None:
        """SIGKILL the running engine process (the server restarts it)."""
        os.kill(self.engine_pid(), signal.SIGKILL)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return int(self.process.returncode)


def launch_server(*flags: str) -> ServerProcess:
    """`dyngen serve` on 127.0.0.1 and a free port, not waited for (TLS servers: wait on logs)."""
    port, metrics_port = free_port(), free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(port)),
            *("--metrics-port", str(metrics_port), *flags),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    server = ServerProcess(process, port, metrics_port)
    threading.Thread(target=server._read, daemon=True).start()
    return server


def start_server(*flags: str) -> ServerProcess:
    server = launch_server(*flags)
    try:
        server.wait_serving()
    except BaseException:
        server.stop()
        raise
    return server


# -- helpers for the fuzz, soak and memory tests (tests/test_service_fuzz.py and friends) ----------

# A small cache and passive OpenMP waiting: these servers share two cores with the test process.
TINY_SERVER_FLAGS = ("--cache-tokens", "16384", "--omp-wait-policy", "passive", "--quant", "none")


def start_tiny_server(model: Path, *flags: str) -> ServerProcess:
    """`dyngen serve` with a tiny random-weight model (tests/tiny_service_model.py) and `flags`."""
    return start_server("--model", str(model), *TINY_SERVER_FLAGS, *flags)


def log_count(server: ServerProcess, event: str) -> int:
    """How many of the server's log records are named `event` (engine_starting, engine_down...)."""
    return sum(1 for record in list(server.logs) if record.get("event") == event)


def wait_pool_idle(client: Client, timeout: float = 10.0) -> pb.ModelInfo:
    """GetModelInfo until no job runs or waits and no page is in use, or `timeout`: the last reply."""
    deadline = time.monotonic() + timeout
    while True:
        info = client.model_info(timeout=5)
        if (info.pages_used == 0 and info.running_jobs == 0 and info.queued_jobs == 0) or (
            time.monotonic() > deadline
        ):
            return info
        time.sleep(0.05)


def is_idle(info: pb.ModelInfo) -> bool:
    return info.pages_used == 0 and info.running_jobs == 0 and info.queued_jobs == 0
