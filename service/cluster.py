"""`dyngen cluster`: N `dyngen serve` replicas and HAProxy (or the SMG gateway) in front, on one machine.

For a local try of the scale-out path (docs/SCALING.md) and for its tests; in production the
replicas are separate machines or pods and HAProxy (or Envoy) is the operator's (deploy/).
Each replica gets its own port, `--replica-id replica-<i>` and a drain delay as long as HAProxy
needs to see it leave, so SIGTERM takes it out of the ring before it refuses anything.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from service.config import PORT, whole
from service.haproxy_config import DEFAULT_BALANCE_FACTOR, Backend, BalancerConfig, render
from service.health_probe import NotServingError, wait_serving
from service.replica_restarts import ReplicaRestarts
from service.smg_gateway import POLICIES, GatewayError, SmgGateway

# How long a replica may take to reach SERVING before the gateway is started in front of it: a
# cold first start (native build, autotune) on a busy 2-core machine, with room.
REPLICA_START_SECONDS = 300.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ClusterError(Exception):
    """The cluster cannot start (no haproxy binary, a bad configuration)."""


class Cluster:
    """Replicas as child processes and HAProxy in front; start(), then stop() (or use `with`)."""

    def __init__(
        self,
        replicas: int,
        serve_flags: Sequence[str] = (),
        front_port: int = 0,
        affinity: bool = True,
        check_interval_ms: int = 1000,
        host: str = "127.0.0.1",
        workdir: Path | None = None,
        replica_stderr: int | None = None,
        balance_factor: int = DEFAULT_BALANCE_FACTOR,
        gateway: str | None = None,
    ) -> None:
        if replicas < 1:
            raise ClusterError(f"replicas must be >= 1, got {replicas}")
        # `gateway`: an SMG policy; the SMG gateway (OpenAI API over HTTP) replaces HAProxy.
        self.gateway_policy = gateway
        self.gateway: SmgGateway | None = None
        haproxy = shutil.which("haproxy")
        if haproxy is None and gateway is None:
            raise ClusterError("haproxy is not installed (Debian: apt-get install haproxy)")
        self.haproxy_bin = haproxy or "haproxy"
        self.host = host
        self.serve_flags = tuple(serve_flags)
        self.backends = tuple(Backend(f"replica-{i}", host, free_port(host)) for i in range(replicas))
        self.config = BalancerConfig(
            self.backends,
            front_host=host,
            front_port=front_port or free_port(host),
            affinity=affinity,
            check_interval_ms=check_interval_ms,
            balance_factor=balance_factor,
        )
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="dyngen-cluster-"))
        self.replica_stderr = replica_stderr
        self.processes: list[subprocess.Popen[bytes] | None] = [None] * replicas
        self.balancer: subprocess.Popen[bytes] | None = None

    @property
    def target(self) -> str:
        """HAProxy's gRPC address, or the gateway's OpenAI base URL."""
        if self.gateway_policy is not None:
            return f"http://{self.host}:{self.config.front_port}/v1"
        return f"{self.host}:{self.config.front_port}"

    def replica_target(self, i: int) -> str:
        return f"{self.host}:{self.backends[i].port}"

    def start_replica(self, i: int) -> None:
        b = self.backends[i]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        self.processes[i] = subprocess.Popen(
            [
                *(sys.executable, "-m", "service.cli", "serve", "--host", b.host, "--port", str(b.port)),
                *("--replica-id", b.name, "--drain-delay-seconds", str(self.config.leave_seconds)),
                *self.serve_flags,
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=self.replica_stderr,
            process_group=0,  # signals come from the cluster (stop), not from its terminal's Ctrl-C
        )

    def signal_replica(self, i: int, sig: signal.Signals) -> None:
        p = self.processes[i]
        if p is not None and p.poll() is None:
            p.send_signal(sig)

    def wait_replica(self, i: int, timeout: float) -> int:
        p = self.processes[i]
        return 0 if p is None else p.wait(timeout)

    def start_balancer(self) -> None:
        if self.gateway_policy is not None:
            workers = [self.replica_target(i) for i in range(len(self.backends))]
            self.gateway = SmgGateway(
                workers,
                self.config.front_port,
                free_port(self.host),
                self.gateway_policy,
                self.host,
                self.workdir / "smg.log",
            )
            self.gateway.start()
            return
        cfg = self.workdir / "haproxy.cfg"
        cfg.write_text(render(self.config))
        check = subprocess.run(
            [self.haproxy_bin, "-c", "-q", "-f", str(cfg)], check=False, capture_output=True, text=True
        )
        if check.returncode != 0:
            raise ClusterError(f"haproxy refused {cfg}: {check.stderr.strip()}")
        # Its own process group, as the replicas': a Ctrl-C in the cluster's terminal reaches the
        # cluster alone, and `stop` ends HAProxy after the replicas have drained their streams.
        self.balancer = subprocess.Popen(
            [self.haproxy_bin, "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL, process_group=0
        )

    def start(self) -> None:
        """Start the replicas and the balancer; whatever started is stopped again if any of it fails
        or is interrupted (in process groups of their own, nothing else would end them)."""
        try:
            for i in range(len(self.backends)):
                self.start_replica(i)
            if self.gateway_policy is not None:
                # The gateway reads each worker's model once, when it registers it: a worker still
                # loading registers as an unknown model that is never routed to (seen on a loaded
                # 2-core machine, where two replicas took 9 s to start).
                for i in range(len(self.backends)):
                    self.wait_replica_serving(i, REPLICA_START_SECONDS)
            self.start_balancer()
        except BaseException:
            self.stop()
            raise

    def wait_replica_serving(self, i: int, timeout: float) -> None:
        """Until replica i's gRPC health says SERVING; ClusterError at `timeout` or if it exits."""

        def exit_code() -> int | None:
            p = self.processes[i]
            return None if p is None else p.poll()

        try:
            wait_serving(self.replica_target(i), timeout, exit_code)
        except NotServingError as e:
            raise ClusterError(f"replica {i}: {e}") from None

    def stop(self, grace: float = 60.0) -> None:
        """SIGTERM every replica (each drains), then stop HAProxy."""
        for i in range(len(self.backends)):
            self.signal_replica(i, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.processes:
            if p is None:
                continue
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        if self.gateway is not None:
            self.gateway.stop()
        if self.balancer is not None and self.balancer.poll() is None:
            self.balancer.terminate()
            try:
                self.balancer.wait(10)
            except subprocess.TimeoutExpired:
                self.balancer.kill()

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=whole(1), default=2, help="dyngen serve processes")
    parser.add_argument("--host", default="127.0.0.1", help="address of HAProxy and the replicas")
    parser.add_argument("--port", type=PORT, default=50051, help="HAProxy's gRPC port")
    parser.add_argument(
        "--no-affinity", action="store_true", help="round robin instead of hashing on x-dyngen-affinity"
    )
    parser.add_argument("--check-interval-ms", type=int, default=1000, help="HAProxy's health check interval")
    parser.add_argument(
        "--balance-factor",
        type=int,
        default=DEFAULT_BALANCE_FACTOR,
        help="bounded-load hashing: a replica past this %% of the average streams spills to the next (0: off)",
    )
    parser.add_argument(
        "--gateway",
        choices=POLICIES,
        default=None,
        help="the SMG gateway with this routing policy in front (OpenAI API over HTTP on --port) "
        "instead of HAProxy; cache_aware follows the replicas' KV events",
    )
    parser.add_argument(
        "serve_flags", nargs=argparse.REMAINDER, help="after --: flags for every `dyngen serve` replica"
    )


def run_cluster(args: argparse.Namespace) -> int:
    """Start the cluster, restart replicas that die, stop everything on SIGINT/SIGTERM/SIGHUP."""
    flags = [f for f in args.serve_flags if f != "--"]

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # while starting: `start` stops what it started

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, interrupt)
    try:
        cluster = Cluster(
            args.replicas,
            flags,
            args.port,
            not args.no_affinity,
            args.check_interval_ms,
            args.host,
            balance_factor=args.balance_factor,
            gateway=args.gateway,
        )
        cluster.start()
    except (ClusterError, GatewayError) as exc:
        print(f"dyngen: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        if stopping:  # a second one (Ctrl-C again): each replica's second SIGTERM ends its drain
            for i in range(len(cluster.backends)):
                cluster.signal_replica(i, signal.SIGTERM)
        stopping = True

    # The replicas and the balancer run in process groups of their own, so these reach only this
    # process, which stops them in order (a closed terminal's SIGHUP included: else they outlive it).
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    replicas = ", ".join(f"{b.name} {b.host}:{b.port}" for b in cluster.backends)
    front = "HAProxy" if args.gateway is None else f"the SMG gateway ({args.gateway})"
    print(f"dyngen cluster: {front} on {cluster.target} -> {replicas}", file=sys.stderr, flush=True)
    watch = ReplicaRestarts(len(cluster.backends))
    code = 0
    try:
        while not stopping:
            for i, p in enumerate(cluster.processes):
                if p is not None and p.poll() is not None:
                    wait = watch.exited(i, p.returncode)
                    if wait is None:
                        code = 2 if p.returncode == 2 else 1
                        print(
                            f"dyngen cluster: replica-{i} {watch.why(i, p.returncode)}; stopping",
                            file=sys.stderr,
                        )
                        stopping = True
                        break
                    print(
                        f"dyngen cluster: replica-{i} exited ({p.returncode}); restarting in {wait:.1f} s",
                        file=sys.stderr,
                    )
                    cluster.processes[i] = None
                if cluster.processes[i] is None and watch.due(i):
                    cluster.start_replica(i)
                    watch.started(i)
            front_process = cluster.gateway.process if cluster.gateway is not None else cluster.balancer
            if front_process is not None and front_process.poll() is not None:
                print("dyngen cluster: the balancer exited; stopping", file=sys.stderr)
                code = 1
                break
            time.sleep(0.5)
    finally:
        cluster.stop()
    return code
