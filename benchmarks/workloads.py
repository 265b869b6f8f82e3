"""The benchmark workloads, read from the shared workloads.json (never retyped here)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

DEFAULT_PATH = Path(__file__).resolve().parent.parent.parent / "shared" / "workloads.json"


def load_workloads(path: Path | None = None) -> dict[str, Any]:
    where = path or Path(os.environ.get("DYNGEN_WORKLOADS", str(DEFAULT_PATH)))
    if not where.is_file():
        raise SystemExit(f"workloads file not found: {where} (set DYNGEN_WORKLOADS or pass --workloads)")
    data: dict[str, Any] = json.loads(where.read_text())
    return data
