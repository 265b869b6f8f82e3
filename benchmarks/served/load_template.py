"""ghz's request templating and duration syntax, so its command lines work here unchanged.

ghz renders `-d` and `-m` as Go templates per request; the actions load tests use are the
call-data fields below (`{{.RequestNumber}}` most of all). Durations are Go's: "20s", "1m30s",
"500ms"; a bare number is seconds.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass

_ACTION = re.compile(r"\{\{\s*\.(\w+)\s*\}\}")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
FIELDS = ("RequestNumber", "WorkerID", "TimestampUnix", "TimestampUnixMilli", "TimestampUnixNano", "UUID")


class TemplateError(ValueError):
    """A template action this tool does not know, or a duration it cannot read."""


@dataclass(frozen=True)
class CallData:
    """What a request's template may refer to (ghz's call data)."""

    request_number: int  # 0-based, across all workers
    worker_id: str  # "g<n>c<m>": worker n on connection m, as ghz names them

    def value(self, name: str) -> str:
        match name:
            case "RequestNumber":
                return str(self.request_number)
            case "WorkerID":
                return self.worker_id
            case "TimestampUnix":
                return str(int(time.time()))
            case "TimestampUnixMilli":
                return str(time.time_ns() // 1_000_000)
            case "TimestampUnixNano":
                return str(time.time_ns())
            case "UUID":
                return str(uuid.uuid4())
            case _:
                raise TemplateError(f"unknown template field .{name} (known: {', '.join(FIELDS)})")


def check_template(template: str) -> None:
    """Fail before the first request on an action that could never render."""
    for name in _ACTION.findall(template):
        if name not in FIELDS:
            raise TemplateError(f"unknown template field .{name} (known: {', '.join(FIELDS)})")


def render_json(template: str, data: CallData) -> str:
    """The template with each action replaced by its value, escaped for a JSON string."""
    return _ACTION.sub(lambda m: json.dumps(data.value(m.group(1)))[1:-1], template)


def parse_duration(text: str) -> float:
    """Go duration ("20s", "1m30s", "250ms") or bare seconds -> seconds; 0 = none."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    pos, total = 0, 0.0
    for m in _DURATION_PART.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
        pos = m.end()
    if pos != len(text) or not text:
        raise TemplateError(f"not a duration: {text!r} (e.g. 20s, 1m30s, 500ms)")
    return total
