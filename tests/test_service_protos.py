"""The committed Python stubs (in the client package) are exactly what protos/ generates today,
and they import."""

from __future__ import annotations

from pathlib import Path

import pytest

from dyngen_client.proto.generate import PACKAGE_ROOT, generate

GENERATED = PACKAGE_ROOT / "dyngen_client" / "proto" / "dyngen"
REGENERATE = "run: python -m dyngen_client.proto.generate"


def test_committed_stubs_match_the_protos(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    generate(tmp_path)
    out = tmp_path / "dyngen_client" / "proto" / "dyngen"
    fresh = {p.relative_to(out): p for p in out.rglob("*.py*")}
    committed = {
        p.relative_to(GENERATED): p
        for p in GENERATED.rglob("*.py*")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    }
    assert sorted(fresh) == sorted(committed), REGENERATE
    for name, path in fresh.items():
        assert path.read_text() == committed[name].read_text(), f"{name} drifted; {REGENERATE}"


def test_stubs_import_and_describe_the_service() -> None:
    from dyngen_client.proto.dyngen.v1 import generator_pb2, generator_pb2_grpc

    service = generator_pb2.DESCRIPTOR.services_by_name["Generator"]
    assert service.full_name == "dyngen.v1.Generator"
    assert {m.name for m in service.methods} == {
        "Enqueue",
        "Stream",
        "Cancel",
        "Generate",
        "GetModelInfo",
        "Tokenize",
        "LoadAdapter",
        "UnloadAdapter",
        "ListAdapters",
    }
    assert hasattr(generator_pb2_grpc, "GeneratorStub")
