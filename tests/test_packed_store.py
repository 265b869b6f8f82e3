"""Packed linear bytes and the embedding table kept between starts (engine/model/packed_store.py):
a second load runs the kept bytes without packing anything, and computes what the first did; a
damaged file or bytes of the wrong shape are rebuilt, never run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.model.derived_files import DerivedFiles
from engine.model.loader import WeightDtype, load_model
from engine.model.packed_store import PackedStore, packed_linear
from engine.model.quantization import QuantMode
from kernels.linear import block_linear
from kernels.linear.linear_kind import LinearKind
from kernels.native.native_library import BlockLayout, native_library, source_digest
from tests.tiny_service_model import write_servable_tiny_gguf

pytestmark = pytest.mark.skipif(native_library() is None, reason="no native kernels to pack for")


@pytest.fixture
def model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DYNGEN_CACHE_DIR", str(tmp_path / "cache"))
    return write_servable_tiny_gguf(tmp_path / "tiny.gguf")


def _store_path(model: Path) -> Path:
    return DerivedFiles.of(model).packed(source_digest())


def _outputs(path: Path) -> list[torch.Tensor]:
    m = load_model(path, WeightDtype.FLOAT32, progress=False, quant=QuantMode.INT4).model
    x = torch.randn(5, m.config.hidden_size, generator=torch.Generator().manual_seed(0))
    ids = torch.arange(7)
    outs = [m.embed[ids].clone(), m.lm_head(x)]
    for layer in m.layers:
        outs += [layer.qkv(x), layer.gate_up(x)]
    return outs


def test_a_second_load_runs_the_kept_bytes(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = _outputs(model)
    store = torch.load(_store_path(model), mmap=True, weights_only=True)["tensors"]
    kinds = {key.split("|")[1] for key in store}
    assert kinds == {"int4_q8", "int8_q8", "float32"}, kinds  # the body, the head, the embedding table

    def no_packing(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("a kept linear was packed again")

    monkeypatch.setattr(block_linear, "pack_q4x8", no_packing)
    monkeypatch.setattr(block_linear, "pack_q8x8", no_packing)
    second = _outputs(model)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_a_damaged_store_is_rebuilt(model: Path) -> None:
    first = _outputs(model)
    path = _store_path(model)
    path.write_bytes(b"not a torch file")
    again = _outputs(model)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    store = PackedStore.open(DerivedFiles.of(model), source_digest())
    assert (
        store is not None and store.get("model.embed_tokens.weight|float32") is not None
    )  # written again, whole


def test_a_draft_of_the_first_layers_leaves_the_store_whole(model: Path) -> None:
    """A draft model (the first layers of the same file) runs kept bytes and drops none of the rest."""
    _outputs(model)
    path = _store_path(model)
    before = (path.stat().st_mtime_ns, len(torch.load(path, mmap=True, weights_only=True)["tensors"]))
    load_model(model, WeightDtype.FLOAT32, progress=False, quant=QuantMode.INT4, num_layers=1)
    after = (path.stat().st_mtime_ns, len(torch.load(path, mmap=True, weights_only=True)["tensors"]))
    assert after == before


def test_bytes_of_the_wrong_shape_are_not_run() -> None:
    n, k = 16, 64
    blocks = torch.zeros(n // 8, k // 32 + 1, 160, dtype=torch.uint8)  # one block too many
    assert packed_linear((BlockLayout.Q4X8.value, blocks), LinearKind.INT4_Q8, (n, k), None) is None
    blocks = torch.zeros(n // 8, k // 32, 272, dtype=torch.uint8)
    assert packed_linear((BlockLayout.Q8X8.value, blocks), LinearKind.INT8_Q8, (n, k), None) is not None
    assert packed_linear((BlockLayout.Q8X8.value, blocks), LinearKind.INT8_Q8, (n + 8, k), None) is None
