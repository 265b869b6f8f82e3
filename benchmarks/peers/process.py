"""Processes of the peers benchmark: logged setup commands, and engine children driven part by part.

An engine child loads its engine, warms it up, then answers one line per timed part on its
stdin with one `@@peer {json}` line on its stdout. The parent decides when each part starts
(after waiting for an idle machine), so the child never times anything the parent has not
allowed. Every other line the child prints (vLLM logs to stdout) goes to a log file.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

MARK = "@@peer "
_T0 = time.monotonic()


def progress(message: str) -> None:
    """Progress to stderr: the table alone goes to stdout."""
    print(f"[peers {time.monotonic() - _T0:7.1f}s] {message}", file=sys.stderr, flush=True)


class PeerError(RuntimeError):
    pass


def stop(process: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """End a server process: SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_logged(
    cmd: Sequence[str | Path],
    log: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float | None = None,
) -> None:
    """Run a setup step with its output in `log`; on failure raise with the log's tail."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(map(str, cmd))}\n")
        out.flush()
        done = subprocess.run(
            [str(c) for c in cmd],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=None if env is None else dict(env),
            cwd=cwd,
            timeout=timeout,
            check=False,
        )
    if done.returncode != 0:
        raise PeerError(f"{cmd[0]} exited with {done.returncode}; log {log}:\n{tail(log)}")


@dataclass(frozen=True)
class Reply:
    """One `@@peer` line: the JSON object the child sent."""

    fields: Mapping[str, object]

    def number(self, key: str) -> float:
        value = self.fields.get(key)
        if not isinstance(value, int | float):
            raise PeerError(f"peer reply lacks a number {key!r}: {dict(self.fields)}")
        return float(value)

    def text(self, key: str) -> str:
        return str(self.fields.get(key, ""))


class EngineChild:
    """A child process speaking the `@@peer` protocol; use as a context manager."""

    def __init__(self, cmd: Sequence[str | Path], log: Path, env: Mapping[str, str] | None = None) -> None:
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        self._log_file = log.open("w")
        self._replies: queue.Queue[Reply | None] = queue.Queue()
        # A new session, so that closing it can end the child's own children (vLLM's engine core).
        self.process = subprocess.Popen(
            [str(c) for c in cmd],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=None if env is None else dict(env),
            text=True,
            bufsize=1,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith(MARK):
                self._replies.put(Reply(json.loads(line[len(MARK) :])))
            else:
                self._log_file.write(line)
                self._log_file.flush()
        self._replies.put(None)  # end of output: the child has exited

    def reply(self, timeout: float) -> Reply:
        try:
            got = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise PeerError(f"no reply from {self.log.stem} within {timeout:.0f} s; log {self.log}") from None
        if got is None:
            code = self.process.wait()
            raise PeerError(f"{self.log.stem} exited with {code}; log {self.log}:\n{tail(self.log)}")
        if "error" in got.fields:
            raise PeerError(f"{self.log.stem}: {got.text('error')}; log {self.log}")
        return got

    def ask(self, part: str, timeout: float) -> Reply:
        assert self.process.stdin is not None
        self.process.stdin.write(part + "\n")
        self.process.stdin.flush()
        return self.reply(timeout)

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.write("quit\n")
                self.process.stdin.flush()
                self.process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.process.pid, 9)
                self.process.wait()
        # Whatever the child left behind in its session (vLLM's engine core) ends with it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, 9)
        self._reader.join(timeout=10)
        self._log_file.close()

    def __enter__(self) -> EngineChild:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if error is not None and self.process.poll() is None:
            os.killpg(self.process.pid, 9)  # a failed or interrupted run: do not wait for it
            self.process.wait()
        self.close()


def send(fields: Mapping[str, object]) -> None:
    """The child's side: one protocol line on stdout."""
    print(MARK + json.dumps(dict(fields)), flush=True)


def answer_parts(
    ready: Mapping[str, object], parts: Mapping[str, Callable[[], Mapping[str, object]]]
) -> None:
    """The child's side: say ready, then run each part named on stdin until `quit` or end of input."""
    send({"ready": True, **ready})
    for line in sys.stdin:
        name = line.strip()
        if name == "quit":
            return
        try:
            send(parts[name]())
        except Exception as error:
            send({"error": f"{type(error).__name__}: {error}"})
            raise
