"""Hugging Face model folders: config.json plus one or more *.safetensors files."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from engine.errors import ModelFormatError, ModelNotFoundError, UnsupportedModelError
from engine.model.config import ModelConfig, RopeScaling, RopeScalingKind
from kernels.linear.int4_groups import Int4Groups

SUPPORTED_MODEL_TYPES = ("llama",)


def _rope_scaling(raw: dict[str, object], where: str) -> RopeScaling:
    # transformers 4.x writes "rope_scaling"; 5.x writes "rope_parameters" (which also holds theta).
    block = raw.get("rope_scaling") or raw.get("rope_parameters")
    if not isinstance(block, dict):
        return RopeScaling()
    kind = block.get("rope_type", block.get("type", "default"))
    if kind in ("default", None):
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(RopeScalingKind.LINEAR, float(block["factor"]))
    if kind == "llama3":
        return RopeScaling(
            RopeScalingKind.LLAMA3,
            float(block["factor"]),
            float(block.get("low_freq_factor", 1.0)),
            float(block.get("high_freq_factor", 4.0)),
            int(block.get("original_max_position_embeddings", 8192)),
        )
    raise UnsupportedModelError(f"{where}: rope scaling {kind!r} is not supported (default, linear, llama3)")


def config_from_hf(raw: dict[str, object], where: str) -> ModelConfig:
    """Build a ModelConfig from the fields of a Hugging Face Llama config.json."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{where}: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if raw.get("mlp_bias"):
        raise UnsupportedModelError(f"{where}: mlp_bias=true is not supported")

    def num(key: str, default: float | None = None) -> float:
        value = raw.get(key, default)
        if not isinstance(value, int | float):
            raise ModelFormatError(f"{where}: config.json lacks a numeric {key}")
        return value

    hidden = int(num("hidden_size"))
    heads = int(num("num_attention_heads"))
    params = raw.get("rope_parameters")
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))  # type: ignore[call-overload]
    bos = raw.get("bos_token_id")
    return ModelConfig(
        vocab_size=int(num("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(num("intermediate_size")),
        num_layers=int(num("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(num("num_key_value_heads", heads)),
        head_dim=int(raw.get("head_dim") or hidden // heads),  # type: ignore[call-overload]
        rms_norm_eps=float(num("rms_norm_eps", 1e-6)),
        rope_theta=float(theta if isinstance(theta, int | float) else num("rope_theta", 10000.0)),
        max_position_embeddings=int(num("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        rope_scaling=_rope_scaling(raw, where),
        bos_token_id=None if bos is None else int(bos),  # type: ignore[call-overload]
        eos_token_ids=eos_ids,
        name=str(raw.get("_name_or_path") or Path(where).name),
    )


class SafetensorsSource:
    """A WeightSource over a Hugging Face folder (config.json + *.safetensors)."""

    def __init__(self, folder: Path) -> None:
        config_path = folder / "config.json"
        if not config_path.is_file():
            raise ModelNotFoundError(f"{folder} has no config.json")
        self._files = sorted(folder.glob("*.safetensors"))
        if not self._files:
            raise ModelNotFoundError(f"{folder} has no *.safetensors files")
        try:
            raw = json.loads(config_path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelFormatError(f"{config_path}: not valid JSON: {exc}") from exc
        self._path = folder
        self._config = config_from_hf(raw, str(folder))

    @property
    def path(self) -> Path:
        return self._path

    @property
    def config(self) -> ModelConfig:
        return self._config

    def tensor_count(self) -> int:
        count = 0
        for file in self._files:
            with safe_open(str(file), framework="pt") as f:
                count += len(list(f.keys()))
        return count

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for file in self._files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    yield name, f.get_tensor(name).to(torch.float32)

    def tensor_map(self) -> Mapping[str, torch.Tensor]:
        return dict(self.tensors())  # float weights, all used

    def stored_int4(self, name: str) -> Int4Groups | None:
        return None  # safetensors folders hold float weights
