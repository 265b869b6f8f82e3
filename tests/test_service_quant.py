"""`dyngen serve --quant`: the engine runs the chosen linear kinds and says so in GetModelInfo."""

from __future__ import annotations

from pathlib import Path

import pytest

from dyngen_client import Request, collect
from tests.service_harness import start_tiny_server
from tests.tiny_service_model import write_servable_tiny_gguf

pytestmark = pytest.mark.timeout(300)


def test_serve_with_int4_linears_reports_them(tmp_path: Path) -> None:
    model = write_servable_tiny_gguf(tmp_path / "tiny.gguf")
    s = start_tiny_server(model, "--quant", "int4")
    try:
        with s.client() as c:
            info = c.model_info()
            assert info.quant == "int4"
            assert "int4" in info.linears and info.cpu
            r = collect(list(c.generate(Request("hello", max_new_tokens=6, ignore_eos=True), timeout=60)))
            assert r.finished.new_tokens == 6
        ready = s.wait_log("engine_ready")
        assert ready["linears"] == info.linears
    finally:
        assert s.stop() == 0
