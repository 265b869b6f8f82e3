"""The Node.js client (clients/node) against a real `dyngen serve`: its e2e test (clients/node/test/)
streams a chat completion, cancels a job, sends priority, guidance and prompt embeddings (float32
bytes), and reads INVALID_ARGUMENT's field violation and RESOURCE_EXHAUSTED's RetryInfo from the
status details. The server is the tiny model with --max-streams 1, so a second open stream is refused. Its scale-out test checks the affinity key's
test vectors and meets a stream cut without a status (tests/stream_cut_server.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks.inprocess.lora_throughput import write_adapter
from engine.model.gguf_source import GGUFSource
from tests.service_harness import start_tiny_server
from tests.stream_cut_server import StreamCutServer
from tests.tiny_service_model import write_servable_tiny_gguf

NODE_DIR = Path(__file__).resolve().parent.parent / "clients" / "node"

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(shutil.which("node") is None or shutil.which("npm") is None, reason="no Node.js"),
]


def test_node_client_against_the_real_server(tmp_path: Path) -> None:
    assert (NODE_DIR / "node_modules").is_dir(), "run: npm ci --prefix clients/node"
    model = write_servable_tiny_gguf(tmp_path / "tiny.gguf")
    config = GGUFSource(model).config
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapter = write_adapter(tmp_path / "adapter", config, 8, every, range(config.num_layers), 1, scale=0.3)
    server = start_tiny_server(
        model, "--max-streams", "1", "--lora", f"shared={adapter}", "--adapter-dir", str(tmp_path)
    )
    try:
        with StreamCutServer() as cut:
            # `npm test` generates the types from protos/, type-checks and compiles, then runs node --test.
            done = subprocess.run(
                ["npm", "test", "--silent"],
                check=False,
                cwd=NODE_DIR,
                env=dict(
                    os.environ,
                    DYNGEN_TARGET=server.target,
                    DYNGEN_CUT_TARGET=cut.target,
                    DYNGEN_ADAPTER_PATH=adapter.name,  # inside --adapter-dir
                ),
                capture_output=True,
                text=True,
                timeout=240,
            )
            assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
            assert "# fail 0" in done.stdout and "# pass 11" in done.stdout, done.stdout[-3000:]
    finally:
        assert server.stop() == 0
