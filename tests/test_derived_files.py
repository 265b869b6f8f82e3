"""What is kept from a model file between starts (engine/model/derived_files.py): the GGUF
header's index and the converted tokenizer give exactly what parsing the file gives."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engine.model.derived_files import DerivedFiles
from engine.model.gguf_source import GGUFSource
from engine.model.loader import WeightDtype, load_model, load_tokenizer
from engine.model.quantization import QuantMode
from tests.tiny_service_model import write_servable_tiny_gguf


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_servable_tiny_gguf(tmp_path / "tiny.gguf")


def test_index_gives_the_parsed_config_and_tensors(model: Path, tmp_path: Path) -> None:
    derived = DerivedFiles.of(model, tmp_path / "cache")
    parsed = GGUFSource(model)
    first = GGUFSource(model, derived)  # parses, then keeps the index
    assert derived.gguf_index.is_file()
    cached = GGUFSource(model, derived)  # reads the index: no parse
    for source in (first, cached):
        assert source.config == parsed.config
        assert list(source.tensor_map()) == list(parsed.tensor_map())
        for name, tensor in parsed.tensors():
            assert torch.equal(source.tensor_map()[name], tensor), name
            assert (source.stored_int4(name) is None) == (parsed.stored_int4(name) is None)


def test_a_damaged_index_is_parsed_again(model: Path, tmp_path: Path) -> None:
    derived = DerivedFiles.of(model, tmp_path / "cache")
    derived.gguf_index.parent.mkdir(parents=True)
    derived.gguf_index.write_text('{"metadata": {}, "tensors": [["x"')
    assert GGUFSource(model, derived).config == GGUFSource(model).config


def test_a_changed_file_gets_a_new_folder(model: Path, tmp_path: Path) -> None:
    before = DerivedFiles.of(model, tmp_path)
    stat = model.stat()
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert DerivedFiles.of(model, tmp_path) != before


def test_kept_tokenizer_encodes_and_renders_as_the_file_does(model: Path, tmp_path: Path) -> None:
    derived = DerivedFiles.of(model, tmp_path / "cache")
    from_file = load_tokenizer(model, (), None)
    load_tokenizer(model, (), derived)  # converts, then keeps the folder
    assert derived.tokenizer.is_dir()
    kept = load_tokenizer(model, (), derived)
    text = "Hello, world! Ünïcode and  spaces\n"
    assert kept.encode(text) == from_file.encode(text)
    assert kept.eos_token_ids == from_file.eos_token_ids and kept.vocab_size == from_file.vocab_size
    ids = from_file.encode(text)
    assert kept.decode(ids) == from_file.decode(ids)


def test_load_model_twice_gives_the_same_logits(
    model: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("DYNGEN_CACHE_DIR", str(tmp_path / "cache"))
    a = load_model(model, WeightDtype.FLOAT32, progress=False, quant=QuantMode.NONE)
    b = load_model(model, WeightDtype.FLOAT32, progress=False, quant=QuantMode.NONE)
    assert any((tmp_path / "cache" / "models").iterdir())
    assert torch.equal(a.model.embed, b.model.embed)
    assert a.tokenizer.encode("abc def") == b.tokenizer.encode("abc def")
