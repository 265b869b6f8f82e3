"""The client package alone: a fresh venv with only `pip install ./clients/python` has no torch,
and its `dyngen-client` command and `dyngen_client.Client` call a real server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.service_harness import start_tiny_server
from tests.tiny_service_model import write_servable_tiny_gguf

CLIENT_DIR = Path(__file__).resolve().parent.parent / "clients" / "python"
# What the client may pull in; anything else (torch above all) is a dependency leak.
ALLOWED = {
    "dyngen-client",
    "grpcio",
    "protobuf",
    "googleapis-common-protos",
    "typing-extensions",
    "pip",
    "setuptools",
}

pytestmark = pytest.mark.timeout(400)

SCRIPT = """
import sys
from dyngen_client import Chat, Client, Request, collect
with Client(sys.argv[1]) as client:
    result = collect(client.generate(Request(Chat.user("Hi"), max_new_tokens=4, ignore_eos=True)))
print(result.stop_reason, len(result.token_ids), "torch" in sys.modules)
"""


def test_client_package_alone_in_a_fresh_venv(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python, pip = venv / "bin" / "python", venv / "bin" / "pip"
    subprocess.run(
        [str(pip), "install", "-q", "--disable-pip-version-check", str(CLIENT_DIR)], check=True, timeout=300
    )
    listed = subprocess.run(
        [str(pip), "list", "--format=json", "--disable-pip-version-check"],
        check=True,
        capture_output=True,
        text=True,
    )
    names = {p["name"].lower().replace("_", "-") for p in json.loads(listed.stdout)}
    assert "torch" not in names and names <= ALLOWED, names - ALLOWED

    server = start_tiny_server(write_servable_tiny_gguf(tmp_path / "tiny.gguf"))
    try:
        command = [str(venv / "bin" / "dyngen-client"), "generate", "--chat", "Hi", "--server", server.target]
        cli = subprocess.run(
            [*command, "--max-new-tokens", "6", "--ignore-eos", "--json"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        record = json.loads(cli.stdout)
        assert record["new_tokens"] == 6 and record["stop_reason"] == "max_new_tokens"
        api = subprocess.run(
            [str(python), "-c", SCRIPT, server.target],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert api.stdout.split() == ["max_new_tokens", "4", "False"]
    finally:
        assert server.stop() == 0
