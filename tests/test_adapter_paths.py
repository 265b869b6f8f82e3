"""Run-time adapter loads read only inside the operator's adapter folder, and a file is checked
before it is read: `..`, absolute paths and symlinks out are refused the same whether or not
anything is there; a FIFO, a huge file, a file that is not safetensors, a rank or a size past
the caps are refused without reading tensors (and without blocking on the FIFO)."""

from __future__ import annotations

import os
import struct
import threading
from pathlib import Path

import pytest

from benchmarks.inprocess.lora_throughput import write_adapter
from engine.adapters.adapter_folder import AdapterFolder, AdapterPathError, check_relative_path
from engine.adapters.adapter_registry import AdapterRegistry
from engine.adapters.lora_adapter import AdapterError, AdapterLimits, LoraAdapter
from engine.errors import FailedPreconditionError, InvalidRequestError, ModelNotFoundError
from engine.model.config import ModelConfig

CONFIG = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=128,
    tie_word_embeddings=True,
)
EVERY = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """The operator's adapter folder with one good adapter, beside a secret folder outside it."""
    folder = tmp_path / "adapters"
    write_adapter(folder / "good", CONFIG, 4, EVERY, range(CONFIG.num_layers), 1)
    write_adapter(tmp_path / "secret", CONFIG, 4, EVERY, range(CONFIG.num_layers), 2)
    return folder


def _refusal(root: Path, relative: str) -> str:
    """The message of a load's refusal, with the path as given replaced by P."""
    with pytest.raises(AdapterPathError) as exc:
        LoraAdapter.load("x", AdapterFolder.confined(root, relative), CONFIG)
    return str(exc.value).replace(repr(relative[:80]), "P")


def test_a_name_inside_loads(root: Path) -> None:
    adapter = LoraAdapter.load("good", AdapterFolder.confined(root, "good"), CONFIG)
    assert adapter.label == "good" and adapter.ranks == frozenset({4})
    (root / "nested").mkdir()
    write_adapter(root / "nested" / "deep", CONFIG, 2, ["q_proj"], range(1), 3)
    assert LoraAdapter.load("d", AdapterFolder.confined(root, "nested/deep"), CONFIG).ranks == {2}
    os.symlink(root / "good", root / "alias")  # a link that stays inside is fine
    assert LoraAdapter.load("a", AdapterFolder.confined(root, "alias"), CONFIG).label == "alias"


def test_outside_paths_are_refused_alike_whether_or_not_they_exist(root: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    missing = tmp_path / "no-such-folder"
    os.symlink(secret, root / "link-out")
    os.symlink(missing, root / "link-nowhere")
    os.symlink("../secret", root / "relative-link-out")
    inside_then_out = root / "inner"
    inside_then_out.mkdir()
    os.symlink(secret / "adapter_config.json", inside_then_out / "adapter_config.json")
    (inside_then_out / "adapter_model.safetensors").write_bytes(
        (root / "good" / "adapter_model.safetensors").read_bytes()
    )
    messages = {
        _refusal(root, path)
        for path in (
            "../secret",
            "../no-such-folder",
            "good/../../secret",
            str(secret),
            str(missing),
            "/etc",
            "/no/such/place",
            "link-out",
            "link-nowhere",
            "relative-link-out",
            "inner",  # the folder is inside; one of its files links out
        )
    }
    assert len(messages) == 1, messages  # one message for all: nothing about what lies outside
    (message,) = messages
    assert "not inside the server's adapter folder" in message
    for bad in ("", "a\x00b", "a\\..\\b", "x" * 600):
        with pytest.raises(AdapterPathError):
            check_relative_path(bad)


def test_missing_inside_is_not_found(root: Path) -> None:
    with pytest.raises(ModelNotFoundError):
        LoraAdapter.load("x", AdapterFolder.confined(root, "absent"), CONFIG)


def test_a_fifo_is_refused_without_blocking(root: Path) -> None:
    folder = root / "fifo"
    folder.mkdir()
    (folder / "adapter_config.json").write_bytes((root / "good" / "adapter_config.json").read_bytes())
    os.mkfifo(folder / "adapter_model.safetensors")
    errors: list[BaseException] = []

    def load() -> None:
        try:
            LoraAdapter.load("x", AdapterFolder.confined(root, "fifo"), CONFIG)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=load, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "opening a FIFO blocked the load"
    assert len(errors) == 1 and isinstance(errors[0], InvalidRequestError)
    assert "not a regular file" in str(errors[0])
    os.unlink(folder / "adapter_model.safetensors")
    os.mkfifo(folder / "adapter_model.safetensors")
    os.replace(folder / "adapter_model.safetensors", folder / "adapter_config.json")  # config a FIFO too
    with pytest.raises(InvalidRequestError, match="not a regular file"):
        LoraAdapter.load("x", AdapterFolder.confined(root, "fifo"), CONFIG)


def test_a_huge_file_is_refused_from_its_size(root: Path) -> None:
    folder = root / "huge"
    folder.mkdir()
    (folder / "adapter_config.json").write_bytes((root / "good" / "adapter_config.json").read_bytes())
    with open(folder / "adapter_model.safetensors", "wb") as f:
        f.truncate(64 << 30)  # sparse: 64 GiB that take no disk and must never be read
    with pytest.raises(InvalidRequestError, match="over the server's limit"):
        LoraAdapter.load("x", AdapterFolder.confined(root, "huge"), CONFIG)


def test_a_file_that_is_not_safetensors_is_refused(root: Path) -> None:
    folder = root / "text"
    folder.mkdir()
    (folder / "adapter_config.json").write_bytes((root / "good" / "adapter_config.json").read_bytes())
    for content in (b"not a safetensors file at all", struct.pack("<Q", 1 << 40) + b"{}", b""):
        (folder / "adapter_model.safetensors").write_bytes(content)
        with pytest.raises(AdapterError, match="not a safetensors file"):
            LoraAdapter.load("x", AdapterFolder.confined(root, "text"), CONFIG)
    (folder / "adapter_model.safetensors").write_bytes(
        (root / "good" / "adapter_model.safetensors").read_bytes()
    )
    (folder / "adapter_config.json").write_bytes(b"\xff\xfe not json")
    with pytest.raises(AdapterError, match="not valid JSON"):
        LoraAdapter.load("x", AdapterFolder.confined(root, "text"), CONFIG)


def test_caps_are_checked_from_the_header(root: Path) -> None:
    folder = AdapterFolder.confined(root, "good")
    with pytest.raises(AdapterError, match=r"rank 4 is outside 1\.\.2"):
        LoraAdapter.load("x", folder, CONFIG, limits=AdapterLimits(max_rank=2))
    size = (root / "good" / "adapter_model.safetensors").stat().st_size
    with pytest.raises(InvalidRequestError, match="--max-adapter-bytes"):
        LoraAdapter.load("x", folder, CONFIG, limits=AdapterLimits(max_bytes=size - 1))
    assert LoraAdapter.load("x", folder, CONFIG, limits=AdapterLimits(max_rank=4, max_bytes=size)).ranks == {
        4
    }


def test_the_registry_refuses_run_time_loads_without_a_folder(root: Path) -> None:
    closed = AdapterRegistry(CONFIG, 4)
    with pytest.raises(FailedPreconditionError, match="--adapter-dir"):
        closed.confined("good")
    registry = AdapterRegistry(CONFIG, 1, root=root)
    registry.reserve("a")
    with pytest.raises(Exception, match="--max-adapters"):
        registry.reserve("b")  # the slot of a load in flight counts
    registry.install(registry.read("a", registry.confined("good")))
    assert [a.name for a in registry.adapters()] == ["a"]
    registry.remove("a")
    registry.reserve("b")
    registry.release("b")  # a failed read gives its slot back
    registry.reserve("c")
