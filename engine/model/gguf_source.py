"""GGUF files: config from the metadata, tensors dequantized with the `gguf` package.

`raw_tensor` gives a tensor's blocks as stored instead, and `stored_int4` the 4-bit ones
(Q4_0/Q4_1) as int4 groups, so quantized linears can run the file's own weights.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from engine.errors import ModelFormatError, ModelNotFoundError, UnsupportedModelError
from engine.model.config import ModelConfig, RopeScaling, RopeScalingKind
from engine.model.derived_files import DerivedFiles
from engine.model.gguf_blocks import RawTensor, dequantize_q8_0, int4_groups
from engine.model.weight_source import LazyTensors
from kernels.linear.int4_groups import Int4Groups

SUPPORTED_ARCHITECTURES = ("llama",)

# Plain float types, and every block type the gguf package can dequantize.
_FLOAT_TYPES = {
    gguf.GGMLQuantizationType.F32,
    gguf.GGMLQuantizationType.F16,
    gguf.GGMLQuantizationType.F64,
}
_BLOCK_TYPES = {
    t
    for t in gguf.GGMLQuantizationType
    if t.name
    in {
        "BF16",
        "Q4_0",
        "Q4_1",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "IQ1_S",
        "IQ1_M",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ2_S",
        "IQ3_XXS",
        "IQ3_S",
        "IQ4_NL",
        "IQ4_XS",
        "TQ1_0",
        "TQ2_0",
        "MXFP4",
    }
}
SUPPORTED_TENSOR_TYPES = tuple(sorted(t.name for t in _FLOAT_TYPES | _BLOCK_TYPES))

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def canonical_name(gguf_name: str) -> str | None:
    """Map a GGUF tensor name to its Hugging Face name (None for tensors dyngen ignores)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute_rotary(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo the Q/K row order GGUF converters use for llama (interleaved rotary pairs).

    Within each head the converter stores row pairs (i, i + d/2) next to each other;
    the Hugging Face layout keeps the two halves apart. Works on weights and biases.
    """
    rows = weight.shape[0]
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of the file: its GGUF name and type, its dims (ggml order, fastest first) and
    its bytes as the gguf reader views them (float types as floats, block types as rows of bytes)."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class GGUFIndex:
    """What the source needs from a GGUF header: the scalar metadata and the tensor table.
    Parsing it takes seconds (the metadata holds the whole vocabulary); the index is kept
    between starts (derived_files.py) and the tensors are mapped from the file by offset."""

    metadata: dict[str, int | float | str | bool]
    tensors: tuple[tuple[str, int, tuple[int, ...], int, str, tuple[int, ...]], ...]
    # (name, ggml type, dims, byte offset in the file, numpy dtype, the reader's array shape)

    @staticmethod
    def from_reader(reader: gguf.GGUFReader) -> GGUFIndex:
        metadata: dict[str, int | float | str | bool] = {}
        for key, field in reader.fields.items():
            if field.types and field.types[0] is not gguf.GGUFValueType.ARRAY:
                value = field.contents()
                if isinstance(value, int | float | str | bool):
                    metadata[key] = value
        tensors = tuple(
            (
                t.name,
                int(t.tensor_type),
                tuple(int(d) for d in t.shape),
                int(t.data_offset),
                t.data.dtype.str,
                tuple(int(d) for d in t.data.shape),
            )
            for t in reader.tensors
        )
        return GGUFIndex(metadata, tensors)

    def to_json(self) -> str:
        return json.dumps({"metadata": self.metadata, "tensors": self.tensors})

    @staticmethod
    def from_json(text: str) -> GGUFIndex:
        data = json.loads(text)
        tensors = tuple(
            (str(n), int(ty), tuple(int(d) for d in dims), int(off), str(dt), tuple(int(d) for d in shape))
            for n, ty, dims, off, dt, shape in data["tensors"]
        )
        return GGUFIndex(dict(data["metadata"]), tensors)

    def map_tensors(self, path: Path) -> list[StoredTensor]:
        """The tensors viewed in place from a read-only map of the file (what the reader does)."""
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
        out = []
        for name, ty, dims, offset, dtype, shape in self.tensors:
            item = np.dtype(dtype)
            count = int(np.prod(shape)) * item.itemsize
            if offset + count > mapped.size:
                raise ModelFormatError(f"{path.name}: tensor {name} lies past the end of the file")
            data = mapped[offset : offset + count].view(item).reshape(shape)
            out.append(StoredTensor(name, gguf.GGMLQuantizationType(ty), dims, data))
        return out


def _read_only_bytes(data: np.ndarray) -> torch.Tensor:
    """The file's mapped bytes as a uint8 tensor, not copied: the blocks are only ever read (packed
    into the kernels' layouts), and a copy of every quantized tensor cost ~0.2 s of each start."""
    flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable buffer": it is never written
        return torch.from_numpy(flat)


class GGUFSource:
    """A WeightSource over one .gguf file.

    `derived`: where the header's index is kept between starts (read if it is there and
    readable, written after a parse otherwise); None parses the header every time."""

    def __init__(self, path: Path, derived: DerivedFiles | None = None) -> None:
        if not path.is_file():
            raise ModelNotFoundError(f"model file not found: {path}")
        self._path = path
        index = None if derived is None else self._cached_index(derived.gguf_index)
        if index is None:
            try:
                reader = gguf.GGUFReader(str(path))
                index = GGUFIndex.from_reader(reader)
            except Exception as exc:  # the reader raises bare ValueErrors/struct errors on junk
                raise ModelFormatError(f"{path} is not a readable GGUF file: {exc}") from exc
            if derived is not None:
                derived.publish_file(derived.gguf_index, index.to_json())
        self._metadata = index.metadata
        self._tensors = index.map_tensors(path)
        self._config = self._read_config()
        self._by_name = {n: t for t in self._tensors if (n := canonical_name(t.name)) is not None}
        for t in self._tensors:
            if canonical_name(t.name) is not None and t.tensor_type not in _FLOAT_TYPES | _BLOCK_TYPES:
                raise UnsupportedModelError(
                    f"{path.name}: tensor {t.name} has quant type {t.tensor_type.name}, which dyngen cannot "
                    f"load; supported: {', '.join(SUPPORTED_TENSOR_TYPES)}"
                )

    @staticmethod
    def _cached_index(index_file: Path) -> GGUFIndex | None:
        try:
            return GGUFIndex.from_json(index_file.read_text())
        except (OSError, ValueError, KeyError, TypeError):
            return None  # absent or damaged: parse the file again

    @property
    def path(self) -> Path:
        return self._path

    @property
    def config(self) -> ModelConfig:
        return self._config

    def _field(self, key: str) -> object:
        return self._metadata.get(key)

    def _required(self, key: str) -> object:
        value = self._field(key)
        if value is None:
            raise ModelFormatError(f"{self._path.name}: GGUF metadata lacks {key}")
        return value

    def _number(self, key: str) -> int | float | None:
        value = self._field(key)
        if value is None:
            return None
        if not isinstance(value, int | float):
            raise ModelFormatError(f"{self._path.name}: GGUF metadata {key} is not a number: {value!r}")
        return value

    def _int(self, key: str, default: int | None = None) -> int:
        value = self._number(key)
        if value is None:
            if default is None:
                raise ModelFormatError(f"{self._path.name}: GGUF metadata lacks {key}")
            return default
        return int(value)

    def _float(self, key: str, default: float) -> float:
        value = self._number(key)
        return default if value is None else float(value)

    def _read_config(self) -> ModelConfig:
        arch = str(self._required("general.architecture"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{self._path.name}: architecture {arch!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        hidden = self._int(f"{arch}.embedding_length")
        heads = self._int(f"{arch}.attention.head_count")
        names = {t.name for t in self._tensors}
        embd = next((t for t in self._tensors if t.name == "token_embd.weight"), None)
        if embd is None:
            raise ModelFormatError(f"{self._path.name}: no token_embd.weight tensor")
        vocab = self._int(f"{arch}.vocab_size", int(embd.shape[-1]))
        head_dim = self._int(f"{arch}.attention.key_length", hidden // heads)
        scaling = RopeScaling()
        kind = self._field(f"{arch}.rope.scaling.type")
        if kind == "linear":
            scaling = RopeScaling(RopeScalingKind.LINEAR, self._float(f"{arch}.rope.scaling.factor", 1.0))
        elif kind not in (None, "none"):
            raise UnsupportedModelError(f"{self._path.name}: rope scaling {kind!r} is not supported")
        eos = self._number("tokenizer.ggml.eos_token_id")
        bos = self._number("tokenizer.ggml.bos_token_id")
        return ModelConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=self._int(f"{arch}.feed_forward_length"),
            num_layers=self._int(f"{arch}.block_count"),
            num_heads=heads,
            num_kv_heads=self._int(f"{arch}.attention.head_count_kv", heads),
            head_dim=head_dim,
            rms_norm_eps=self._float(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=self._float(f"{arch}.rope.freq_base", 10000.0),
            max_position_embeddings=self._int(f"{arch}.context_length", 4096),
            tie_word_embeddings="output.weight" not in names,
            rope_scaling=scaling,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=() if eos is None else (int(eos),),
            name=str(self._field("general.name") or self._path.stem),
        )

    def tensor_count(self) -> int:
        return sum(1 for t in self._tensors if canonical_name(t.name) is not None)

    def _unpermute(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Hugging Face row order for Q and K (whole rows: blocks never straddle rows)."""
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            return unpermute_rotary(tensor, self._config.num_heads)
        if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            return unpermute_rotary(tensor, self._config.num_kv_heads)
        return tensor

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self._by_name:
            yield name, self.tensor(name)

    def tensor_map(self) -> Mapping[str, torch.Tensor]:
        return LazyTensors(list(self._by_name), self.tensor)

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor (by its Hugging Face name) as float32, dequantized from its blocks."""
        t = self._by_name[name]
        # ggml lists dims fastest first; torch wants them slowest first.
        shape = tuple(int(d) for d in reversed(t.shape))
        if t.tensor_type is gguf.GGMLQuantizationType.Q8_0:
            return self._unpermute(name, dequantize_q8_0(torch.from_numpy(np.array(t.data)), shape))
        if t.tensor_type in _FLOAT_TYPES:
            # The file is mapped read-only; copy so torch owns writable memory.
            array = np.array(t.data, dtype=np.float32)
        else:
            array = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        tensor = torch.from_numpy(np.ascontiguousarray(array).reshape(shape))
        return self._unpermute(name, tensor)

    def raw_tensor(self, name: str) -> RawTensor | None:
        """The stored blocks of a quantized tensor (by its Hugging Face name); None for float ones."""
        t = self._by_name.get(name)
        if t is None or t.tensor_type in _FLOAT_TYPES:
            return None
        shape = tuple(int(d) for d in reversed(t.shape))
        rows = int(np.prod(shape[:-1]))
        data = _read_only_bytes(t.data).reshape(rows, -1)
        return RawTensor(gguf.GGMLQuantizationType(t.tensor_type), shape, self._unpermute(name, data))

    def stored_int4(self, name: str) -> Int4Groups | None:
        raw = self.raw_tensor(name)
        return None if raw is None else int4_groups(raw)
