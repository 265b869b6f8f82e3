"""`dyngen generate` on the shipped model, through the installed console script; its flags into the
engine settings."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from engine import defaults
from service.cli import build_parser
from service.engine_config import engine_settings_from

pytestmark = pytest.mark.slow


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("dyngen")
    assert exe is not None, "the dyngen console script is not installed (pip install -e .)"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300, check=False)


def test_generate_chat_answers_france(tmp_path: Path) -> None:
    done = run_cli("generate", "--chat", "What is the capital of France?", "--quiet")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "The capital of France is Paris."


def test_prompts_file_json_lines_in_order(tmp_path: Path) -> None:
    questions = ["What is the capital of France?", "What is 2 + 2?", "Name a color."]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in questions))
    done = run_cli("generate", "--chat", "--prompts-file", str(prompts), "--max-new-tokens", "24", "--quiet")
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(records) == 3
    assert records[0]["text"] == "The capital of France is Paris."
    assert records[0]["stop_reason"] == "eos"
    for r in records:
        assert set(r) >= {"text", "token_ids", "stop_reason", "prompt_tokens", "new_tokens"}
        assert r["new_tokens"] == len(r["token_ids"]) <= 24
        assert 2 not in r["token_ids"]  # the stop token is not part of the output


def test_json_single_prompt_max_tokens() -> None:
    done = run_cli(
        "generate", "Once upon a time", "--max-new-tokens", "7", "--ignore-eos", "--json", "--quiet"
    )
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["stop_reason"] == "max_new_tokens" and len(record["token_ids"]) == 7


def test_generate_takes_the_sampler_pool_size_into_the_engine_settings() -> None:
    parser = build_parser()
    args = parser.parse_args(["generate", "hi", "--sampler-mode", "threaded", "--sampling-threads", "3"])
    settings = engine_settings_from(args)
    assert (settings.sampler_mode, settings.sampling_threads) == ("threaded", 3)
    assert (
        engine_settings_from(parser.parse_args(["generate", "hi"])).sampling_threads
        == defaults.SAMPLING_THREADS
    )


def test_generate_takes_the_prompt_share_and_the_forward_alone_into_the_engine_settings() -> None:
    parser = build_parser()
    args = parser.parse_args(["generate", "hi", "--prompt-reserve", "0.5", "--prefill-alone-ms", "0"])
    settings = engine_settings_from(args)
    assert (settings.prompt_reserve, settings.prefill_alone_ms) == (0.5, 0.0)
    plain = engine_settings_from(parser.parse_args(["generate", "hi"]))
    assert (plain.prompt_reserve, plain.prefill_alone_ms) == (
        defaults.PROMPT_RESERVE,
        defaults.PREFILL_ALONE_MS,
    )
    for bad in (["--prompt-reserve", "1"], ["--prefill-alone-ms", "-1"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["generate", "hi", *bad])
