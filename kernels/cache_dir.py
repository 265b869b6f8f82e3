"""Where dyngen keeps what it derives on this machine (autotune choices, the KV cache's tune, the
warm-up's step costs, the native library, a model file's index and tokenizer): $DYNGEN_CACHE_DIR,
else $XDG_CACHE_HOME/dyngen, else ~/.cache/dyngen."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
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


def keyed_file(folder: Path | None, prefix: str, key: Mapping[str, object]) -> Path:
    """The JSON file of what was derived under `key` (what it depends on): `prefix` and a digest of
    the key, in `folder` (default_cache_dir() by default)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return (folder if folder is not None else default_cache_dir()) / f"{prefix}-{digest}.json"


def read_keyed(path: Path, key: Mapping[str, object]) -> dict[str, object] | None:
    """`path`'s JSON object if it was written for `key` (under "key"); None if it is absent,
    unreadable or another key's (a digest's collision), so the caller derives it again."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("key") == json.loads(json.dumps(key)) else None
