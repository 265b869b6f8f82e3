"""Where dyngen keeps what it derives on this machine (autotune choices, the native library,
a model file's index and tokenizer): $DYNGEN_CACHE_DIR, else $XDG_CACHE_HOME/dyngen, else
~/.cache/dyngen."""

from __future__ import annotations

import json
import os
from pathlib import Path


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("DYNGEN_CACHE_DIR", str(Path(base) / "dyngen")))


def write_json(path: Path, data: object) -> None:
    """`data` as `path`'s JSON, whole or not at all: written beside it under this process's name and
    renamed over it, so a concurrent start reads the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)
