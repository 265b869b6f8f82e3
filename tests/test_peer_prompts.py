"""The peers benchmark's shared prompts file: W1 sampled is W1's token ids with one sampling
setting for every engine, it survives the file, and dyngen's column samples it reproducibly."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.inprocess.throughput import run_dyngen
from benchmarks.peers.prompts import SAMPLED_TEMPERATURE, SAMPLED_TOP_P, PeerPrompts, Workload
from engine.jobs import SamplingSettings
from engine.model.loader import LoadedModel, WeightDtype, load_model
from engine.model.quantization import QuantMode
from engine.model.shipped_model import default_model_path


@pytest.fixture(scope="module")
def prompts() -> PeerPrompts:
    return PeerPrompts.build(default_model_path(), None)


def test_w1_sampled_is_w1_with_the_sampling_setting(prompts: PeerPrompts, tmp_path: Path) -> None:
    w1, w1s = prompts.w1, prompts.w1s
    assert w1s.prompts == w1.prompts and w1s.max_new_tokens == w1.max_new_tokens
    assert not w1.sampled and w1s.sampled
    assert (w1s.temperature, w1s.top_p) == (SAMPLED_TEMPERATURE, SAMPLED_TOP_P)
    assert "temperature 0.8, top_p 0.95" in w1s.describe() and "temperature" not in w1.describe()
    assert list(prompts.parts()) == ["w1", "w1s", "single", "w2"]
    path = tmp_path / "prompts.json"
    prompts.write(path)
    assert PeerPrompts.read(path) == prompts
    # A file written before the sampled part: its workloads read as greedy.
    old = w1.to_json()
    del old["temperature"], old["top_p"]
    assert Workload.from_json(old) == w1


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(default_model_path(), WeightDtype.FLOAT32, progress=False, quant=QuantMode.AUTO)


def test_dyngen_column_samples_each_request_with_its_own_seed(
    prompts: PeerPrompts, loaded: LoadedModel
) -> None:
    few = prompts.w1.prompts[:3]
    sampling = SamplingSettings(temperature=SAMPLED_TEMPERATURE, top_p=SAMPLED_TOP_P)
    first = run_dyngen(loaded, few, 24, True, sampling=sampling)
    again = run_dyngen(loaded, few, 24, True, sampling=sampling)
    greedy = run_dyngen(loaded, few, 24, True)
    assert first.texts == again.texts  # seeded: the same text each run
    assert first.texts != greedy.texts
    assert first.new_tokens == greedy.new_tokens == 3 * 24
