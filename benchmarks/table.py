"""Results as a markdown table, with each row's ratio to a baseline row."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    engine: str
    dtype: str
    value: float
    baseline: str  # the engine name this row is compared with ("" for none)
    note: str = ""


def render(title: str, unit: str, rows: Sequence[Row]) -> str:
    by_key = {(r.engine, r.dtype): r for r in rows}
    lines = [
        f"### {title}",
        "",
        f"| engine | dtype | {unit} | ratio | note |",
        "| --- | --- | ---: | ---: | --- |",
    ]
    for r in rows:
        base = by_key.get((r.baseline, r.dtype))
        ratio = (
            f"{r.value / base.value:.2f}x" if base is not None and base.value > 0 and base is not r else ""
        )
        lines.append(f"| {r.engine} | {r.dtype} | {r.value:.1f} | {ratio} | {r.note} |")
    return "\n".join(lines)
