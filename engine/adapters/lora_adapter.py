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
names), fan_in_fan_out weights, shapes that do not fit the model, values that are not finite, and
weights the config disagrees with: a module the config does not target (target_modules,
layers_to_transform, exclude_modules, matched as PEFT matches them) or a rank other than its r
(or rank_pattern's), where PEFT would refuse the file or leave the weights out.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import torch
from safetensors import SafetensorError, safe_open

from engine import defaults
from engine.adapters.adapter_folder import CONFIG_FILE, WEIGHTS_FILE, AdapterFolder
from engine.errors import InvalidRequestError
from engine.model.config import ModelConfig

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
class AdapterLimits:
    """Caps checked against the safetensors header before any tensor is read
    (`--max-adapter-rank`, `--max-adapter-bytes`)."""

    max_rank: int = defaults.MAX_ADAPTER_RANK
    max_bytes: int = defaults.MAX_ADAPTER_BYTES

    def __post_init__(self) -> None:
        if self.max_rank < 1 or self.max_bytes < 1:
            raise ValueError(f"adapter limits must be >= 1, got rank {self.max_rank}, bytes {self.max_bytes}")


DEFAULT_ADAPTER_LIMITS = AdapterLimits()


@dataclass(frozen=True)
class LoraDelta:
    """One fused projection's adapter: delta(x) = (x A^T) B^T, the scale already in B."""

    a: torch.Tensor  # float32 [R, in_features]
    b: torch.Tensor  # float32 [out_features, R]
    b_t: torch.Tensor = field(init=False)  # B^T [R, out_features], contiguous: the native row kernel's

    def __post_init__(self) -> None:
        object.__setattr__(self, "b_t", self.b.T.contiguous())

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
    label: str = ""  # how it was named: the relative path of a run-time load (never a server path)

    def delta(self, layer: int, projection: str) -> LoraDelta | None:
        return self.layers[layer].get(projection)

    def weight_bytes(self) -> int:
        return sum(d.a.numel() * 4 + d.b.numel() * 4 for layer in self.layers for d in layer.values())

    def describe(self) -> str:
        ranks = "/".join(str(r) for r in sorted(self.ranks))
        return f"{self.name}: rank {ranks} on {', '.join(sorted(self.targets))}"

    @staticmethod
    def load(
        name: str,
        source: Path | AdapterFolder,
        config: ModelConfig,
        device: torch.device | None = None,
        limits: AdapterLimits = DEFAULT_ADAPTER_LIMITS,
    ) -> LoraAdapter:
        """Read a PEFT adapter folder for `config`'s model, its deltas on `device` (the model's;
        default the CPU). The safetensors header is checked (names, shapes, ranks, bytes against
        `limits`) before any tensor is read. AdapterError (ModelNotFoundError for missing files,
        AdapterPathError for a place outside a confined folder) with the reason if it cannot be
        applied exactly."""
        folder = source if isinstance(source, AdapterFolder) else AdapterFolder.trusted(source)
        raw = folder.read_config()
        try:
            settings = json.loads(raw)
        except ValueError as exc:
            raise AdapterError(f"adapter {name!r}: {CONFIG_FILE} is not valid JSON: {exc}") from exc
        if not isinstance(settings, dict):
            raise AdapterError(f"adapter {name!r}: {CONFIG_FILE} is not a JSON object")
        lora_settings = _check_settings(name, settings)
        try:
            with folder.weights(limits.max_bytes) as weights, safe_open(weights, framework="pt") as f:
                header = {key: f.get_slice(key) for key in f.keys()}  # noqa: SIM118 (not a dict)
                _check_header(
                    name,
                    {k: (tuple(s.get_shape()), s.get_dtype()) for k, s in header.items()},
                    config,
                    limits,
                )
                tensors = {key: f.get_tensor(key) for key in header}
        except SafetensorError as exc:
            raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} is not a safetensors file: {exc}") from exc
        pairs = _pairs(tensors)
        if not pairs:
            raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
        _check_against_config(name, pairs, lora_settings)
        layers = tuple(
            _fuse_layer(name, i, {m: p for (li, m), p in pairs.items() if li == i}, lora_settings, config)
            for i in range(config.num_layers)
        )
        if device is not None and device.type != "cpu":
            layers = tuple(
                {p: LoraDelta(d.a.to(device), d.b.to(device)) for p, d in layer.items()} for layer in layers
            )
        return LoraAdapter(
            name=name,
            path=folder.path,
            uid=next(_ids),
            targets=frozenset(m for _, m in pairs),
            ranks=frozenset(int(a.shape[0]) for a, _ in pairs.values()),
            layers=layers,
            label=folder.label,
        )


@dataclass(frozen=True)
class LoraSettings:
    """What adapter_config.json says about applying the weights, checked and typed."""

    r: int
    alpha: float
    use_rslora: bool
    rank_pattern: Mapping[str, float]  # module-name pattern -> rank (PEFT's get_pattern_key)
    alpha_pattern: Mapping[str, float]
    target_modules: str | tuple[str, ...]  # a regex matched whole (or "all-linear"), or name suffixes
    exclude_modules: str | tuple[str, ...]
    layers_to_transform: tuple[int, ...]  # empty: every layer
    layers_pattern: tuple[str, ...]

    def targets(self, key: str) -> bool:
        """Whether PEFT would put an adapter on the module `key` (model.layers.N.self_attn.q_proj):
        exclude_modules, then target_modules, then layers_to_transform, as
        peft.tuners.tuners_utils.check_target_module_exists reads them."""
        if _names(self.exclude_modules, key):
            return False
        if isinstance(self.target_modules, str):
            return self.target_modules.lower() == "all-linear" or _names(self.target_modules, key)
        if key in self.target_modules:
            return True
        if not _names(self.target_modules, key):
            return False
        if not self.layers_to_transform:
            return True
        match = None
        if not self.layers_pattern:
            match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
        for pattern in self.layers_pattern:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", key)
            if match is not None:
                break
        return match is not None and int(match.group("idx")) in self.layers_to_transform

    def rank(self, key: str) -> int:
        return int(_pattern_value(self.rank_pattern, key) or self.r)

    def scale(self, key: str, rank: int) -> float:
        """PEFT's scaling for one module: its alpha over r, or over sqrt(r) with use_rslora."""
        alpha = _pattern_value(self.alpha_pattern, key) or self.alpha
        return alpha / (math.sqrt(rank) if self.use_rslora else rank)


def _names(names: str | tuple[str, ...], key: str) -> bool:
    """A regex matched against the whole key, or a list of names matched as the key or its end."""
    if isinstance(names, str):
        return re.fullmatch(names, key) is not None
    return any(key == n or key.endswith(f".{n}") for n in names)


def _pattern_value(pattern: Mapping[str, float], key: str) -> float | None:
    """The value of the first pattern that matches the key's end (PEFT's get_pattern_key), else None."""
    for name, value in pattern.items():
        if re.match(rf"(.*\.)?({name})$", key):
            return value
    return None


# The modules PEFT targets on a Llama model when a config names none.
_DEFAULT_TARGETS = ("q_proj", "v_proj")


def _check_settings(name: str, s: dict[str, object]) -> LoraSettings:
    def refuse(why: str) -> NoReturn:
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
    r, alpha = s.get("r"), s.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        refuse(f"r must be a positive whole number, got {r!r}")
    if not _positive_number(alpha):
        refuse(f"lora_alpha must be a positive finite number, got {alpha!r}")

    def pattern(key: str) -> dict[str, float]:
        value = s.get(key) or {}
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and _positive_number(v) for k, v in value.items()
        ):
            refuse(f"{key} must map module names to positive finite numbers, got {str(value)[:120]}")
        return {str(k): float(v) for k, v in value.items()}

    def names(key: str, default: tuple[str, ...]) -> str | tuple[str, ...]:
        value = s.get(key)
        if value is None or value == []:
            return default
        if isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return tuple(str(v) for v in value)
        refuse(f"{key} must be a string or a list of strings, got {str(value)[:120]}")

    layers = s.get("layers_to_transform")
    layer_list = [layers] if isinstance(layers, int) else layers if layers is not None else []
    if not isinstance(layer_list, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in layer_list
    ):
        refuse(f"layers_to_transform must be a layer index or a list of them, got {str(layers)[:120]}")
    layers_pattern = names("layers_pattern", ())
    return LoraSettings(
        r=r,
        alpha=float(alpha),  # type: ignore[arg-type]  # a positive number, checked above
        use_rslora=bool(s.get("use_rslora")),
        rank_pattern=pattern("rank_pattern"),
        alpha_pattern=pattern("alpha_pattern"),
        target_modules=names("target_modules", _DEFAULT_TARGETS),
        exclude_modules=names("exclude_modules", ()),
        layers_to_transform=tuple(int(i) for i in layer_list),
        layers_pattern=(layers_pattern,) if isinstance(layers_pattern, str) else layers_pattern,
    )


def _positive_number(value: object) -> bool:
    return (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )


def _module_key(layer: int, module: str) -> str:
    group = "self_attn" if MODULES[module][0] in ("qkv", "o") else "mlp"
    return f"model.layers.{layer}.{group}.{module}"


def _check_against_config(
    name: str, pairs: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], settings: LoraSettings
) -> None:
    """The weights and the config agree: every module with weights is one the config targets, at
    the config's rank, and every value is finite."""
    for (layer, module), (a, b) in pairs.items():
        key = _module_key(layer, module)
        where = f"adapter {name!r}: layer {layer} {module}"
        if not settings.targets(key):
            raise AdapterError(
                f"{where} has weights, but {CONFIG_FILE} does not target it (target_modules, "
                "layers_to_transform, exclude_modules)"
            )
        if int(a.shape[0]) != settings.rank(key):
            raise AdapterError(
                f"{where} has rank {int(a.shape[0])}, but {CONFIG_FILE} gives it rank {settings.rank(key)}"
            )
        for half, tensor in (("lora_A", a), ("lora_B", b)):
            if not bool(torch.isfinite(tensor).all()):
                raise AdapterError(f"{where}: {half} holds values that are not finite")


# Floating-point dtypes in a safetensors header, with their sizes in bytes.
_FLOAT_BYTES: Mapping[str, int] = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}

Header = Mapping[str, tuple[tuple[int, ...], str]]  # tensor name -> (shape, safetensors dtype)


def _check_header(name: str, header: Header, config: ModelConfig, limits: AdapterLimits) -> None:
    """Every tensor the file declares, checked before one is read: a LoRA weight of a decoder
    layer's projection, A and B in pairs, floating point, shapes that fit the model, ranks and
    bytes within `limits`."""
    sizes = {
        "q_proj": (config.hidden_size, config.q_size),
        "k_proj": (config.hidden_size, config.kv_size),
        "v_proj": (config.hidden_size, config.kv_size),
        "o_proj": (config.q_size, config.hidden_size),
        "gate_proj": (config.hidden_size, config.intermediate_size),
        "up_proj": (config.hidden_size, config.intermediate_size),
        "down_proj": (config.intermediate_size, config.hidden_size),
    }
    halves: dict[tuple[int, str, str], tuple[tuple[int, ...], str]] = {}
    total = 0
    for key, (shape, dtype) in header.items():
        m = _KEY.fullmatch(key)
        if m is None or m.group(3) not in MODULES:
            raise AdapterError(
                f"adapter {name!r}: {key[:120]} is not a LoRA weight of a decoder layer's q/k/v/o/gate/up/down "
                "projection (embedding, head and other modules are not supported)"
            )
        layer = int(m.group(1))
        if layer >= config.num_layers:
            raise AdapterError(
                f"adapter {name!r}: {key} names layer {layer}; the model has {config.num_layers}"
            )
        if dtype not in _FLOAT_BYTES:
            raise AdapterError(f"adapter {name!r}: {key} is {dtype}; weights must be floating point")
        total += math.prod(shape) * _FLOAT_BYTES[dtype]
        halves[(layer, m.group(3), m.group(4))] = (shape, dtype)
    if total > limits.max_bytes:
        raise AdapterError(
            f"adapter {name!r}: its weights are {total} bytes, over the server's limit of {limits.max_bytes} "
            "(--max-adapter-bytes)"
        )
    for layer, module in sorted({(li, mo) for li, mo, _ in halves}):
        a, b = halves.get((layer, module, "A")), halves.get((layer, module, "B"))
        where = f"adapter {name!r}: layer {layer} {module}"
        if a is None or b is None:
            raise AdapterError(f"{where} has lora_{'A' if a is None else 'B'} missing")
        fan_in, fan_out = sizes[module]
        r = a[0][0] if len(a[0]) == 2 else -1
        if len(b[0]) != 2 or a[0] != (r, fan_in) or b[0] != (fan_out, r):
            raise AdapterError(
                f"{where}: lora_A {a[0]} and lora_B {b[0]} do not fit this model "
                f"(expected [r, {fan_in}] and [{fan_out}, r])"
            )
        if r < 1 or r > limits.max_rank:
            raise AdapterError(
                f"{where}: rank {r} is outside 1..{limits.max_rank}, the server's limit (--max-adapter-rank)"
            )


def _pairs(tensors: Mapping[str, torch.Tensor]) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) -> (A, B) as float32, from tensors whose header _check_header passed."""
    halves: dict[tuple[int, str, str], torch.Tensor] = {}
    for key, tensor in tensors.items():
        m = _KEY.fullmatch(key)
        assert m is not None  # checked with the header
        halves[(int(m.group(1)), m.group(3), m.group(4))] = tensor.to(torch.float32)
    return {
        (li, mo): (t, halves[(li, mo, "B")]) for (li, mo, half), t in sorted(halves.items()) if half == "A"
    }


def _fuse_layer(
    name: str,
    layer: int,
    modules: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    settings: LoraSettings,
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
            scale = settings.scale(_module_key(layer, module), r)
            b[row : row + out_sizes[part], col : col + r] = part_b * scale
            col += r
        fused[projection] = LoraDelta(a.contiguous(), b.contiguous())
    return fused
