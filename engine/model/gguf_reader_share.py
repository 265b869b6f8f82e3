"""One parse of a GGUF file's header for the whole first load.

gguf.GGUFReader parses every metadata field, the tokenizer's ~100k strings included, in Python:
1.8 s for the shipped model here. A first start needs it twice, once for the weights' index
(gguf_source.py) and once inside transformers, whose GGUF tokenizer conversion builds its own
reader; on threads of one process the two parses also share the interpreter, and they were
the longest part of a cold `dyngen serve` start. Within `shared_readers()`, a reader built for
a file is handed to every later request for the same file (read-only, mode "r"), so
transformers converts the tokenizer from the parse already made. Readers are read-only; the
block's end drops them with their memory."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import gguf

_lock = threading.Lock()
_depth = [0]  # open blocks (a list: mutated in place, never rebound)
_readers: dict[tuple[str, int, int], gguf.GGUFReader] = {}
_original = gguf.GGUFReader


def _key(path: str) -> tuple[str, int, int]:
    st = os.stat(path)
    return os.path.realpath(path), st.st_size, st.st_mtime_ns


def _shared_reader(path: os.PathLike[str] | str, mode: str = "r") -> gguf.GGUFReader:
    if mode != "r":
        return _original(path, mode)  # type: ignore[arg-type]
    key = _key(os.fspath(path))
    with _lock:  # the first caller parses; a concurrent one waits for its reader
        reader = _readers.get(key)
        if reader is None:
            reader = _readers[key] = _original(os.fspath(path))
        return reader


@contextlib.contextmanager
def shared_readers() -> Iterator[None]:
    """Within the block (nestable), gguf.GGUFReader(path) parses each unchanged file once."""
    with _lock:
        _depth[0] += 1
        gguf.GGUFReader = _shared_reader  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        with _lock:
            _depth[0] -= 1
            if _depth[0] == 0:
                gguf.GGUFReader = _original  # type: ignore[misc]
                _readers.clear()
