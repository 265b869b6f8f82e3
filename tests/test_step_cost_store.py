"""The warm-up's step-cost table kept per machine: timed once, read back by later starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.generator import DynamicGenerator, GeneratorConfig
from engine.model.loader import LoadedModel
from engine.speculation.draft_policy import StepCost
from engine.speculation.speculation_config import DrafterKind, SpeculationConfig
from engine.speculation.step_cost_store import StepCostKey, read_step_cost, write_step_cost

CONFIG = GeneratorConfig(
    page_size=16, num_pages=256, speculation=SpeculationConfig(DrafterKind.NGRAM, num_draft_tokens=4)
)


def key(rows: tuple[int, ...] = (1, 2, 4), cache: str = "float16|torch.float32") -> StepCostKey:
    return StepCostKey.make("tiny|torch.float32|float32", "cpu", cache, rows)


def test_a_table_reads_back_for_its_key_only(tmp_path: Path) -> None:
    cost = StepCost((1, 2, 4), (0.004, 0.0045, 0.006), 2e-6)
    write_step_cost(key(), tmp_path, cost)
    assert read_step_cost(key(), tmp_path) == cost
    assert read_step_cost(key(cache="bfloat16|torch.float32"), tmp_path) is None
    assert read_step_cost(key(rows=(1, 2, 4, 8)), tmp_path) is None
    assert read_step_cost(key(), tmp_path / "elsewhere") is None


def test_a_damaged_table_is_timed_again(tmp_path: Path) -> None:
    path = key().path(tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for text in ("{", '{"key": 1}', "[]"):
        path.write_text(text)
        assert read_step_cost(key(), tmp_path) is None
    write_step_cost(key(), tmp_path, StepCost((1, 2, 4), (0.004, 0.0045, 0.006)))
    data = path.read_text().replace('"seconds": [', '"seconds": ["x", ')
    path.write_text(data)
    assert read_step_cost(key(), tmp_path) is None


def test_a_second_start_reads_the_first_starts_table(
    tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = DynamicGenerator(tiny.model, tiny.tokenizer, CONFIG)
    first.warmup(step_costs=tmp_path)
    assert first.speculation.policy is not None
    table = first.speculation.policy.cost
    assert len(list(tmp_path.glob("step-cost-*.json"))) == 1
    first.close()

    def untimed(self: DynamicGenerator, bos: int, n: int) -> float:
        raise AssertionError("a kept table is not timed again")

    monkeypatch.setattr(DynamicGenerator, "_time_step", untimed)
    second = DynamicGenerator(tiny.model, tiny.tokenizer, CONFIG)
    second.warmup(step_costs=tmp_path)
    assert second.speculation.policy is not None and second.speculation.policy.cost == table
    second.close()
    # Without a folder the table is timed at every start.
    third = DynamicGenerator(tiny.model, tiny.tokenizer, CONFIG)
    with pytest.raises(AssertionError, match="not timed again"):
        third.warmup()
    third.close()
