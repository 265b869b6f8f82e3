"""The engine process's one way out to the front end (the engine loop and the heartbeat thread)."""

from __future__ import annotations

import threading
import time
from multiprocessing.connection import Connection

from service.ipc import HEARTBEAT_INTERVAL, Heartbeat, Message, Tag


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
