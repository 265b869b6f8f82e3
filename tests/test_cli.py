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


def test_a_prompts_file_line_that_cannot_run_is_named(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    lines = ["Hi", "word " * 400, "Hello"]  # the second is past a 256-token cache
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in lines))
    done = run_cli(
        "generate",
        "--prompts-file",
        str(prompts),
        "--cache-tokens",
        "256",
        "--max-new-tokens",
        "8",
        "--quiet",
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines()[-1].startswith("dyngen: error: prompt 2 of 3: "), done.stderr


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


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--port", "70000"], "--port: expected a whole number in [0, 65535], got '70000'"),
        (["--metrics-port", "-1"], "--metrics-port: expected a whole number in [0, 65535]"),
        (["--max-message-bytes", "99999999999"], "--max-message-bytes: expected a whole number in [1024, "),
        (["--max-streams", "0"], "--max-streams: expected a whole number >= 1"),
        (["--max-pending-calls", "0"], "--max-pending-calls: expected a whole number >= 1"),
        (["--sampling-threads", "0"], "--sampling-threads: expected a whole number >= 1"),
        (["--watchdog-seconds", "0"], "--watchdog-seconds: expected seconds > 0"),
        (["--hang-seconds", "nan"], "--hang-seconds: expected seconds > 0"),
        (["--shutdown-grace-seconds", "-1"], "--shutdown-grace-seconds: expected seconds >= 0"),
        (["--speculate", "bogus"], "--speculate: expected one of auto, none, ngram, draft_model"),
        (["--omp-wait-policy", "bogus"], "--omp-wait-policy: expected one of active, passive"),
        (["--torch-threads", "x"], "--torch-threads: invalid value 'x'"),
    ],
)
def test_serve_refuses_values_it_cannot_serve_with_at_the_flag(
    flags: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each of these once started a server that refused every call (or wrapped the port, or raised
    a traceback in the engine): now argparse refuses it, one line and exit 2."""
    with pytest.raises(SystemExit) as ended:
        build_parser("serve").parse_args(["serve", *flags])
    assert ended.value.code == 2
    assert words in capsys.readouterr().err


def test_a_bad_environment_value_is_blamed_on_its_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from engine.errors import InvalidRequestError
    from service.config import config_from_args

    monkeypatch.setenv("DYNGEN_PORT", "abc")
    with pytest.raises(SystemExit) as ended:
        build_parser("serve").parse_args(["serve"])
    assert ended.value.code == 2 and "(from DYNGEN_PORT)" in capsys.readouterr().err
    assert build_parser("serve").parse_args(["serve", "--port", "7"]).port == 7  # the flag wins
    with pytest.raises(SystemExit) as ended:
        build_parser("serve").parse_args(["serve", "--help"])  # help still works
    assert ended.value.code == 0 and "DYNGEN_PORT" in capsys.readouterr().out
    monkeypatch.delenv("DYNGEN_PORT")
    monkeypatch.setenv("DYNGEN_LORA", f"ok={tmp_path},broken")
    with pytest.raises(InvalidRequestError, match="DYNGEN_LORA: --lora takes NAME=PATH, got 'broken'"):
        config_from_args(build_parser("serve").parse_args(["serve"]))


def test_a_replica_that_keeps_failing_stops_the_cluster() -> None:
    from service.frontend.restart_policy import RestartPolicy
    from service.replica_restarts import ReplicaRestarts

    watch = ReplicaRestarts(2, RestartPolicy(backoff_seconds=0.5, max_failures=3))
    assert watch.exited(0, 2) is None and "refused its flags" in watch.why(0, 2)  # no restart mends it
    waits = [watch.exited(1, 1) for _ in range(4)]
    assert waits == [0.5, 1.0, 2.0, None]
    assert "failed 4 starts in a row (last exit 1" in watch.why(1, 1)
    assert not watch.due(1)


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (
            ["--server", "127.0.0.1:1", "--model", "x.gguf", "--quant", "int8"],
            "--model, --quant: the in-process",
        ),
        (["--server", "127.0.0.1:1", "--speculate", "none"], "--speculate: the in-process engine's settings"),
        # Given at its default's value, it is given all the same.
        (
            ["--server", "127.0.0.1:1", "--cache-tokens", str(defaults.CACHE_TOKENS)],
            "--cache-tokens: the in-process",
        ),
        (["--tls-ca", "ca.pem"], "--tls-ca: only with --server"),
        (["--token-file", "t"], "--token-file: only with --server"),
    ],
)
def test_generate_refuses_flags_its_mode_would_ignore(flags: list[str], words: str) -> None:
    from service.generate_cli import CliError, run_generate

    args = build_parser("generate").parse_args(["generate", *flags, "hi"])
    with pytest.raises(CliError, match=words):
        run_generate(args)
