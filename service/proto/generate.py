"""Regenerate the Python stubs of protos/dyngen/v1/*.proto: `python -m service.proto.generate`.

protoc is told that protos/ lives at `service/proto` (`-Iservice/proto=protos`), so the
generated modules import each other as `service.proto.dyngen.v1...` and resolve inside this
package. tests/test_service_protos.py regenerates into a temporary folder and fails on drift.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent.parent


def generate(out: Path) -> None:
    protos = sorted((ROOT / "protos").rglob("*.proto"))
    names = [f"service/proto/{p.relative_to(ROOT / 'protos').as_posix()}" for p in protos]
    include = str(Path(protoc.__file__).parent / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-Iservice/proto={ROOT / 'protos'}",
        f"-I{include}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *names,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
