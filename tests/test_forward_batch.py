"""ForwardBatch.build against a per-token reference, the runner's logits rows, and the house rule
that kernels/ never imports the engine."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.forward_batch import ForwardBatch, SequenceInput, one_copy
from engine.ids import PageId
from engine.model.loader import load_model
from engine.runner import ModelRunner
from kernels.attention.batch import AttentionBatch
from tests.tiny_llama import save_tiny_llama

KERNELS = Path(__file__).resolve().parent.parent / "kernels"


def reference_build(seqs: list[SequenceInput], page_size: int) -> dict[str, list[int] | list[list[int]]]:
    """The batch the plain way: one Python step per token."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_rows: list[int] = []
    max_pages = max(len(s.page_table) for s in seqs)
    for s in seqs:
        for i, token in enumerate(s.token_ids):
            pos = s.start_pos + i
            ids.append(token)
            positions.append(pos)
            slots.append(s.page_table[pos // page_size] * page_size + pos % page_size)
        if s.want_logits:
            logits_rows.extend(range(len(ids) - s.logit_positions, len(ids)))
    return {
        "input_ids": ids,
        "positions": positions,
        "slot_mapping": slots,
        "logits_indices": logits_rows,
        "page_tables": [list(s.page_table) + [0] * (max_pages - len(s.page_table)) for s in seqs],
    }


@st.composite
def batches(draw: st.DrawFn) -> tuple[list[SequenceInput], int]:
    page_size = draw(st.sampled_from([1, 4, 16, 64]))
    seqs = []
    for _ in range(draw(st.integers(1, 12))):
        start = draw(st.integers(0, 3 * page_size))
        n = draw(st.integers(1, 2 * page_size + 3))
        spare = draw(st.integers(0, 2))
        pages = -(-(start + n) // page_size) + spare
        table = [PageId(p) for p in draw(st.lists(st.integers(0, 500), min_size=pages, max_size=pages))]
        tokens = draw(st.lists(st.integers(0, 50_000), min_size=n, max_size=n))
        want = draw(st.booleans())
        positions = draw(st.integers(1, n)) if want else 1
        seqs.append(SequenceInput(tokens, start, table, want, positions))
    return seqs, page_size


@settings(max_examples=200, deadline=None)
@given(batches())
def test_build_matches_the_per_token_reference(case: tuple[list[SequenceInput], int]) -> None:
    seqs, page_size = case
    batch = ForwardBatch.build(seqs, page_size, torch.device("cpu"))
    for name, want in reference_build(seqs, page_size).items():
        got = getattr(batch, name)
        assert got.dtype == torch.int64, name
        assert got.tolist() == want, name
    assert batch.query_lens == tuple(len(s.token_ids) for s in seqs)
    assert batch.seq_lens == tuple(s.end_pos for s in seqs)
    assert batch.num_tokens == sum(batch.query_lens) and batch.num_seqs == len(seqs)
    assert isinstance(batch, AttentionBatch) and batch.device == torch.device("cpu")


def test_build_refuses_bad_sequences() -> None:
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="at least one sequence"):
        ForwardBatch.build([], 4, cpu)
    with pytest.raises(ValueError, match="at least one new token"):
        ForwardBatch.build([SequenceInput([], 0, [PageId(0)])], 4, cpu)
    with pytest.raises(ValueError, match="cannot hold"):
        ForwardBatch.build([SequenceInput([1, 2], 3, [PageId(0)])], 4, cpu)
    with pytest.raises(ValueError, match="logit_positions"):
        ForwardBatch.build([SequenceInput([1], 0, [PageId(0)], True, 2)], 4, cpu)


def test_runner_rows_and_token_count(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path, with_tokenizer=True)
    model = load_model(tmp_path, progress=False).model
    cache = model.new_cache(num_pages=8, page_size=4)
    runner = ModelRunner(model, cache)
    seqs = [
        SequenceInput([1, 2, 3], 0, [PageId(0)], want_logits=False),
        SequenceInput([4, 5, 6], 0, [PageId(1)], logit_positions=2),
        SequenceInput([7], 0, [PageId(2)]),
    ]
    result = runner.run(seqs)
    assert result.first_rows == (-1, 0, 2)
    assert result.logits.shape == (3, model.config.vocab_size)
    assert result.num_tokens == 7 and runner.forwarded_tokens == 7
    # The same rows as the model's own forward over the same batch.
    again = model.forward(ForwardBatch.build(seqs, 4, model.device), model.new_cache(8, 4))
    assert torch.equal(result.logits, again)


def test_kernels_never_import_the_engine() -> None:
    for path in sorted(KERNELS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module is not None:
                names = [node.module]
            assert not any(n == "engine" or n.startswith("engine.") for n in names), path.name


def test_one_copy_packs_and_splits_the_index_tensors() -> None:
    """The device path's single host-to-device copy gives back each tensor as it was (on the CPU here)."""
    parts = [torch.arange(5), torch.tensor([7, 8]), torch.empty(0, dtype=torch.int64), torch.arange(3) * -1]
    moved = one_copy(parts, torch.device("cpu"))
    assert [m.tolist() for m in moved] == [p.tolist() for p in parts]
