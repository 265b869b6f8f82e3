"""SmgGateway: the SMG gateway (`smg launch`, a dev and deploy dependency) in front of replicas.

The gateway speaks the OpenAI API over HTTP and reaches each `dyngen serve` replica through the
worker contract (service/frontend/worker_servicer.py): it tokenizes with the tokenizer it fetches
from a replica, picks a replica by its policy (cache_aware follows the replicas' KV events) and
streams the tokens back as text. This class starts one on loopback for `dyngen cluster --gateway`,
the tests and the scale-out benchmark; in production the operator runs it (deploy/k8s).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import IO

POLICIES = ("cache_aware", "round_robin", "prefix_hash", "least_load", "power_of_two", "random")


class GatewayError(Exception):
    """The gateway cannot start (no `smg` command) or did not become ready."""


def smg_command(workers: Sequence[str], host: str, port: int, metrics_port: int, policy: str) -> list[str]:
    """`smg launch` for gRPC `workers` ("host:port" each) under `policy`, its metrics on `host` too."""
    smg = shutil.which("smg")
    if smg is None:
        raise GatewayError("the smg gateway is not installed (pip install smg; the dev extras pin it)")
    if policy not in POLICIES:
        raise GatewayError(f"unknown gateway policy {policy!r}; one of {', '.join(POLICIES)}")
    return [
        smg,
        "launch",
        *("--backend", "vllm", "--policy", policy),
        *("--host", host, "--port", str(port)),
        *("--prometheus-host", host, "--prometheus-port", str(metrics_port)),
        "--worker-urls",
        *(f"grpc://{w}" for w in workers),
    ]


class SmgGateway:
    def __init__(
        self,
        workers: Sequence[str],
        port: int,
        metrics_port: int,
        policy: str = "cache_aware",
        host: str = "127.0.0.1",
        log: Path | None = None,
    ) -> None:
        self.workers = tuple(workers)
        self.host = host
        self.port = port
        self.command = smg_command(self.workers, host, port, metrics_port, policy)
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None

    @property
    def url(self) -> str:
        """The OpenAI API's base URL (`.../v1`)."""
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> None:
        self._log_file = open(self.log, "ab") if self.log is not None else None  # noqa: SIM115 (closed in stop)
        out = self._log_file if self._log_file is not None else subprocess.DEVNULL
        # A process group of its own: a Ctrl-C in the terminal of whoever started it (`dyngen
        # cluster`) reaches the starter alone, which stops the gateway after the replicas drained.
        self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, process_group=0)

    def _get(self, path: str) -> object:
        with urllib.request.urlopen(f"http://{self.host}:{self.port}{path}", timeout=5) as reply:
            return json.loads(reply.read())

    def healthy_workers(self) -> int:
        """Workers the gateway routes to now (0 while it starts)."""
        try:
            ready = self._get("/readiness")
        except (OSError, ValueError, urllib.error.URLError):
            return 0
        count = ready.get("healthy_workers", 0) if isinstance(ready, dict) else 0
        return count if isinstance(count, int) else 0

    def wait_ready(self, workers: int | None = None, timeout: float = 60.0) -> None:
        """Until `workers` (default: all) are healthy and a model is listed; GatewayError at `timeout`."""
        want = len(self.workers) if workers is None else workers
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise GatewayError(f"smg exited with status {self.process.returncode}")
            if self.healthy_workers() >= want:
                try:
                    models = self._get("/v1/models")
                except (OSError, ValueError, urllib.error.URLError):
                    models = None
                if isinstance(models, dict) and models.get("data"):
                    return
            time.sleep(0.2)
        raise GatewayError(f"smg did not route to {want} workers within {timeout:.0f} s")

    def stop(self) -> None:
        """Kill the gateway (it holds no state worth draining: the replicas drain themselves)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
