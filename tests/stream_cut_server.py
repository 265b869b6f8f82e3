"""A loopback HTTP/2 server that cuts every gRPC call the way a balancer does when the replica
behind it dies mid-stream: response headers, one GenerateEvent, then END_STREAM without any
gRPC trailers (HAProxy 2.6's clean close of a stream whose server went away).

It speaks just enough HTTP/2 for gRPC clients: its SETTINGS, SETTINGS and PING acks, and the
answer above to each request's HEADERS. Frames are written out with service.haproxy_config's
h2_frame; the header block is HPACK ":status 200" (static entry 8) and content-type.
"""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from types import TracebackType

from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from service.haproxy_config import h2_frame

DATA, HEADERS, SETTINGS, PING, GOAWAY = 0x0, 0x1, 0x4, 0x6, 0x7
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
RESPONSE_HEADERS = b"\x88" + b"\x0f\x10" + bytes((16,)) + b"application/grpc"


def _read(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("peer closed")
        data += chunk
    return data


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        conn: socket.socket = self.request
        event = pb.GenerateEvent(job_id="cut").SerializeToString()
        message = b"\x00" + len(event).to_bytes(4, "big") + event
        try:
            conn.sendall(h2_frame(SETTINGS, 0, 0, b""))
            if _read(conn, len(PREFACE)) != PREFACE:
                return
            while True:
                head = _read(conn, 9)
                length, kind, flags = int.from_bytes(head[:3], "big"), head[3], head[4]
                stream = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
                payload = _read(conn, length)
                if kind == SETTINGS and not flags & ACK:
                    conn.sendall(h2_frame(SETTINGS, ACK, 0, b""))
                elif kind == PING and not flags & ACK:
                    conn.sendall(h2_frame(PING, ACK, 0, payload))
                elif kind == HEADERS:
                    conn.sendall(
                        h2_frame(HEADERS, END_HEADERS, stream, RESPONSE_HEADERS)
                        + h2_frame(DATA, 0, stream, message)
                    )
                    time.sleep(0.2)  # the event is read before the cut, as when a replica dies mid-job
                    conn.sendall(h2_frame(DATA, END_STREAM, stream, b""))
                elif kind == GOAWAY:
                    return
        except (ConnectionError, OSError):
            return


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class StreamCutServer:
    """Serves on 127.0.0.1 (a free port) while in its `with` block."""

    def __init__(self) -> None:
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self.target = f"127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> StreamCutServer:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
