"""Bad input gets a clear, typed error (and a one-line message from the CLI), never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.errors import (
    InvalidRequestError,
    ModelFormatError,
    ModelNotFoundError,
    PromptTooLongError,
    UnsupportedModelError,
)
from engine.model.llama import LlamaModel
from engine.model.loader import open_weight_source
from service.cli import main
from tests.reference_generate import GenerationSettings, generate_batch
from tests.tiny_llama import save_tiny_llama


def test_missing_model_file(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="not found"):
        open_weight_source(tmp_path / "absent.gguf")


def test_folder_without_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        open_weight_source(tmp_path)


def test_unsupported_architecture_in_config(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported"):
        open_weight_source(tmp_path)


def test_unsupported_rope_scaling(tmp_path: Path) -> None:
    save_tiny_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="yarn"):
        open_weight_source(tmp_path)


def test_wrong_suffix(tmp_path: Path) -> None:
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    with pytest.raises(InvalidRequestError, match=r"expected a \.gguf file"):
        open_weight_source(f)


def test_junk_gguf(tmp_path: Path) -> None:
    f = tmp_path / "junk.gguf"
    f.write_bytes(b"this is not a gguf file at all" * 4)
    with pytest.raises(ModelFormatError, match="not a readable GGUF"):
        open_weight_source(f)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LlamaModel:
    folder = tmp_path_factory.mktemp("tiny")
    save_tiny_llama(folder)
    return LlamaModel.from_source(open_weight_source(folder), progress=False)


def test_prompt_longer_than_cache(tiny: LlamaModel) -> None:
    cache = tiny.new_cache(num_pages=2, page_size=16)
    with pytest.raises(
        PromptTooLongError, match=r"40 tokens \+ max_new_tokens 8 = 48 tokens exceeds the KV cache of 32"
    ):
        generate_batch(tiny, cache, [[5] * 40], GenerationSettings(max_new_tokens=8))


def test_prompt_longer_than_context(tiny: LlamaModel) -> None:
    cache = tiny.new_cache(num_pages=64, page_size=16)
    with pytest.raises(PromptTooLongError, match=r"exceeds the model.s context of 512"):
        generate_batch(tiny, cache, [[5] * 500], GenerationSettings(max_new_tokens=20))


def test_bad_prompt_ids(tiny: LlamaModel) -> None:
    cache = tiny.new_cache(num_pages=4, page_size=16)
    with pytest.raises(InvalidRequestError, match="at least one token"):
        generate_batch(tiny, cache, [[]], GenerationSettings(max_new_tokens=4))
    with pytest.raises(InvalidRequestError, match=r"token ids must be in \[0, 320\)"):
        generate_batch(tiny, cache, [[1, 999]], GenerationSettings(max_new_tokens=4))


@pytest.mark.parametrize(
    "field, value", [("max_new_tokens", 0), ("temperature", -1.0), ("temperature", float("nan"))]
)
def test_bad_settings(field: str, value: float) -> None:
    with pytest.raises(InvalidRequestError, match=field):
        GenerationSettings(**{field: value})  # type: ignore[arg-type]


def test_cli_reports_errors_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "hello", "--model", str(tmp_path / "nope.gguf"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dyngen: error: model not found:") and "Traceback" not in err

    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    assert main(["generate", "--prompts-file", str(bad), "--quiet"]) == 2
    assert ':2: expected an object with a string "prompt"' in capsys.readouterr().err

    folder = tmp_path / "tiny"
    save_tiny_llama(folder, with_tokenizer=True)
    long_prompt = " ".join(f"w{i}" for i in range(20))
    args = [
        "generate",
        long_prompt,
        "--model",
        str(folder),
        "--cache-tokens",
        "16",
        "--page-size",
        "16",
        "--quiet",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert (
        "prompt of 20 tokens + max_new_tokens 256 = 276 tokens exceeds the whole KV cache of 16 tokens" in err
    )

    assert main(["generate", "--chat", "w1", "--model", str(folder), "--quiet"]) == 2
    assert "has no chat template" in capsys.readouterr().err
