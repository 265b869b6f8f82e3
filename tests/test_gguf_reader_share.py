"""A first load parses a GGUF header once (engine/model/gguf_reader_share.py)."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from engine.model.gguf_reader_share import shared_readers
from engine.model.tokenizer import HFTokenizer
from tests.tiny_service_model import write_servable_tiny_gguf


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_servable_tiny_gguf(tmp_path_factory.mktemp("share") / "tiny.gguf")


def test_a_file_is_parsed_once_within_the_block(model_file: Path) -> None:
    original = gguf.GGUFReader
    with shared_readers():
        first = gguf.GGUFReader(str(model_file))
        assert gguf.GGUFReader(model_file) is first
        with shared_readers():  # nested blocks keep the share
            assert gguf.GGUFReader(str(model_file)) is first
        assert gguf.GGUFReader(str(model_file)) is first
    assert gguf.GGUFReader is original
    assert gguf.GGUFReader(str(model_file)) is not first


def test_the_tokenizer_converted_from_the_shared_parse_is_the_same(model_file: Path) -> None:
    pytest.importorskip("transformers")
    text = "Hello world, hello again: 123 + 456!"
    alone = HFTokenizer(model_file)
    with shared_readers():
        gguf.GGUFReader(str(model_file))  # the weights' parse comes first, as in load_model
        shared = HFTokenizer(model_file)
    assert shared.encode(text) == alone.encode(text)
    assert shared.decode(alone.encode(text)) == alone.decode(alone.encode(text))
    assert shared.eos_token_ids == alone.eos_token_ids
