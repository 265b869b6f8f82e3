"""GGUF files: config from the metadata, tensors dequantized with the `gguf` package.

`raw_tensor` gives a tensor's blocks as stored instead, and `stored_int4` the 4-bit ones
(Q4_0/Q4_1) as int4 groups, so quantized linears can run the file's own weights.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch

from engine.errors import ModelFormatError, ModelNotFoundError, UnsupportedModelError
from engine.model.config import ModelConfig, RopeScaling, RopeScalingKind
from engine.model.gguf_blocks import RawTensor, int4_groups
from kernels.int4_groups import Int4Groups

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


class GGUFSource:
    """A WeightSource over one .gguf file."""

    def __init__(self, path: Path) -> None:
        if not path.is_file():
            raise ModelNotFoundError(f"model file not found: {path}")
        try:
            self._reader = gguf.GGUFReader(str(path))
        except Exception as exc:  # the reader raises bare ValueErrors/struct errors on junk
            raise ModelFormatError(f"{path} is not a readable GGUF file: {exc}") from exc
        self._path = path
        self._config = self._read_config()
        self._by_name = {n: t for t in self._reader.tensors if (n := canonical_name(t.name)) is not None}
        for t in self._reader.tensors:
            if canonical_name(t.name) is not None and t.tensor_type not in _FLOAT_TYPES | _BLOCK_TYPES:
                raise UnsupportedModelError(
                    f"{path.name}: tensor {t.name} has quant type {t.tensor_type.name}, which dyngen cannot "
                    f"load; supported: {', '.join(SUPPORTED_TENSOR_TYPES)}"
                )

    @property
    def path(self) -> Path:
        return self._path

    @property
    def config(self) -> ModelConfig:
        return self._config

    def _field(self, key: str) -> object:
        f = self._reader.fields.get(key)
        return None if f is None else f.contents()

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
        names = {t.name for t in self._reader.tensors}
        embd = next((t for t in self._reader.tensors if t.name == "token_embd.weight"), None)
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
        return sum(1 for t in self._reader.tensors if canonical_name(t.name) is not None)

    def _unpermute(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Hugging Face row order for Q and K (whole rows: blocks never straddle rows)."""
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            return unpermute_rotary(tensor, self._config.num_heads)
        if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            return unpermute_rotary(tensor, self._config.num_kv_heads)
        return tensor

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._by_name.items():
            if t.tensor_type in _FLOAT_TYPES:
                # The reader maps the file read-only; copy so torch owns writable memory.
                array = np.array(t.data, dtype=np.float32)
            else:
                array = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            # ggml lists dims fastest first; torch wants them slowest first.
            shape = tuple(int(d) for d in reversed(t.shape))
            tensor = torch.from_numpy(np.ascontiguousarray(array).reshape(shape))
            yield name, self._unpermute(name, tensor)

    def raw_tensor(self, name: str) -> RawTensor | None:
        """The stored blocks of a quantized tensor (by its Hugging Face name); None for float ones."""
        t = self._by_name.get(name)
        if t is None or t.tensor_type in _FLOAT_TYPES:
            return None
        shape = tuple(int(d) for d in reversed(t.shape))
        rows = int(np.prod(shape[:-1]))
        data = torch.from_numpy(np.array(t.data, dtype=np.uint8).reshape(rows, -1))
        return RawTensor(gguf.GGMLQuantizationType(t.tensor_type), shape, self._unpermute(name, data))

    def stored_int4(self, name: str) -> Int4Groups | None:
        raw = self.raw_tensor(name)
        return None if raw is None else int4_groups(raw)
