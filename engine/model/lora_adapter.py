"""A LoRA adapter in the PEFT format, read for one model: per decoder layer and fused projection,
the down (A) and up (B) matrices whose product, scaled, is added to the projection's output.

PEFT saves `adapter_config.json` (rank r, lora_alpha, target_modules, use_rslora, ...) and
`adapter_model.safetensors` with `base_model.model.model.layers.N.{self_attn,mlp}.P.lora_{A,B}.weight`:
A is [r, in_features], B [out_features, r], and the layer computes W x + scale * B (A x) with
scale = alpha / r (alpha / sqrt(r) under rsLoRA; alpha and r per module where alpha_pattern /
rank_pattern say so). The model fuses q/k/v and gate/up into one linear each, so their adapters
are fused the same way: the parts' A stacked (one [sum r, in] matrix) and B block-diagonal over
the output rows of each part, the scale folded into B. A part without an adapter contributes
nothing (its rows of B are zero).

Everything this engine cannot apply exactly is refused at load with the reason: DoRA, trained
biases, modules_to_save, other module names (embeddings, the head, another architecture's
names), fan_in_fan_out weights, shapes that do not fit the model.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from engine.errors import InvalidRequestError, ModelNotFoundError
from engine.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# PEFT module name -> (the model's fused projection, the part's index in it)
MODULES: Mapping[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
PROJECTIONS = ("qkv", "o", "gate_up", "down")
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
_ids = itertools.count(1)


class AdapterError(InvalidRequestError):
    """An adapter this engine cannot load (the message says why)."""


@dataclass(frozen=True)
class LoraDelta:
    """One fused projection's adapter: delta(x) = (x A^T) B^T, the scale already in B."""

    a: torch.Tensor  # float32 [R, in_features]
    b: torch.Tensor  # float32 [out_features, R]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The delta for rows x [n, in_features], float32 [n, out_features]."""
        return (x.to(torch.float32) @ self.a.T) @ self.b.T


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """A loaded adapter; compared by identity (each load is a new adapter, with a new uid)."""

    name: str
    path: Path
    uid: int  # unique in this process: the prefix cache keeps each load's pages apart
    targets: frozenset[str]  # the PEFT module names it adapts
    ranks: frozenset[int]
    layers: tuple[Mapping[str, LoraDelta], ...]  # per decoder layer: fused projection -> delta

    def delta(self, layer: int, projection: str) -> LoraDelta | None:
        return self.layers[layer].get(projection)

    def weight_bytes(self) -> int:
        return sum(d.a.numel() * 4 + d.b.numel() * 4 for layer in self.layers for d in layer.values())

    def describe(self) -> str:
        ranks = "/".join(str(r) for r in sorted(self.ranks))
        return f"{self.name}: rank {ranks} on {', '.join(sorted(self.targets))}"

    @staticmethod
    def load(name: str, path: Path, config: ModelConfig, device: torch.device | None = None) -> LoraAdapter:
        """Read a PEFT adapter folder for `config`'s model, its deltas on `device` (the model's;
        default the CPU); AdapterError (or ModelNotFoundError for a missing folder) with the reason
        if it cannot be applied exactly."""
        if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
            raise ModelNotFoundError(f"adapter {name!r}: {path} holds no {CONFIG_FILE} and {WEIGHTS_FILE}")
        try:
            settings = json.loads((path / CONFIG_FILE).read_text())
        except (OSError, ValueError) as exc:
            raise AdapterError(f"adapter {name!r}: unreadable {CONFIG_FILE}: {exc}") from exc
        if not isinstance(settings, dict):
            raise AdapterError(f"adapter {name!r}: {CONFIG_FILE} is not a JSON object")
        _check_settings(name, settings)
        try:
            tensors = load_file(str(path / WEIGHTS_FILE))
        except (OSError, SafetensorError) as exc:
            raise AdapterError(f"adapter {name!r}: unreadable {WEIGHTS_FILE}: {exc}") from exc
        pairs = _pairs(name, tensors, config)
        if not pairs:
            raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
        layers = tuple(
            _fuse_layer(name, i, {m: p for (li, m), p in pairs.items() if li == i}, settings, config)
            for i in range(config.num_layers)
        )
        if device is not None and device.type != "cpu":
            layers = tuple(
                {p: LoraDelta(d.a.to(device), d.b.to(device)) for p, d in layer.items()} for layer in layers
            )
        return LoraAdapter(
            name=name,
            path=path,
            uid=next(_ids),
            targets=frozenset(m for _, m in pairs),
            ranks=frozenset(int(a.shape[0]) for a, _ in pairs.values()),
            layers=layers,
        )


def _check_settings(name: str, s: dict[str, object]) -> None:
    def refuse(why: str) -> None:
        raise AdapterError(f"adapter {name!r}: {why}")

    if s.get("peft_type", "LORA") != "LORA":
        refuse(f"peft_type {s.get('peft_type')!r} is not LORA")
    if s.get("use_dora"):
        refuse("DoRA (use_dora) is not supported")
    if s.get("bias", "none") != "none" or s.get("lora_bias"):
        refuse("trained biases (bias / lora_bias) are not supported")
    if s.get("modules_to_save"):
        refuse("modules_to_save (fully trained modules) are not supported")
    if s.get("fan_in_fan_out"):
        refuse("fan_in_fan_out weights (Conv1D models) do not fit a Llama model")
    if s.get("layer_replication") or s.get("target_parameters"):
        refuse("layer_replication and target_parameters are not supported")
    for key in ("r", "lora_alpha"):
        value = s.get(key)
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            refuse(f"{key} must be a positive number, got {value!r}")


def _pairs(
    name: str, tensors: Mapping[str, torch.Tensor], config: ModelConfig
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) -> (A, B), each checked against the model's shapes."""
    halves: dict[tuple[int, str, str], torch.Tensor] = {}
    for key, tensor in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None or m.group(3) not in MODULES:
            raise AdapterError(
                f"adapter {name!r}: {key} is not a LoRA weight of a decoder layer's q/k/v/o/gate/up/down "
                "projection (embedding, head and other modules are not supported)"
            )
        layer = int(m.group(1))
        if layer >= config.num_layers:
            raise AdapterError(
                f"adapter {name!r}: {key} names layer {layer}; the model has {config.num_layers}"
            )
        halves[(layer, m.group(3), m.group(4))] = tensor
    sizes = {
        "q_proj": (config.hidden_size, config.q_size),
        "k_proj": (config.hidden_size, config.kv_size),
        "v_proj": (config.hidden_size, config.kv_size),
        "o_proj": (config.q_size, config.hidden_size),
        "gate_proj": (config.hidden_size, config.intermediate_size),
        "up_proj": (config.hidden_size, config.intermediate_size),
        "down_proj": (config.intermediate_size, config.hidden_size),
    }
    out: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for layer, module in sorted({(li, mo) for li, mo, _ in halves}):
        a, b = halves.get((layer, module, "A")), halves.get((layer, module, "B"))
        where = f"adapter {name!r}: layer {layer} {module}"
        if a is None or b is None:
            raise AdapterError(f"{where} has lora_{'A' if a is None else 'B'} missing")
        fan_in, fan_out = sizes[module]
        r = int(a.shape[0]) if a.dim() == 2 else -1
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (r, fan_in) or tuple(b.shape) != (fan_out, r):
            raise AdapterError(
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit this model "
                f"(expected [r, {fan_in}] and [{fan_out}, r])"
            )
        if not (a.is_floating_point() and b.is_floating_point()):
            raise AdapterError(f"{where}: weights must be floating point")
        out[(layer, module)] = (a.to(torch.float32), b.to(torch.float32))
    return out


def _scale(settings: Mapping[str, object], module_name: str, rank: int) -> float:
    """PEFT's scaling for one module: its alpha (alpha_pattern's first matching key, else
    lora_alpha) over r, or over sqrt(r) with use_rslora."""
    alpha = float(settings["lora_alpha"])  # type: ignore[arg-type]
    pattern = settings.get("alpha_pattern") or {}
    if isinstance(pattern, dict):
        for key, value in pattern.items():
            if re.match(rf"(.*\.)?({key})$", module_name):
                alpha = float(value)
                break
    return alpha / (math.sqrt(rank) if settings.get("use_rslora") else rank)


def _fuse_layer(
    name: str,
    layer: int,
    modules: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    settings: Mapping[str, object],
    config: ModelConfig,
) -> Mapping[str, LoraDelta]:
    parts_out = {
        "qkv": (config.q_size, config.kv_size, config.kv_size),
        "o": (config.hidden_size,),
        "gate_up": (config.intermediate_size, config.intermediate_size),
        "down": (config.hidden_size,),
    }
    fused: dict[str, LoraDelta] = {}
    for projection in PROJECTIONS:
        present = sorted(
            ((MODULES[m][1], m) for m in modules if MODULES[m][0] == projection), key=lambda p: p[0]
        )
        if not present:
            continue
        out_sizes = parts_out[projection]
        total_rank = sum(int(modules[m][0].shape[0]) for _, m in present)
        a = torch.cat([modules[m][0] for _, m in present])
        b = torch.zeros(sum(out_sizes), total_rank)
        col = 0
        for part, module in present:
            part_a, part_b = modules[module]
            r = int(part_a.shape[0])
            row = sum(out_sizes[:part])
            group = "self_attn" if projection in ("qkv", "o") else "mlp"
            scale = _scale(settings, f"model.layers.{layer}.{group}.{module}", r)
            b[row : row + out_sizes[part], col : col + r] = part_b * scale
            col += r
        fused[projection] = LoraDelta(a.contiguous(), b.contiguous())
    return fused
