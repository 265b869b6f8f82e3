"""FolderTokenizer (the tokenizers library alone) against transformers' tokenizer of the same folder:
the same ids, the same text, the same facts, for any text and any ids."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.model.derived_files import DerivedFiles
from engine.model.folder_tokenizer import BACKEND, FACTS, FolderTokenizer, write_facts
from engine.model.loader import load_tokenizer
from engine.model.tokenizer import ChatMessage, HFTokenizer
from tests.tiny_llama import save_tiny_tokenizer


@pytest.fixture(scope="module")
def converted(
    shipped_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[HFTokenizer, DerivedFiles]:
    """The shipped model's tokenizer as transformers converts it from the GGUF file (seconds: once
    per module), and the derived folder the engine keeps it in."""
    derived = DerivedFiles(tmp_path_factory.mktemp("derived") / "model")
    hf = load_tokenizer(shipped_path, [0], derived)
    assert isinstance(hf, HFTokenizer)  # converted, and saved with its facts
    return hf, derived


@pytest.fixture(scope="module")
def pair(converted: tuple[HFTokenizer, DerivedFiles]) -> tuple[HFTokenizer, FolderTokenizer]:
    hf, derived = converted
    fast = FolderTokenizer.open(derived.tokenizer, extra_eos=[0])
    assert fast is not None
    return hf, fast


# Text the shipped vocabulary finds hard: special tokens inside words, odd spacing, emoji, CJK,
# control characters, and what looks like a chat turn.
_PIECES = [
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    " ",
    "  ",
    "\n",
    "\t",
    "é",
    "日本",
    "🙂",
    "a",
    "The",
    "'s",
]
_TEXT = st.lists(st.one_of(st.text(max_size=12), st.sampled_from(_PIECES)), max_size=12).map("".join)


@settings(max_examples=200, deadline=None)
@given(text=_TEXT, special=st.booleans())
def test_encode_is_transformers(pair: tuple[HFTokenizer, FolderTokenizer], text: str, special: bool) -> None:
    hf, fast = pair
    assert fast.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special)


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 49151), max_size=24), skip=st.booleans())
def test_decode_is_transformers(
    pair: tuple[HFTokenizer, FolderTokenizer], ids: list[int], skip: bool
) -> None:
    hf, fast = pair
    assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_facts_and_backend_are_transformers(pair: tuple[HFTokenizer, FolderTokenizer]) -> None:
    hf, fast = pair
    assert fast.vocab_size == hf.vocab_size == 49152
    assert fast.eos_token_ids == hf.eos_token_ids == {0, 2}
    assert fast.backend_json() == hf.backend_json()
    chat = [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi <|im_end|> there")]
    assert fast.encode_chat(chat) == hf.encode_chat(chat)
    assert fast.render_chat(chat, add_generation_prompt=False) == hf.render_chat(
        chat, add_generation_prompt=False
    )


def test_a_folder_without_facts_is_not_opened(tmp_path: Path) -> None:
    save_tiny_tokenizer(tmp_path)
    assert FolderTokenizer.open(tmp_path) is None
    (tmp_path / FACTS).write_text("{not json", encoding="utf-8")
    assert FolderTokenizer.open(tmp_path) is None
    (tmp_path / FACTS).write_text(json.dumps({"version": 999}), encoding="utf-8")
    assert FolderTokenizer.open(tmp_path) is None


def test_a_decode_that_cleans_up_spaces_writes_no_facts(tmp_path: Path) -> None:
    """transformers' clean-up changes decoded text (" ." to "."): such a folder stays on transformers."""
    save_tiny_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["clean_up_tokenization_spaces"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    hf = HFTokenizer(tmp_path)
    assert hf.backend_facts() is None
    write_facts(hf, tmp_path, DerivedFiles(tmp_path / "model").publish_file)
    assert not (tmp_path / FACTS).exists() and not (tmp_path / BACKEND).exists()


def test_a_kept_folder_from_before_the_facts_gains_them(
    shipped_path: Path, converted: tuple[HFTokenizer, DerivedFiles], tmp_path: Path
) -> None:
    _, derived = converted
    (derived.tokenizer / FACTS).unlink()
    again = load_tokenizer(shipped_path, [], derived)
    assert isinstance(again, HFTokenizer) and (derived.tokenizer / FACTS).exists()
    fast = load_tokenizer(shipped_path, [], derived)
    assert isinstance(fast, FolderTokenizer)
    copy = tmp_path / "copy"
    fast.save(copy)  # what the engine hands the front end
    assert (copy / "tokenizer.json").exists() and (copy / "tokenizer_config.json").exists()
    assert not (copy / FACTS).exists() and not (copy / BACKEND).exists()
    assert HFTokenizer(copy).encode("Hello there") == fast.encode("Hello there")


def test_the_engine_loads_the_kept_tokenizer_without_transformers(
    shipped_path: Path, converted: tuple[HFTokenizer, DerivedFiles]
) -> None:
    """A warm engine start never imports transformers (~0.7 s of it)."""
    _, derived = converted
    code = (
        "import sys; from pathlib import Path; from engine.model.derived_files import DerivedFiles; "
        "from engine.model.loader import load_tokenizer; "
        f"t = load_tokenizer(Path({str(shipped_path)!r}), [], DerivedFiles(Path({str(derived.folder)!r}))); "
        "print(type(t).__name__, 'transformers' in sys.modules, t.decode(t.encode('Hi there')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["FolderTokenizer", "False", "Hi", "there"]
