"""Tiny random-weight Llama models written as .gguf files, in any of the common tensor types.

The weights are made in the Hugging Face layout (``model.layers.0.self_attn.q_proj.weight``,
float32), then written the way llama.cpp's converter writes them: GGUF tensor names, Q and K
rows permuted into interleaved rotary pairs, 2-D weights in the chosen type, norms in F32,
and enough tokenizer metadata (a byte-level BPE vocabulary) for transformers to load the file.

The gguf package quantizes F32, F16, BF16, Q8_0, Q4_0 and Q4_1 itself; it can only
dequantize the K-quants, so Q4_K and Q6_K blocks are packed here (a plain round-to-nearest
quantizer, not llama.cpp's search for the best scales, but the same block layout).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from numpy.typing import NDArray

QType = gguf.GGMLQuantizationType
F32Array = NDArray[np.float32]

QK_K = 256  # values per K-quant super-block

# Tensor names: Hugging Face -> GGUF.
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}

_FILE_TYPES = {
    "F32": gguf.LlamaFileType.ALL_F32,
    "F16": gguf.LlamaFileType.MOSTLY_F16,
    "BF16": gguf.LlamaFileType.MOSTLY_BF16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K,
}


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Shapes chosen so every row length is a multiple of 256 (the K-quant super-block)."""

    vocab_size: int = 512
    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    context_length: int = 256
    bos_token_id: int = 1
    eos_token_id: int = 2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def random_llama_weights(spec: TinyLlamaSpec, seed: int, tied: bool) -> dict[str, F32Array]:
    """Hugging Face-layout float32 weights; norms near 1 so they matter, projections small."""
    rng = np.random.default_rng(seed)
    h, i, d = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q, kv = spec.num_heads * d, spec.num_kv_heads * d

    def normal(*shape: int, std: float = 0.05) -> F32Array:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm() -> F32Array:
        return (1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32)

    weights: dict[str, F32Array] = {"model.embed_tokens.weight": normal(spec.vocab_size, h)}
    for n in range(spec.num_layers):
        p = f"model.layers.{n}."
        weights[p + "input_layernorm.weight"] = norm()
        weights[p + "self_attn.q_proj.weight"] = normal(q, h)
        weights[p + "self_attn.k_proj.weight"] = normal(kv, h)
        weights[p + "self_attn.v_proj.weight"] = normal(kv, h)
        weights[p + "self_attn.o_proj.weight"] = normal(h, q)
        weights[p + "post_attention_layernorm.weight"] = norm()
        weights[p + "mlp.gate_proj.weight"] = normal(i, h)
        weights[p + "mlp.up_proj.weight"] = normal(i, h)
        weights[p + "mlp.down_proj.weight"] = normal(h, i)
    weights["model.norm.weight"] = norm()
    if not tied:
        weights["lm_head.weight"] = normal(spec.vocab_size, h)
    return weights


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER[module]}.{suffix}"


def permute_rotary(weight: F32Array, n_heads: int) -> F32Array:
    """llama.cpp convert_hf_to_gguf's ``LlamaModel.permute``: interleave each head's rotary halves."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _f16(values: F32Array) -> NDArray[np.float16]:
    return values.astype(np.float16)


def quantize_q4_k(weight: F32Array) -> NDArray[np.uint8]:
    """Q4_K blocks: per 256 values an f16 d and dmin, 8 sub-blocks of 32 with 6-bit scale and min,
    4-bit quants; value = d * scale * q - dmin * min."""
    rows = weight.reshape(-1, QK_K).astype(np.float32)
    nb = rows.shape[0]
    sub = rows.reshape(nb, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0.0)
    hi = np.maximum(sub.max(axis=-1), 0.0)
    scale = (hi - lo) / 15.0  # [nb, 8]
    minimum = -lo
    d = _f16(scale.max(axis=-1) / 63.0).astype(np.float32)  # [nb]
    dmin = _f16(minimum.max(axis=-1) / 63.0).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0.0)
        mn = np.where(dmin[:, None] > 0, np.rint(minimum / dmin[:, None]), 0.0)
        sc = np.clip(sc, 0, 63).astype(np.uint8)
        mn = np.clip(mn, 0, 63).astype(np.uint8)
        step = (d[:, None] * sc)[..., None]
        offset = (dmin[:, None] * mn)[..., None]
        qv = np.where(step > 0, np.rint((sub + offset) / step), 0.0)
    quants = np.clip(qv, 0, 15).astype(np.uint8)  # [nb, 8, 32]
    # 12 scale bytes: low 6 bits of sc[0:4] / mn[0:4], their top 2 bits carry the high bits of
    # sc[4:8] / mn[4:8], whose low nibbles fill bytes 8..11.
    scales = np.empty((nb, 12), dtype=np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (mn[:, 0:4] & 0x3F) | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    # 128 quant bytes: 32-byte chunk c holds sub-block 2c in its low nibbles, 2c + 1 in its high.
    pairs = quants.reshape(nb, 4, 2, 32)
    qs = (pairs[:, :, 0, :] | (pairs[:, :, 1, :] << 4)).reshape(nb, 128)
    blocks = np.concatenate(
        [_f16(d).view(np.uint8).reshape(nb, 2), _f16(dmin).view(np.uint8).reshape(nb, 2), scales, qs], axis=1
    )
    return blocks.reshape(*weight.shape[:-1], weight.shape[-1] // QK_K * 144)


def quantize_q6_k(weight: F32Array) -> NDArray[np.uint8]:
    """Q6_K blocks: per 256 values 16 sub-blocks of 16 with an int8 scale, 6-bit quants
    (stored as 4 low bits + 2 high bits, offset by 32) and one f16 d; value = d * scale * (q - 32)."""
    rows = weight.reshape(-1, QK_K).astype(np.float32)
    nb = rows.shape[0]
    sub = rows.reshape(nb, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31.0  # [nb, 16]
    d = _f16(scale.max(axis=-1) / 127.0).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0.0)
        sc = np.clip(sc, 0, 127).astype(np.int8)
        step = (d[:, None] * sc)[..., None]
        qv = np.where(step > 0, np.rint(sub / step), 0.0)
    quants = (np.clip(qv, -32, 31) + 32).astype(np.uint8).reshape(nb, 2, 4, 32)  # [half, t, i]
    low, high = quants & 0x0F, quants >> 4
    # ql: per half 64 bytes; byte b*32 + i holds t = b in its low nibble and t = 2 + b in its high.
    ql = (low[:, :, 0:2, :] | (low[:, :, 2:4, :] << 4)).reshape(nb, 128)
    # qh: per half 32 bytes; bits 2t..2t+1 of byte i hold the high bits of t.
    qh = np.zeros((nb, 2, 32), dtype=np.uint8)
    for t in range(4):
        qh |= high[:, :, t, :] << (2 * t)
    blocks = np.concatenate(
        [ql, qh.reshape(nb, 64), sc.view(np.uint8), _f16(d).view(np.uint8).reshape(nb, 2)], axis=1
    )
    return blocks.reshape(*weight.shape[:-1], weight.shape[-1] // QK_K * 210)


def encode(weight: F32Array, qtype: QType) -> tuple[NDArray[np.generic], QType | None]:
    """The array to hand GGUFWriter.add_tensor for `weight` stored as `qtype`, and its raw_dtype."""
    if qtype == QType.F32:
        return weight.astype(np.float32), None
    if qtype == QType.F16:
        return weight.astype(np.float16), None
    if qtype == QType.Q4_K:
        return quantize_q4_k(weight), qtype
    if qtype == QType.Q6_K:
        return quantize_q6_k(weight), qtype
    if qtype in (QType.BF16, QType.Q8_0, QType.Q4_0, QType.Q4_1):
        return gguf.quants.quantize(weight, qtype), qtype
    # A type nothing here can make: well-formed zero blocks (a loader has to refuse it by type).
    return np.zeros(gguf.quants.quant_shape_to_byte_shape(weight.shape, qtype), dtype=np.uint8), qtype


def stored_values(weight: F32Array, qtype: QType) -> F32Array:
    """What a correct reader gets back for `weight` stored as `qtype` (HF layout, float32).

    Every block lies inside one row, so quantizing the permuted rows and un-permuting gives
    the same values as quantizing the rows in place: the Q/K permutation needs no special case.
    """
    data, _ = encode(weight, qtype)
    values = gguf.quants.dequantize(data, qtype)
    return np.asarray(values, dtype=np.float32).reshape(weight.shape)


def _byte_level_vocab(spec: TinyLlamaSpec) -> tuple[list[str], list[int], list[str]]:
    """Special tokens, the 256 byte tokens, then two-letter merges up to vocab_size."""
    spelling = [chr(c) for c in _bytes_to_unicode()]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # as SmolLM2 numbers them
    tokens = specials + spelling
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    merges: list[str] = []
    for a in letters:
        for b in letters:
            if len(tokens) == spec.vocab_size:
                break
            merges.append(f"{a} {b}")
            tokens.append(a + b)
    types = [int(gguf.TokenType.CONTROL)] * len(specials)
    types += [int(gguf.TokenType.NORMAL)] * (len(tokens) - len(specials))
    return tokens, types, merges


def _bytes_to_unicode() -> list[int]:
    """GPT-2's byte -> printable code point table, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table: dict[int, int] = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = 256 + extra
            extra += 1
    return [table[b] for b in range(256)]


def write_tiny_gguf(
    path: Path,
    weights: Mapping[str, F32Array],
    spec: TinyLlamaSpec,
    qtype: QType,
    arch: str = "llama",
    overrides: Mapping[str, QType] | None = None,
) -> None:
    """Write `weights` (HF layout) to `path` as llama.cpp would, 2-D tensors in `qtype`.

    `overrides` maps a GGUF tensor name to another type for that tensor alone.
    """
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_name(f"tiny-llama-{qtype.name.lower()}")
    writer.add_file_type(int(_FILE_TYPES.get(qtype.name, gguf.LlamaFileType.ALL_F32)))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_feed_forward_length(spec.intermediate_size)
    writer.add_block_count(spec.num_layers)
    writer.add_head_count(spec.num_heads)
    writer.add_head_count_kv(spec.num_kv_heads)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_layer_norm_rms_eps(spec.rms_norm_eps)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_vocab_size(spec.vocab_size)
    tokens, types, merges = _byte_level_vocab(spec)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(spec.bos_token_id)
    writer.add_eos_token_id(spec.eos_token_id)
    writer.add_add_bos_token(False)
    for hf_name, original in weights.items():
        name = gguf_name(hf_name)
        weight = original
        if ".q_proj." in hf_name:
            weight = permute_rotary(original, spec.num_heads)
        elif ".k_proj." in hf_name:
            weight = permute_rotary(original, spec.num_kv_heads)
        # As real files do, 1-D tensors (the norms) stay F32 whatever the file's type.
        kind = QType.F32 if weight.ndim == 1 else qtype
        kind = (overrides or {}).get(name, kind)
        data, raw_dtype = encode(weight, kind)
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
