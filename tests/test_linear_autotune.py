"""The load-time linear autotune: bucket dispatch, and its JSON cache's hits and misses."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

import kernels.linear.linear_autotune as autotune
from engine.model.gguf_source import GGUFSource
from engine.model.llama import LlamaModel
from engine.model.quantization import LinearPlan
from kernels.cpu_features import CpuFeatures, cpu_features
from kernels.linear.linear_autotune import BUCKETS, LinearTuner, TuneCache, TunedLinear, TuneKey, bucket
from kernels.linear.make_linear import Linear, LinearKind, make_linear
from tests.reference_generate import GenerationSettings, generate_batch
from tests.tiny_gguf import QType, TinyLlamaSpec, random_llama_weights, write_tiny_gguf

KINDS = (LinearKind.FLOAT, LinearKind.INT8_DYNAMIC)


@pytest.fixture
def quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever else runs on the test machine, treat the measurements as quiet (kept)."""
    monkeypatch.setattr(autotune, "BUSY_SHARE", 1.0)


def test_buckets() -> None:
    assert [bucket(r) for r in (1, 2, 8, 9, 64, 65, 4096)] == [1, 8, 8, 64, 64, 64, 64]


def test_tuned_linear_calls_its_buckets_winner() -> None:
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    f, q = make_linear(LinearKind.FLOAT, weight), make_linear(LinearKind.INT8_DYNAMIC, weight)
    tuned = TunedLinear({1: q, 8: q, 64: f})
    assert tuned.kind is LinearKind.INT8_DYNAMIC
    assert tuned.describe() == "tuned(1:int8_dynamic 8:int8_dynamic 64:float32)"
    for rows, lin in ((1, q), (5, q), (9, f), (100, f)):
        x = torch.randn(rows, 64)
        assert torch.equal(tuned(x), lin(x))


def test_near_ties_go_to_the_kind_with_fewer_weight_bytes() -> None:
    seconds = {LinearKind.FLOAT: 0.0020, LinearKind.INT4_Q8: 0.0026}  # 30% slower alone...
    nbytes = {LinearKind.FLOAT: 4000, LinearKind.INT4_Q8: 1000}  # ...with a quarter of the bytes
    # One row: within the wide one-row margin, bytes win; more rows: 30% is no tie.
    assert autotune.choose(seconds, nbytes, 1) is LinearKind.INT4_Q8
    assert autotune.choose(seconds, nbytes, 8) is LinearKind.FLOAT
    assert autotune.choose(seconds, nbytes, 64) is LinearKind.FLOAT
    # Within the narrow margin at any row count.
    close = {LinearKind.FLOAT: 0.0020, LinearKind.INT4_Q8: 0.0022}
    assert autotune.choose(close, nbytes, 64) is LinearKind.INT4_Q8
    assert autotune.choose({**close, LinearKind.INT4_Q8: 0.0031}, nbytes, 1) is LinearKind.FLOAT
    # Near-equal bytes are no reason to run the slower kind: the timing decides.
    similar = {LinearKind.INT8_WEIGHT: 1000, LinearKind.INT8_Q8: 1062}
    slower = {LinearKind.INT8_WEIGHT: 0.0030, LinearKind.INT8_Q8: 0.0024}
    assert autotune.choose(slower, similar, 1) is LinearKind.INT8_Q8


def test_one_kind_runs_every_bucket() -> None:
    """Kinds round apart, so a weight runs one kind at every step size: where the buckets' winners
    differ, the one that loses least over all buckets relative to each bucket's fastest."""
    f, q = LinearKind.FLOAT, LinearKind.INT4_Q8
    times = {1: {f: 4.0, q: 1.0}, 8: {f: 2.0, q: 1.9}, 64: {f: 10.0, q: 11.0}}
    assert autotune.one_kind(times, {1: q, 8: q, 64: f}) is q  # 1 + 1 + 1.1 against 4 + 1.05 + 1
    times[1], times[64] = {f: 1.05, q: 1.0}, {f: 10.0, q: 12.0}
    assert autotune.one_kind(times, {1: q, 8: q, 64: f}) is f  # 1.05 + 1.05 + 1 against 1 + 1 + 1.2
    assert autotune.one_kind(times, {1: f, 8: f, 64: f}) is f  # agreement: no arithmetic


@pytest.mark.usefixtures("quiet")
def test_tuning_picks_one_kind_for_every_bucket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Buckets that disagree, whatever the timings say: the tuned linear still runs one kind.
    monkeypatch.setattr(
        autotune, "choose", lambda _s, _b, rows: LinearKind.FLOAT if rows == 64 else LinearKind.INT8_DYNAMIC
    )
    weight = torch.randn(48, 64)
    tuner = LinearTuner(TuneCache(_key(), tmp_path))
    lin = tuner.build(KINDS, lambda kind: make_linear(kind, weight), (48, 64))
    assert isinstance(lin, TunedLinear)
    assert len({id(lin.for_rows(b)) for b in BUCKETS}) == 1


def _key(cpu: CpuFeatures | None = None) -> TuneKey:
    return TuneKey.make(cpu or cpu_features(), "tiny", KINDS)


@pytest.mark.usefixtures("quiet")
def test_cache_miss_measures_then_hit_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.randn(48, 64)

    def make(kind: LinearKind) -> Linear:
        return make_linear(kind, weight)

    first = LinearTuner(TuneCache(_key(), tmp_path))
    assert not first.cache.hit
    lin = first.build(KINDS, make, (48, 64))
    first.build(KINDS, make, (48, 64))  # the same shape again: no second measurement
    assert first.measured == 1
    first.finish()
    saved = json.loads(first.cache.path.read_text())
    assert set(saved["choices"]["48x64 float,int8_dynamic"]) == {str(b) for b in BUCKETS}

    def no_timing(*_: object) -> None:
        raise AssertionError("a cache hit must not measure")

    monkeypatch.setattr(autotune, "measure", no_timing)
    second = LinearTuner(TuneCache(_key(), tmp_path))
    assert second.cache.hit
    built: list[LinearKind] = []

    def make_counted(kind: LinearKind) -> Linear:
        built.append(kind)
        return make(kind)

    again = second.build(KINDS, make_counted, (48, 64))
    assert second.measured == 0 and again.describe() == lin.describe()
    # A hit builds only the kinds it chose (each build quantizes or copies the weight).
    chosen = set(json.loads(first.cache.path.read_text())["choices"]["48x64 float,int8_dynamic"].values())
    assert sorted(k.value for k in built) == sorted(chosen)
    # One kind alone is built plainly, without tuning.
    assert second.build((LinearKind.FLOAT,), make, (48, 64)).kind is LinearKind.FLOAT


def test_key_covers_cpu_torch_and_model(tmp_path: Path) -> None:
    here = cpu_features()
    other_cpu = CpuFeatures(
        here.model_name, here.flags ^ {"avx512_bf16"}, here.torch_capability, here.threads
    )
    names = {
        _key().file_name(),
        _key(other_cpu).file_name(),
        TuneKey.make(here, "another model", KINDS).file_name(),
        TuneKey.make(here, "tiny", KINDS[:1]).file_name(),
    }
    assert len(names) == 4
    (tmp_path / _key().file_name()).write_text("not json")
    assert not TuneCache(_key(), tmp_path).hit  # unreadable: measured again


def test_measurements_on_a_busy_machine_are_not_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Busy:
        def share(self) -> float:
            return autotune.BUSY_SHARE + 0.5  # others kept the CPUs busy while we timed

    monkeypatch.setattr(autotune, "BusyMeter", Busy)
    weight = torch.randn(48, 64)
    tuner = LinearTuner(TuneCache(_key(), tmp_path))
    tuner.build(KINDS, lambda kind: make_linear(kind, weight), (48, 64))
    tuner.finish()
    assert tuner.measured == 1 and not tuner.kept
    assert not tuner.cache.path.exists()
    assert not TuneCache(_key(), tmp_path).hit  # the next start measures again


def test_busy_meter_counts_other_processes_only() -> None:
    # Our own work on every core for 0.4 s: counted as "others" it would read about 1.0. The
    # window is long against the 10 ms clock tick, whose rounding over a few milliseconds
    # alone once read 1.38.
    meter = autotune.BusyMeter()
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    end = time.monotonic() + 0.4
    while time.monotonic() < end:
        a @ b
    assert 0.0 <= meter.share() < 0.5


@pytest.mark.usefixtures("quiet")
def test_tiny_model_autotunes_once(tmp_path: Path) -> None:
    spec = TinyLlamaSpec()
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, random_llama_weights(spec, seed=0, tied=True), spec, QType.Q4_1)
    source = GGUFSource(path)
    plan = LinearPlan.tuned(
        (LinearKind.INT8_DYNAMIC, LinearKind.INT4), (LinearKind.INT8_DYNAMIC, LinearKind.FLOAT)
    )
    model = LlamaModel.from_source(source, progress=False, plan=plan, tune_dir=tmp_path)
    assert model.tuner is not None and model.tuner.measured >= 1
    assert "autotuned" in model.describe() and "measured" in model.describe()
    cache = model.new_cache(num_pages=4, page_size=16)
    (result,) = generate_batch(
        model, cache, [[5, 77, 300, 12]], GenerationSettings(max_new_tokens=4, ignore_eos=True)
    )
    assert len(result.token_ids) == 4
    second = LlamaModel.from_source(source, progress=False, plan=plan, tune_dir=tmp_path)
    assert second.tuner is not None and second.tuner.measured == 0 and "cached" in second.describe()


def test_the_eviction_covers_the_caches_the_os_reports(tmp_path: Path) -> None:
    from kernels.linear.linear_autotune import evict_bytes

    for i, size in enumerate(("48K", "32K", "1024K", "32768K")):
        (tmp_path / f"index{i}").mkdir()
        (tmp_path / f"index{i}" / "size").write_text(size + "\n")
    total = (48 + 32 + 1024 + 32768) << 10
    assert evict_bytes(tmp_path) == total + total // 4
    assert evict_bytes(tmp_path / "missing") == 64 << 20  # no sysfs: the fallback


def test_the_cache_key_follows_the_native_kernels_source() -> None:
    """Choices timed against one kernel source are not reused for another: the key digests the
    file the native library is built from (a moved file once left the digest empty)."""
    import hashlib

    from kernels.native.native_library import SOURCE

    assert SOURCE.is_file()
    digest = autotune._native_source_digest()
    assert digest == hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    key = TuneKey.make(cpu_features(), "m.gguf", (LinearKind.INT4_Q8, LinearKind.INT8_Q8))
    assert key.native_source == digest
    assert TuneKey.make(cpu_features(), "m.gguf", KINDS).native_source == ""
