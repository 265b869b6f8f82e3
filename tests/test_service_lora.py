"""LoRA adapters through `dyngen serve` (a tiny random-weight model on 127.0.0.1): --lora at start,
LoadAdapter / ListAdapters / UnloadAdapter at run time while other jobs stream, the statuses of
each refusal, and tenants that see only their own adapters and the server's."""

from __future__ import annotations

import os
import threading
import time
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
from tests.service_harness import ServerProcess, log_count, start_tiny_server
from tests.tiny_service_model import write_servable_tiny_gguf

pytestmark = [pytest.mark.timeout(300)]

PROMPT = (11, 12, 13, 14, 15, 16, 17)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_servable_tiny_gguf(tmp_path_factory.mktemp("lora") / "tiny.gguf")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server's adapter folder (--adapter-dir): run-time loads name folders inside it."""
    return tmp_path_factory.mktemp("adapter-dir")


@pytest.fixture(scope="module")
def folders(model: Path, root: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    config = GGUFSource(model).config
    elsewhere = tmp_path_factory.mktemp("operator")  # --lora's folder: any operator path
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    shared = write_adapter(elsewhere / "shared", config, 8, every, range(config.num_layers), 1, scale=0.3)
    return {
        "shared": shared,
        "shared-copy": write_adapter(
            root / "shared-copy", config, 8, every, range(config.num_layers), 1, scale=0.3
        ),
        "mine": write_adapter(
            root / "mine", config, 4, ["q_proj", "down_proj"], range(config.num_layers), 2, scale=0.3
        ),
    }


def _tokens(client: Client, adapter: str = "", n: int = 12) -> tuple[int, ...]:
    request = Request(list(PROMPT), max_new_tokens=n, ignore_eos=True, adapter=adapter)
    return collect(client.generate(request)).token_ids


def _code(exc: pytest.ExceptionInfo[grpc.RpcError]) -> tuple[grpc.StatusCode, ErrorReason | None]:
    return exc.value.code(), error_details(exc.value).reason


def _metrics(server: ServerProcess) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5) as r:
        text: str = r.read().decode()
        return text


@pytest.fixture(scope="module")
def server(model: Path, root: Path, folders: dict[str, Path]) -> Iterator[ServerProcess]:
    s = start_tiny_server(
        model, "--lora", f"shared={folders['shared']}", "--max-adapters", "2", "--adapter-dir", str(root)
    )
    yield s
    assert s.stop() == 0


def test_adapters_change_the_output_and_are_listed(server: ServerProcess, folders: dict[str, Path]) -> None:
    with server.client() as c:
        (info,) = c.list_adapters()
        # The server's own adapter shows its name and ranks, never the server's folder.
        assert (info.name, info.shared, info.path) == ("shared", True, "")
        assert "rank 8" in info.description
        base, adapted = _tokens(c), _tokens(c, "shared")
        assert base != adapted
        assert _tokens(c, "shared") == adapted  # greedy: the same every time
        finished = collect(c.generate(Request(list(PROMPT), max_new_tokens=2, adapter="shared"))).finished
        assert finished.adapter == "shared"
        assert c.model_info().max_adapters == 2
    assert 'dyngen_adapter_jobs_finished_total{adapter="shared"} 3.0' in _metrics(server)


def test_load_unload_while_jobs_stream(server: ServerProcess, folders: dict[str, Path]) -> None:
    with server.client() as c:
        # A long base-model job streams the whole time: each of its tokens' arrival is kept.
        arrivals: list[float] = []

        def long_job() -> None:
            request = Request(list(PROMPT), max_new_tokens=300, ignore_eos=True)
            for event in c.generate(request):
                if event.HasField("delta"):
                    arrivals.extend([time.monotonic()] * len(event.delta.token_ids))

        streaming = threading.Thread(target=long_job, name="long-job", daemon=True)
        streaming.start()
        deadline = time.monotonic() + 60
        while not arrivals and time.monotonic() < deadline:
            time.sleep(0.01)
        load_at = time.monotonic()
        info = c.load_adapter("mine", "mine")
        assert (info.name, info.shared, info.path) == ("mine", False, "mine")
        with pytest.raises(grpc.RpcError) as exc:
            c.load_adapter("mine", "shared-copy")
        assert _code(exc) == (grpc.StatusCode.ALREADY_EXISTS, ErrorReason.ADAPTER_EXISTS)
        with pytest.raises(grpc.RpcError) as exc:
            c.load_adapter("third", "shared-copy")
        assert _code(exc) == (grpc.StatusCode.RESOURCE_EXHAUSTED, ErrorReason.ADAPTER_LIMIT)
        assert error_details(exc.value).retry_delay_seconds is not None
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
        c.load_adapter("mine", "mine")
        assert _tokens(c, "mine") == mine
        c.unload_adapter("mine")
        unload_done = time.monotonic()
        # The base job streamed through all of it: tokens before the first load and after the last unload.
        assert len(arrivals) < 300, "the long job ended before the loads and unloads were done"
        streaming.join(120)
        assert len(arrivals) == 300
        assert arrivals[0] < load_at and arrivals[-1] > unload_done


def test_refusals_say_why(
    server: ServerProcess, root: Path, folders: dict[str, Path], tmp_path: Path
) -> None:
    with server.client() as c:
        for name, path, want in (
            ("x", "nowhere", (grpc.StatusCode.NOT_FOUND, ErrorReason.ADAPTER_NOT_FOUND)),
            ("bad~name", "mine", (grpc.StatusCode.INVALID_ARGUMENT, ErrorReason.INVALID_ARGUMENT)),
            ("x", "", (grpc.StatusCode.INVALID_ARGUMENT, ErrorReason.INVALID_ARGUMENT)),
        ):
            with pytest.raises(grpc.RpcError) as exc:
                c.load_adapter(name, path)
            assert _code(exc) == want, name
        broken = root / "broken"
        broken.mkdir()
        (broken / "adapter_config.json").write_text(
            '{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_dora": true}'
        )
        (broken / "adapter_model.safetensors").write_bytes(
            (folders["mine"] / "adapter_model.safetensors").read_bytes()
        )
        with pytest.raises(grpc.RpcError) as exc:
            c.load_adapter("broken", "broken")
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "DoRA" in str(exc.value.details())
        with pytest.raises(grpc.RpcError) as exc:
            _tokens(c, "no.such")
        assert _code(exc) == (grpc.StatusCode.NOT_FOUND, ErrorReason.ADAPTER_NOT_FOUND)
        assert _tokens(c, "shared")  # the engine serves on


def test_paths_outside_the_adapter_folder_are_refused_alike(
    server: ServerProcess, root: Path, folders: dict[str, Path], tmp_path: Path
) -> None:
    """`..`, absolute paths and symlinks out: one status, reason and message (bar the path given),
    whether or not anything is there; the front end refuses the first two before any file is
    touched, the engine the links after resolving them."""
    outside = folders["shared"]  # a real adapter folder outside --adapter-dir
    os.symlink(outside, root / "link-out")
    os.symlink(tmp_path / "nothing-here", root / "link-nowhere")
    os.mkfifo(root / "fifo-weights-config")
    fifo = root / "fifo"
    fifo.mkdir()
    (fifo / "adapter_config.json").write_bytes((folders["mine"] / "adapter_config.json").read_bytes())
    os.mkfifo(fifo / "adapter_model.safetensors")
    seen: set[tuple[grpc.StatusCode, ErrorReason | None, str, tuple[str, ...]]] = set()
    with server.client() as c:
        for path in (
            "../operator/shared",
            "../no-such",
            str(outside),
            "/no/such/folder",
            "mine/../../etc",
            "link-out",
            "link-nowhere",
        ):
            with pytest.raises(grpc.RpcError) as exc:
                c.load_adapter("x", path)
            details = error_details(exc.value)
            message = str(exc.value.details()).replace(repr(path[:80]), "P")
            seen.add(
                (exc.value.code(), details.reason, message, tuple(v.field for v in details.field_violations))
            )
        assert len(seen) == 1, seen
        ((code, reason, message, fields),) = seen
        assert (code, reason, fields) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            ErrorReason.ADAPTER_PATH_REFUSED,
            ("path",),
        )
        assert "not inside the server's adapter folder" in message
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as exc:
            c.load_adapter("x", "fifo")  # a FIFO would hang a plain open
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a regular file" in str(exc.value.details()) and time.monotonic() - started < 10
        assert _tokens(c, "shared")  # the engine serves on
        assert [a.name for a in c.list_adapters()] == ["shared"]  # refused loads hold no slot


def test_run_time_loads_are_refused_without_an_adapter_dir(model: Path, folders: dict[str, Path]) -> None:
    s = start_tiny_server(model, "--lora", f"shared={folders['shared']}")
    try:
        with s.client() as c:
            for path in ("mine", str(folders["mine"]), "../x"):
                with pytest.raises(grpc.RpcError) as exc:
                    c.load_adapter("x", path)
                assert _code(exc) == (grpc.StatusCode.FAILED_PRECONDITION, ErrorReason.ADAPTER_LOADING_OFF)
            assert _tokens(c, "shared")  # --lora at start is as it was
    finally:
        assert s.stop() == 0


def test_tenants_see_their_own_adapters_and_the_shared_ones(
    model: Path, root: Path, folders: dict[str, Path], tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    alice, bob = "alice-token-0123456789", "bob-token-9876543210xx"
    tokens.write_text(f"alice {alice}\nbob {bob}\n")
    s = start_tiny_server(
        model,
        *("--auth-tokens-file", str(tokens), "--lora", f"shared={folders['shared']}"),
        *("--adapter-dir", str(root), "--max-adapters-per-tenant", "1", "--restart-backoff-seconds", "0.1"),
    )
    try:
        with Client(s.target, token=alice) as a, Client(s.target, token=bob) as b:
            info = a.load_adapter("mine", "mine")
            assert [(i.name, i.shared, i.path) for i in a.list_adapters()] == [
                ("mine", False, "mine"),
                ("shared", True, ""),
            ]
            # The engine's name for a tenant's adapter carries a digest of the tenant; no caller sees it.
            assert info.description.startswith("mine: rank")
            assert all("~" not in i.description for i in a.list_adapters())
            with pytest.raises(grpc.RpcError) as exc:
                a.load_adapter("mine", "mine")
            assert exc.value.code() == grpc.StatusCode.ALREADY_EXISTS
            assert "'mine'" in (exc.value.details() or "") and "~" not in (exc.value.details() or "")
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
            # One adapter each (--max-adapters-per-tenant 1): alice's second is refused, bob's first is not.
            with pytest.raises(grpc.RpcError) as exc:
                a.load_adapter("second", "shared-copy")
            assert _code(exc) == (grpc.StatusCode.RESOURCE_EXHAUSTED, ErrorReason.TENANT_ADAPTER_LIMIT)
            assert error_details(exc.value).retry_delay_seconds is not None
            b.load_adapter("mine", "shared-copy")  # bob's own "mine" is another adapter
            assert _tokens(b, "mine") == _tokens(b, "shared") != mine
            assert _tokens(a, "mine") == mine

            # Metric labels go with their adapter: bob's appears once a job of it finished, and
            # leaves when bob unloads it.
            labels = [
                line
                for line in _metrics(s).splitlines()
                if line.startswith("dyngen_adapter_jobs_finished_total")
            ]
            assert len(labels) == 3, labels  # shared, alice's mine, bob's mine
            b.unload_adapter("mine")
            labels = [
                line
                for line in _metrics(s).splitlines()
                if line.startswith("dyngen_adapter_jobs_finished_total")
            ]
            assert len(labels) == 2, labels
            b.load_adapter("mine", "shared-copy")

            # An engine restart loads the callers' adapters again before it serves.
            mark = len(s.logs)
            s.kill_engine()
            s.wait_log("engine_down", after=mark)
            s.wait_serving(timeout=120)
            assert _tokens(a, "mine") == mine  # the first request after SERVING finds it
            assert log_count(s, "adapter_not_reloaded") == 0

            # One that cannot be loaded again is NOT_FOUND, with a log line saying why.
            (folders["shared-copy"] / "adapter_model.safetensors").rename(root / "moved.safetensors")
            mark = len(s.logs)
            s.kill_engine()
            s.wait_log("engine_down", after=mark)
            s.wait_serving(timeout=120)
            record = s.wait_log("adapter_not_reloaded", after=mark)
            assert "mine~" in str(record["adapter"])
            with pytest.raises(grpc.RpcError) as exc:
                _tokens(b, "mine")  # bob's, lost: not silently another adapter of the name
            assert _code(exc) == (grpc.StatusCode.NOT_FOUND, ErrorReason.ADAPTER_NOT_FOUND)
            assert "after the engine restarted" in str(exc.value.details())
            assert _tokens(a, "mine") == mine  # alice's came back
            (root / "moved.safetensors").rename(folders["shared-copy"] / "adapter_model.safetensors")
            b.load_adapter("mine", "shared-copy")  # loaded again, it serves again
            assert _tokens(b, "mine") == _tokens(b, "shared")
    finally:
        assert s.stop() == 0
