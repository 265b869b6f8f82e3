"""A loopback HTTP/2 server that cuts every gRPC call the way a balancer does when the replica
behind it dies mid-stream: response headers, one GenerateEvent, then END_STREAM without any
gRPC trailers (HAProxy 2.6's clean close of a stream whose server went away).

The HTTP/2 side is the `h2` library's (server-side connection, settings, pings, flow control);
this module only decides what each request gets.
"""

from __future__ import annotations

import socketserver
import threading
import time
from types import TracebackType

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import ConnectionTerminated, RequestReceived

from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb

RESPONSE_HEADERS = ((":status", "200"), ("content-type", "application/grpc"))


def _message() -> bytes:
    """One gRPC length-prefixed message: GenerateEvent(job_id="cut")."""
    event = pb.GenerateEvent(job_id="cut").SerializeToString()
    return b"\x00" + len(event).to_bytes(4, "big") + event


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        h2 = H2Connection(H2Configuration(client_side=False))
        h2.initiate_connection()
        try:
            self.request.sendall(h2.data_to_send())
            while data := self.request.recv(65536):
                for event in h2.receive_data(data):
                    if isinstance(event, ConnectionTerminated):
                        return
                    if isinstance(event, RequestReceived):
                        h2.send_headers(event.stream_id, RESPONSE_HEADERS)
                        h2.send_data(event.stream_id, _message())
                        self.request.sendall(h2.data_to_send())
                        time.sleep(0.2)  # the event is read before the cut, as when a replica dies mid-job
                        h2.end_stream(event.stream_id)
                self.request.sendall(h2.data_to_send())
        except OSError:
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
