"""`--device` and `--attention` (engine/device.py, service/device_check.py).

On this machine (no GPU): `--device cuda` is refused in one line with exit status 2 by both
commands, `auto` is the CPU, GetModelInfo names the device; and the GPU's code path, the Triton
kernels, runs on the CPU under the interpreter: `dyngen generate --attention triton` gives the
same greedy tokens as `--attention torch` for several prompts in one batch, with prefill and decode
rows in the same forwards (float32).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.device import DeviceUnavailableError, check_device_flag, cuda_problem, resolve_device
from engine.errors import InvalidRequestError
from service.cli import main
from tests.service_harness import start_tiny_server
from tests.tiny_service_model import write_servable_tiny_gguf

NO_CUDA = not torch.cuda.is_available()


def dyngen(*args: str, interpret: bool = False, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def test_the_flag_is_checked_without_torch() -> None:
    for flag in ("auto", "cpu", "cuda", "cuda:0", "cuda:12"):
        assert check_device_flag(flag) == flag
    for flag in ("gpu", "cuda:", "cuda:x", "CPU", "cuda:1:2"):
        with pytest.raises(InvalidRequestError, match="--device takes"):
            check_device_flag(flag)
    assert cuda_problem("cpu", 0, "2.13.0") is None
    assert cuda_problem("cuda:1", 2, "2.13.0") is None
    assert "no CUDA device" in (cuda_problem("cuda", 0, "2.13.0+cpu") or "")
    assert "numbered 0 to 1" in (cuda_problem("cuda:2", 2, "2.13.0") or "")


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_auto_is_the_cpu_and_cuda_is_refused_without_cuda() -> None:
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(DeviceUnavailableError, match="sees no CUDA device"):
        resolve_device("cuda")


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_serve_and_generate_refuse_cuda_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    done = dyngen("serve", "--device", "cuda", "--port", "0", timeout=180)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dyngen: error: --device cuda:"), done.stderr
    assert main(["generate", "hello", "--device", "cuda:0", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device cuda:0" in err[0] and "Traceback" not in err[0]


def test_triton_attention_on_the_cpu_needs_the_interpreter() -> None:
    done = dyngen("generate", "hello", "--device", "cpu", "--attention", "triton", "--quiet", timeout=180)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "TRITON_INTERPRET=1" in lines[0], done.stderr


def test_model_info_and_the_start_log_name_the_device(tmp_path: Path) -> None:
    server = start_tiny_server(write_servable_tiny_gguf(tmp_path / "tiny.gguf"), "--device", "auto")
    try:
        with server.client() as c:
            device = c.model_info().device
        ready = server.wait_log("engine_ready")
    finally:
        assert server.stop() == 0
    assert device == "cpu" if NO_CUDA else device.startswith("cuda:")
    assert ready["device"] == device
    parts = ready["start_parts"]
    assert isinstance(parts, dict) and set(parts) == {"imports", "model", "warmup", "tokenizer"}


@pytest.mark.slow
def test_triton_and_torch_attention_give_the_same_greedy_tokens(tmp_path: Path) -> None:
    """The shipped model in float32, three prompts run together, a few tokens (the interpreter is
    slow). Forwards of CHUNK tokens: the first prompt's prefill ends in the first forward and the
    second's does not, so the next forwards hold decode rows beside prefill rows (decode tokens are
    scheduled first, then the prompts' remaining chunks: engine/scheduler.py)."""
    prompts = tmp_path / "prompts.jsonl"
    texts = ("The capital of France is", "Write a haiku about the sea.", "List three fruits that are red:")
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    common = [*("generate", "--prompts-file", str(prompts), "--device", "cpu", "--dtype", "float32")]
    common += ["--max-new-tokens", "5", "--ignore-eos", "--chunk-size", str(CHUNK), "--quiet"]
    triton = dyngen(*common, "--attention", "triton", interpret=True)
    plain = dyngen(*common, "--attention", "torch")
    assert triton.returncode == 0 and plain.returncode == 0, triton.stderr + plain.stderr
    records = [[json.loads(line) for line in r.stdout.splitlines()] for r in (triton, plain)]
    lengths = [r["prompt_tokens"] for r in records[0]]
    assert lengths[0] < CHUNK < lengths[0] + lengths[1], lengths  # decode beside prefill, as above
    ids = [[r["token_ids"] for r in rs] for rs in records]
    assert len(ids[0]) == 3 and all(len(t) == 5 for t in ids[0])
    assert ids[0] == ids[1]


CHUNK = 8  # tokens per forward; the prompts are 5, 8 and 7 tokens
