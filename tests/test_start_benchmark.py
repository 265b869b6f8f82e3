"""The start benchmark's own logic (benchmarks/served/start_time.py): reading the engine's start
from a server's log and the table it makes. The servers it starts are exercised by running it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.served import start_time
from benchmarks.served.start_time import Restart, StartRun, engine_ready, isas_for, render, start_run
from kernels.isa import Isa

READY = {
    "model": "m.gguf",
    "start_seconds": 1.9,
    "start_parts": {"imports": 1.1, "model": 0.14, "warmup": 0.03, "tokenizer": 0.0},
    "kv_cache": "float16: 32768 tokens in 512 pages of 64, 23040 bytes/token, 720.0 MiB",
    "event": "engine_ready",
}


def test_the_last_engine_ready_line_counts(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    later = READY | {"start_seconds": 1.5}
    lines = [
        "not json at all",
        json.dumps({"event": "engine_starting", "pid": 1}),
        json.dumps(READY),
        '{"event": "engine_ready", broken',
        json.dumps(later),
        "/usr/lib/python3.11/multiprocessing/resource_tracker.py: UserWarning",
    ]
    log.write_text("\n".join(lines) + "\n")
    run = start_run(engine_ready(log), Isa.AVX2, False, 2.0)
    assert run == StartRun(Isa.AVX2, False, 2.0, 1.5, READY["start_parts"], "float16")  # type: ignore[arg-type]


def test_a_log_without_a_ready_engine_is_an_error(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text(json.dumps({"event": "engine_starting"}) + "\n")
    with pytest.raises(SystemExit, match="no engine_ready"):
        engine_ready(log)


def test_the_table_has_a_row_per_start_and_the_warm_medians() -> None:
    parts = READY["start_parts"]
    assert isinstance(parts, dict)
    runs = [
        StartRun(Isa.NATIVE, True, 9.5, 9.2, parts, "bfloat16"),
        StartRun(Isa.NATIVE, False, 2.1, 1.8, parts, "bfloat16"),
        StartRun(Isa.NATIVE, False, 1.9, 1.7, {}, "bfloat16"),
        StartRun(Isa.NATIVE, False, 2.5, 1.9, parts, "bfloat16"),
    ]
    text = render(runs, {Isa.NATIVE: [Restart(1.6, 1.5), Restart(1.4, 1.45)]})
    rows = [line for line in text.splitlines() if line.startswith("| native |")]
    assert len(rows) == 4 + 1
    assert rows[0].startswith("| native | first | 9.50 | 9.20 | 1.10 | 0.14 | 0.03 | 0.00 | bfloat16 |")
    assert "n/a" in rows[2]  # a start whose parts the log lacked
    assert "- native: 2.10 s (max 2.50, 3 starts)" in text
    assert rows[-1] == "| native | 1.60, 1.40 | 1.50, 1.45 |"


def test_both_means_the_avx2_paths_too_only_where_the_cpu_has_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    monkeypatch.setattr(start_time, "CPUINFO", cpuinfo)
    cpuinfo.write_text("processor : 0\nflags : fpu sse2 avx avx2 fma\n")
    assert isas_for("both") == [Isa.NATIVE]
    cpuinfo.write_text("processor : 0\nflags : fpu sse2 avx avx2 fma avx512f avx512_bf16\n")
    assert isas_for("both") == [Isa.NATIVE, Isa.AVX2]
    assert isas_for("avx2") == [Isa.AVX2]
