"""A GGUF tensor's quantized blocks as stored, and the 4-bit ones as kernel int4 groups.

Blocks run along a row (the input dimension), so whole rows of blocks can be reordered
(the Q/K rotary un-permutation) without touching a block.

    Q4_0 block (18 bytes): f16 d, 16 bytes of nibbles;          w = d * (q - 8)
    Q4_1 block (20 bytes): f16 d, f16 m, 16 bytes of nibbles;   w = d * q + m
Byte j holds value j in its low nibble and value j + 16 in its high nibble.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import torch

from kernels.linear.int4_groups import GROUP_SIZE, Int4Groups

QType = gguf.GGMLQuantizationType
INT4_TYPES = (QType.Q4_0, QType.Q4_1)


@dataclass(frozen=True)
class RawTensor:
    """One tensor's bytes as the file stores them, rows in the Hugging Face order."""

    qtype: QType
    shape: tuple[int, ...]  # the values' shape, slowest dimension first ([out, in] for a weight)
    data: torch.Tensor  # uint8 [out, bytes per row]


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    return blocks[..., at : at + 2].contiguous().view(torch.float16)[..., 0].to(torch.float32)


def int4_groups(raw: RawTensor) -> Int4Groups | None:
    """The groups of a Q4_0/Q4_1 weight, exactly the file's values; None for other types."""
    if raw.qtype not in INT4_TYPES or len(raw.shape) != 2:
        return None
    block_size, type_size = gguf.GGML_QUANT_SIZES[raw.qtype]
    assert block_size == GROUP_SIZE
    out, inp = raw.shape
    blocks = raw.data.reshape(out, inp // GROUP_SIZE, type_size)
    scale = _f16(blocks, 0)
    if raw.qtype == QType.Q4_1:
        offset, header = _f16(blocks, 2), 4
    else:
        offset, header = -8 * scale, 2
    nibbles = blocks[..., header:]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(out, inp)
    return Int4Groups(q.contiguous(), scale.contiguous(), offset.contiguous())


def dequantize_q8_0(data: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A Q8_0 tensor's values (block: f16 d, 32 int8 q; w = d * q) as float32 [*shape], the
    same products the gguf package computes, in torch: ~10x faster than its numpy path, which
    took 0.36 s for the shipped model's embedding table at every start."""
    type_size = gguf.GGML_QUANT_SIZES[QType.Q8_0][1]
    blocks = data.reshape(-1, type_size)
    q = blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return (_f16(blocks, 0)[:, None] * q).reshape(shape)
