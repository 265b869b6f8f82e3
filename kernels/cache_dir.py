"""Where dyngen keeps what it derives on this machine (autotune choices, the native library,
a model file's index and tokenizer): $DYNGEN_CACHE_DIR, else $XDG_CACHE_HOME/dyngen, else
~/.cache/dyngen."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("DYNGEN_CACHE_DIR", str(Path(base) / "dyngen")))
