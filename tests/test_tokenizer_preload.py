"""The front end's tokenizer preload (service/frontend/tokenizer_preload.py): the kept converted
tokenizer is taken on READY only when it holds the engine's tokenizer files byte for byte, and then
tokenizes exactly as the engine's folder does; anything else loads the engine's folder."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from dyngen_client.proto.dyngen.v1 import generator_pb2 as pb
from engine.model.derived_files import DerivedFiles
from engine.model.folder_tokenizer import BACKEND, FACTS
from engine.model.gguf_source import GGUFSource
from engine.model.loader import load_tokenizer
from service.frontend.prompts import PromptTokenizer
from service.frontend.tokenizer_preload import TokenizerPreload, kept_tokenizer
from service.tokenizer_folder import same_tokenizer, write_model_files
from tests.tiny_service_model import write_servable_tiny_gguf

TEXTS = ("Hello there, world!", "  spaces\tand\nlines ", "ünïcödé ✓ 数字 123")


@pytest.fixture
def model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DYNGEN_CACHE_DIR", str(tmp_path / "cache"))
    return write_servable_tiny_gguf(tmp_path / "tiny.gguf")


def engine_folder(model: Path, target: Path) -> Path:
    """What a warm engine names in READY: its tokenizer, loaded from the kept folder, saved to
    `target`, with the model's files beside it."""
    derived = DerivedFiles.of(model)
    load_tokenizer(model, (), derived)  # a first start: converts and keeps it
    tokenizer = load_tokenizer(model, (), derived)  # a warm one: the kept folder
    tokenizer.save(target)
    write_model_files(target, GGUFSource(model).config, tokenizer.eos_token_ids, 512)
    return target


def ids(prompts: PromptTokenizer) -> list[list[int]]:
    chat = pb.TokenizeRequest()
    chat.chat.messages.add(role="user", content=TEXTS[0])
    return [prompts.token_ids(pb.TokenizeRequest(text=t)) for t in TEXTS] + [prompts.token_ids(chat)]


def take(
    model: Path | None, served: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[Path], PromptTokenizer]:
    """The preload's tokenizer for `served`, and the folders it loaded to get it."""
    loaded: list[Path] = []
    real = PromptTokenizer.load

    def spy(folder: Path) -> PromptTokenizer:
        loaded.append(folder)
        return real(folder)

    monkeypatch.setattr(PromptTokenizer, "load", staticmethod(spy))
    prompts = asyncio.run(TokenizerPreload(model).take(served))
    return loaded, prompts


def test_the_kept_tokenizer_is_taken_when_its_files_are_the_engines(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = engine_folder(model, tmp_path / "served")
    kept = kept_tokenizer(model)
    assert kept == DerivedFiles.of(model).tokenizer
    assert same_tokenizer(kept, served)
    loaded, prompts = take(model, served, monkeypatch)
    assert loaded == [kept]  # nothing loaded on READY
    assert ids(prompts) == ids(PromptTokenizer.load(served))


@pytest.mark.parametrize("change", ["template", "extra file", "missing file"])
def test_a_kept_tokenizer_unlike_the_engines_is_not_taken(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    served = engine_folder(model, tmp_path / "served")
    kept = kept_tokenizer(model)
    assert kept is not None
    match change:
        case "template":
            config = served / "tokenizer_config.json"
            config.write_text(config.read_text(encoding="utf-8") + " ", encoding="utf-8")
        case "extra file":
            (served / "special_tokens_map.json").write_text("{}", encoding="utf-8")
        case "missing file":  # in the kept folder, not the engine's
            (kept / "added_tokens.json").write_text("{}", encoding="utf-8")
    assert not same_tokenizer(kept, served)
    loaded, prompts = take(model, served, monkeypatch)
    assert loaded == [kept, served]
    assert ids(prompts) == ids(PromptTokenizer.load(served))


def test_without_a_kept_tokenizer_the_engines_folder_loads(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = engine_folder(model, tmp_path / "served")
    shutil.rmtree(DerivedFiles.of(model).tokenizer)
    assert kept_tokenizer(model) is None
    assert take(model, served, monkeypatch)[0] == [served]
    assert kept_tokenizer(tmp_path / "no-such.gguf") is None
    assert take(tmp_path / "no-such.gguf", served, monkeypatch)[0] == [served]


def test_same_tokenizer_leaves_out_the_model_files_and_the_engines_facts(tmp_path: Path) -> None:
    kept, served = tmp_path / "kept", tmp_path / "served"
    for folder in (kept, served):
        folder.mkdir()
        (folder / "tokenizer.json").write_bytes(b'{"a": 1}')
    (kept / FACTS).write_text("{}")
    (kept / BACKEND).write_text("{}")
    (served / "config.json").write_text("{}")
    (served / "generation_config.json").write_text("{}")
    assert same_tokenizer(kept, served)
    (served / "tokenizer.json").write_bytes(b'{"a": 2}')
    assert not same_tokenizer(kept, served)
    assert not same_tokenizer(kept, tmp_path / "gone")
