"""Regenerate the Python stubs of protos/dyngen/v1/*.proto: `python -m dyngen_client.proto.generate`.

protoc is told that protos/ lives at `dyngen_client/proto` (`-Idyngen_client/proto=protos`), so
the generated modules import each other as `dyngen_client.proto.dyngen.v1...` and resolve inside
the client package. Needs grpcio-tools and mypy-protobuf (the server's dev extras pin both);
tests/test_contract_stubs.py regenerates into a temporary folder and fails on drift.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

PACKAGE_ROOT = Path(__file__).resolve().parent.parent.parent  # clients/python
REPO_ROOT = PACKAGE_ROOT.parent.parent
PROTOS = REPO_ROOT / "protos"


def generate(out: Path) -> None:
    protos = sorted(p for p in (PROTOS / "dyngen").rglob("*.proto"))
    names = [f"dyngen_client/proto/{p.relative_to(PROTOS).as_posix()}" for p in protos]
    include = str(Path(protoc.__file__).parent / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-Idyngen_client/proto={PROTOS}",
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
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else PACKAGE_ROOT)
