"""`--kv-cache auto` between float16 and bfloat16: timed once per machine on the model, then read back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.cache.kv_cache import KVCacheKind
from engine.model import kv_cache_tune
from engine.model.kv_cache_tune import MARGIN, STEPS, pick, resolve_kv_cache, time_steps
from engine.model.loader import LoadedModel
from kernels.attention.native_attention import NativePagedAttention

H, B = KVCacheKind.FLOAT16, KVCacheKind.BFLOAT16


def test_bfloat16_only_where_it_saves_the_margin() -> None:
    assert pick({H: [1.0, 1.0, 1.0], B: [0.9, 0.9, 0.9]}) is B
    assert pick({H: [1.0, 1.0, 1.0], B: [0.97, 0.97, 0.97]}) is H  # a tie keeps float16's precision
    assert pick({H: [1.0, 1.0], B: [0.99 - MARGIN, 0.99 - MARGIN]}) is B
    # Each step counts alike: a long prefill chunk's saving does not outweigh slower decode rows.
    assert pick({H: [0.004, 0.1], B: [0.0046, 0.08]}) is H
    assert pick({H: [0.004, 0.1], B: [0.0038, 0.08]}) is B


def _cpu_model(tiny: LoadedModel) -> None:
    if not isinstance(tiny.model.attention, NativePagedAttention):
        pytest.skip("the native attention is not built here")


def test_time_steps_times_every_step_under_both_caches(tiny: LoadedModel) -> None:
    _cpu_model(tiny)
    times = time_steps(tiny.model, 16)
    assert set(times) == {H, B}
    for seconds in times.values():
        assert len(seconds) == len(STEPS)
        assert all(0 < s < 10 for s in seconds)


def _fake_times(calls: list[int], kind: KVCacheKind) -> object:
    def timed(model: object, page_size: int) -> dict[KVCacheKind, list[float]]:
        calls.append(page_size)
        fast, slow = [0.5] * len(STEPS), [1.0] * len(STEPS)
        return {H: slow, B: fast} if kind is B else {H: fast, B: slow}

    return timed


def test_auto_times_once_then_reads_the_choice_back(
    tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _cpu_model(tiny)
    monkeypatch.setattr(kv_cache_tune, "eligible", lambda model, cpu: True)
    monkeypatch.setattr(kv_cache_tune, "choose_kv_cache", lambda *a, **k: KVCacheKind.FLOAT16)
    calls: list[int] = []
    monkeypatch.setattr(kv_cache_tune, "time_steps", _fake_times(calls, B))
    assert resolve_kv_cache(tiny.model, "auto", 16, tmp_path) is B
    # A later start describes its autotune as cached where the first measured it: the same key.
    monkeypatch.setattr(tiny.model, "_linears_description", "the autotune's state, another start")
    assert resolve_kv_cache(tiny.model, "auto", 16, tmp_path) is B
    assert calls == [16]  # the second start read the file
    (record,) = tmp_path.iterdir()
    data = json.loads(record.read_text())
    assert data["kind"] == "bfloat16" and data["key"]["page_size"] == 16
    # Another page size is another key: timed again, and here float16 wins.
    monkeypatch.setattr(kv_cache_tune, "time_steps", _fake_times(calls, H))
    assert resolve_kv_cache(tiny.model, "auto", 32, tmp_path) is H
    assert calls == [16, 32]
    # A damaged file is timed again, not trusted.
    record.write_text("{")
    assert resolve_kv_cache(tiny.model, "auto", 16, tmp_path) is H
    assert calls == [16, 32, 16]


def test_no_timing_unless_auto_would_pick_float16_on_an_eligible_cpu(
    tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(model: object, page_size: int) -> dict[KVCacheKind, list[float]]:
        raise AssertionError("timed")

    monkeypatch.setattr(kv_cache_tune, "time_steps", never)
    for kind in KVCacheKind:  # an explicit kind is taken as given
        assert resolve_kv_cache(tiny.model, kind.value, 16, tmp_path) is kind
    monkeypatch.setattr(kv_cache_tune, "choose_kv_cache", lambda *a, **k: KVCacheKind.FLOAT16)
    monkeypatch.setattr(kv_cache_tune, "eligible", lambda model, cpu: False)
    assert resolve_kv_cache(tiny.model, "auto", 16, tmp_path) is H
    monkeypatch.setattr(kv_cache_tune, "eligible", lambda model, cpu: True)
    monkeypatch.setattr(kv_cache_tune, "choose_kv_cache", lambda *a, **k: KVCacheKind.INT8)
    assert resolve_kv_cache(tiny.model, "auto", 16, tmp_path) is KVCacheKind.INT8
    assert list(tmp_path.iterdir()) == []
