"""The HAProxy configuration that puts dyngen replicas behind one gRPC address.

HTTP/2 in front (h2c, or TLS if the operator adds it) and to each replica. Requests that carry
the prefix-affinity header (`x-dyngen-affinity`, dyngen_client.affinity) are hashed on it over
a consistent-hash ring, so one prompt prefix keeps going to one replica and hits its page cache;
requests without it are balanced round robin (HAProxy's fallback for an absent header). The
hashing is bounded-load (`balance_factor`, 0: off): a replica already running `balance_factor`%
of the average number of streams passes new ones to the next replica on the ring, so a hot
prefix cannot pile onto one replica while the others idle. On the W2-shaped benchmark (4
prompts, 8 streams, 2 replicas) 150 gave 1.54-1.62x one replica's throughput where unbounded
affinity gave 1.18-1.38x, for a hit rate of 87.8% instead of 92.5% (docs/SCALING.md).

A request whose replica refuses the connection (dead, not yet seen by the checks) is sent to
another one (`retries`, `option redispatch`): nothing had reached the dead replica, so the
retry is safe.

Health: every `check_interval_ms` HAProxy calls grpc.health.v1.Health/Check on each replica
over HTTP/2 (health_check_bytes) and wants the SERVING answer in the reply. A replica that is NOT_SERVING (starting, its engine down, or
draining after SIGTERM) or gone leaves the ring after `fall` failed checks and rejoins after
`rise` good ones; streams already running on it are left to finish.

`deploy/haproxy/haproxy.cfg` is this module's output for two replicas (a test keeps it so).
"""

from __future__ import annotations

from dataclasses import dataclass

from dyngen_client.affinity import AFFINITY_HEADER


@dataclass(frozen=True)
class Backend:
    name: str
    host: str
    port: int


DEFAULT_BALANCE_FACTOR = 150  # bounded load: at most 1.5x the average streams per replica


@dataclass(frozen=True)
class BalancerConfig:
    backends: tuple[Backend, ...]
    front_host: str = "127.0.0.1"
    front_port: int = 50051
    affinity: bool = True  # hash on the affinity header; False: round robin for everyone
    balance_factor: int = DEFAULT_BALANCE_FACTOR  # 0: unbounded
    check_interval_ms: int = 1000
    fall: int = 2
    rise: int = 2
    timeout_seconds: int = 3600  # longest silence on a stream (a long generation)

    @property
    def leave_seconds(self) -> float:
        """How long after a replica turns NOT_SERVING HAProxy may still send it requests: `fall`
        failed checks, the one in flight, and a second to spare (the replicas' drain delay)."""
        return (self.fall + 1) * self.check_interval_ms / 1000 + 1.0


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload


def _literal(name_index: int, value: bytes, name: bytes = b"") -> bytes:
    """An HPACK header field "literal without indexing" (plain, not Huffman-coded)."""
    if name_index == 0:
        head = b"\x00" + bytes((len(name),)) + name
    elif name_index < 15:
        head = bytes((name_index,))
    else:
        head = b"\x0f" + bytes((name_index - 15,))
    return head + bytes((len(value),)) + value


def health_check_bytes() -> bytes:
    """A whole gRPC Health/Check call over cleartext HTTP/2, as HAProxy's tcp-check sends it.

    HAProxy's own HTTP checks cannot carry a gRPC request: its body is a text string, and every
    gRPC message starts with a zero byte. So the call is written out here: the connection
    preface, an empty SETTINGS frame, a HEADERS frame (HPACK: POST, http, the method's path,
    :authority, content-type application/grpc, te trailers) and a DATA frame with an empty
    HealthCheckRequest (flag 0, length 0), ending the stream.
    """
    headers = b"".join(
        (
            b"\x83",  # :method POST (static table 3)
            b"\x86",  # :scheme http (static table 6)
            _literal(4, b"/grpc.health.v1.Health/Check"),  # :path
            _literal(1, b"dyngen"),  # :authority (gRPC servers require one)
            _literal(31, b"application/grpc"),  # content-type
            _literal(0, b"trailers", b"te"),
        )
    )
    return b"".join(
        (
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
            _frame(0x4, 0, 0, b""),  # SETTINGS
            _frame(0x1, 0x4, 1, headers),  # HEADERS, END_HEADERS
            _frame(0x0, 0x1, 1, b"\x00\x00\x00\x00\x00"),  # DATA, END_STREAM
        )
    )


# The answer's message, HealthCheckResponse{status: SERVING}: flag 0, length 2, field 1 = 1.
SERVING_MESSAGE = b"\x00\x00\x00\x00\x02\x08\x01"


def render(config: BalancerConfig) -> str:
    if config.balance_factor and config.balance_factor <= 100:
        raise ValueError(f"balance_factor is a percentage above 100 (or 0: off), got {config.balance_factor}")
    balance = f"hdr({AFFINITY_HEADER})" if config.affinity else "roundrobin"
    bounded = f"\n    hash-balance-factor {config.balance_factor}" if config.balance_factor else ""
    servers = "\n".join(f"    server {b.name} {b.host}:{b.port}" for b in config.backends)
    t = config.timeout_seconds
    return f"""\
# dyngen replicas behind one gRPC address (generated by service/haproxy_config.py).
global
    log stderr format raw local0 warning
    maxconn 8192
    hard-stop-after {t}s

defaults
    mode http
    log global
    timeout connect 2s
    timeout client {t}s
    timeout server {t}s
    timeout client-fin 5s
    timeout server-fin 5s

frontend grpc_in
    bind {config.front_host}:{config.front_port} proto h2
    default_backend dyngen

backend dyngen
    # Consistent hashing on the prefix-affinity header; round robin for requests without it.
    balance {balance}
    hash-type consistent{bounded}
    # A refused connection (a dead replica the checks have not caught yet): try another.
    retries 2
    option redispatch 1
    # grpc.health.v1.Health/Check over HTTP/2, written out (health_check_bytes); up = SERVING.
    option tcp-check
    tcp-check connect
    tcp-check send-binary {health_check_bytes().hex()}
    tcp-check expect binary {SERVING_MESSAGE.hex()}
    default-server proto h2 check inter {config.check_interval_ms} fall {config.fall} rise {config.rise}
{servers}
"""


def example_config() -> BalancerConfig:
    """deploy/haproxy/haproxy.cfg: two replicas on this machine, HAProxy on the default port."""
    return BalancerConfig(
        (Backend("replica-0", "127.0.0.1", 50061), Backend("replica-1", "127.0.0.1", 50062)),
        front_port=50051,
    )
