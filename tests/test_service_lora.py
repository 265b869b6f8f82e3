"""LoRA adapters through `dyngen serve` (a tiny random-weight model on 127.0.0.1): --lora at start,
LoadAdapter / ListAdapters / UnloadAdapter at run time while other jobs stream, the statuses of
each refusal, and tenants that see only their own adapters and the server's."""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from benchmarks.inprocess.lora_throughput import write_adapter
from dyngen_client.client import Client
from dyngen_client.errors import ErrorReason, error_details
from dyngen_client.request import Request
from dyngen_client.result import collect
from engine.model.gguf_source import GGUFSource
from tests.service_harness import ServerProcess, start_tiny_server
from tests.tiny_service_model import write_servable_tiny_gguf

pytestmark = [pytest.mark.timeout(300)]

PROMPT = (11, 12, 13, 14, 15, 16, 17)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_servable_tiny_gguf(tmp_path_factory.mktemp("lora") / "tiny.gguf")


@pytest.fixture(scope="module")
def folders(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    config = GGUFSource(model).config
    root = tmp_path_factory.mktemp("adapters")
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return {
        "shared": write_adapter(root / "shared", config, 8, every, range(config.num_layers), 1, scale=0.3),
        "mine": write_adapter(
            root / "mine", config, 4, ["q_proj", "down_proj"], range(config.num_layers), 2, scale=0.3
        ),
    }


def _tokens(client: Client, adapter: str = "", n: int = 12) -> tuple[int, ...]:
    request = Request(list(PROMPT), max_new_tokens=n, ignore_eos=True, adapter=adapter)
    return collect(client.generate(request)).token_ids


def _code(exc: pytest.ExceptionInfo[grpc.RpcError]) -> tuple[grpc.StatusCode, ErrorReason | None]:
    return exc.value.code(), error_details(exc.value).reason


@pytest.fixture(scope="module")
def server(model: Path, folders: dict[str, Path]) -> Iterator[ServerProcess]:
    s = start_tiny_server(model, "--lora", f"shared={folders['shared']}", "--max-adapters", "2")
    yield s
    assert s.stop() == 0


def test_adapters_change_the_output_and_are_listed(server: ServerProcess, folders: dict[str, Path]) -> None:
    with server.client() as c:
        (info,) = c.list_adapters()
        assert (info.name, info.shared, info.path) == ("shared", True, str(folders["shared"]))
        base, adapted = _tokens(c), _tokens(c, "shared")
        assert base != adapted
        assert _tokens(c, "shared") == adapted  # greedy: the same every time
        finished = collect(c.generate(Request(list(PROMPT), max_new_tokens=2, adapter="shared"))).finished
        assert finished.adapter == "shared"
        assert c.model_info().max_adapters == 2
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        metrics = r.read().decode()
    assert 'dyngen_adapter_jobs_finished_total{adapter="shared"} 3.0' in metrics


def test_load_unload_while_jobs_stream(server: ServerProcess, folders: dict[str, Path]) -> None:
    with server.client() as c:
        # A long base-model job streams the whole time.
        done: list[int] = []
        long_job = threading.Thread(
            target=lambda: done.append(len(_tokens(c, n=300))), name="long-job", daemon=True
        )
        long_job.start()
        info = c.load_adapter("mine", str(folders["mine"]))
        assert info.name == "mine" and not info.shared
        with pytest.raises(grpc.RpcError) as exc:
            c.load_adapter("mine", str(folders["shared"]))
        assert _code(exc) == (grpc.StatusCode.ALREADY_EXISTS, ErrorReason.ADAPTER_EXISTS)
        with pytest.raises(grpc.RpcError) as exc:
            c.load_adapter("third", str(folders["shared"]))
        assert _code(exc) == (grpc.StatusCode.RESOURCE_EXHAUSTED, ErrorReason.ADAPTER_LIMIT)
        mine = _tokens(c, "mine")
        assert mine not in (_tokens(c), _tokens(c, "shared"))

        # Unloading while a job of the adapter runs is refused; once it ends, the unload goes through.
        job = c.enqueue(Request(list(PROMPT), max_new_tokens=4000, ignore_eos=True, adapter="mine"))
        with pytest.raises(grpc.RpcError) as exc:
            c.unload_adapter("mine")
        assert _code(exc) == (grpc.StatusCode.FAILED_PRECONDITION, ErrorReason.ADAPTER_IN_USE)
        assert [a.jobs for a in c.list_adapters() if a.name == "mine"] == [1]
        c.cancel(job)
        for _ in range(50):
            try:
                c.unload_adapter("mine")
                break
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
                threading.Event().wait(0.1)
        assert [a.name for a in c.list_adapters()] == ["shared"]
        with pytest.raises(grpc.RpcError) as exc:
            _tokens(c, "mine")
        assert _code(exc) == (grpc.StatusCode.NOT_FOUND, ErrorReason.ADAPTER_NOT_FOUND)
        # Loaded again, it computes what it did.
        c.load_adapter("mine", str(folders["mine"]))
        assert _tokens(c, "mine") == mine
        c.unload_adapter("mine")
        long_job.join(120)
        assert done == [300]


def test_refusals_say_why(server: ServerProcess, folders: dict[str, Path], tmp_path: Path) -> None:
    with server.client() as c:
        for name, path, want in (
            ("x", str(tmp_path / "nowhere"), (grpc.StatusCode.NOT_FOUND, ErrorReason.ADAPTER_NOT_FOUND)),
            (
                "bad~name",
                str(folders["mine"]),
                (grpc.StatusCode.INVALID_ARGUMENT, ErrorReason.INVALID_ARGUMENT),
            ),
            ("x", "", (grpc.StatusCode.INVALID_ARGUMENT, ErrorReason.INVALID_ARGUMENT)),
        ):
            with pytest.raises(grpc.RpcError) as exc:
                c.load_adapter(name, path)
            assert _code(exc) == want, name
        broken = tmp_path / "broken"
        broken.mkdir()
        (broken / "adapter_config.json").write_text(
            '{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_dora": true}'
        )
        (broken / "adapter_model.safetensors").write_bytes(
            (folders["mine"] / "adapter_model.safetensors").read_bytes()
        )
        with pytest.raises(grpc.RpcError) as exc:
            c.load_adapter("broken", str(broken))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "DoRA" in str(exc.value.details())
        with pytest.raises(grpc.RpcError) as exc:
            _tokens(c, "no.such")
        assert _code(exc) == (grpc.StatusCode.NOT_FOUND, ErrorReason.ADAPTER_NOT_FOUND)
        assert _tokens(c, "shared")  # the engine serves on


def test_tenants_see_their_own_adapters_and_the_shared_ones(
    model: Path, folders: dict[str, Path], tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    alice, bob = "alice-token-0123456789", "bob-token-9876543210xx"
    tokens.write_text(f"alice {alice}\nbob {bob}\n")
    s = start_tiny_server(model, "--auth-tokens-file", str(tokens), "--lora", f"shared={folders['shared']}")
    try:
        with Client(s.target, token=alice) as a, Client(s.target, token=bob) as b:
            a.load_adapter("mine", str(folders["mine"]))
            assert [(i.name, i.shared) for i in a.list_adapters()] == [("mine", False), ("shared", True)]
            assert [i.name for i in b.list_adapters()] == ["shared"]
            mine = _tokens(a, "mine")
            with pytest.raises(grpc.RpcError) as exc:
                _tokens(b, "mine")
            assert _code(exc) == (grpc.StatusCode.NOT_FOUND, ErrorReason.ADAPTER_NOT_FOUND)
            with pytest.raises(grpc.RpcError) as exc:
                b.unload_adapter("mine")
            assert exc.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.RpcError) as exc:
                a.unload_adapter("shared")  # the server's own
            assert exc.value.code() == grpc.StatusCode.NOT_FOUND
            b.load_adapter("mine", str(folders["shared"]))  # bob's own "mine" is another adapter
            assert _tokens(b, "mine") == _tokens(b, "shared") != mine
            assert _tokens(a, "mine") == mine
    finally:
        assert s.stop() == 0
