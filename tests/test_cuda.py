"""GPU serving checks (issue 25) on a CUDA device: skipped where torch sees none, as in CI.

The checks themselves (tests/cuda_checks.py) run in a child process without TRITON_INTERPRET, so
the Triton kernels compile for the GPU; and `dyngen serve --device cuda` serves a request.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dyngen_client.request import Request
from dyngen_client.result import collect
from tests.service_harness import start_tiny_server
from tests.tiny_service_model import write_servable_tiny_gguf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


def test_kernels_and_greedy_tokens_on_cuda() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.cuda_checks"],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_serve_on_cuda(tmp_path: Path) -> None:
    server = start_tiny_server(write_servable_tiny_gguf(tmp_path / "tiny.gguf"), "--device", "cuda")
    try:
        with server.client() as c:
            assert c.model_info().device.startswith("cuda:")
            result = collect(c.generate(Request([11, 12, 13], max_new_tokens=8, ignore_eos=True)))
            assert len(result.token_ids) == 8
    finally:
        assert server.stop() == 0
