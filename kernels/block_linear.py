"""Linears over 32-value weight blocks with 8-bit activation blocks, on the native CPU kernels.

Each call quantizes its input rows per block of 32 (x ~= s * q, q in -127..127; one scale
per 32 values, so an outlier costs only its own block, unlike one scale per tensor) and
multiplies them with the weight blocks in integer arithmetic (kernels/csrc/cpu_kernels.c):

- INT4_Q8: 4-bit weight groups, w = d * q + m (GGUF Q4_0/Q4_1 blocks kept exactly as
  stored, other weights re-quantized by group min/max);
- INT8_Q8: 8-bit weight blocks, w = d * q (GGUF Q8_0's scheme; a Q8_0 weight re-quantized
  from its dequantized values gets its own blocks back).

The weight's scales are kept in float32 beside their block's bytes: one stream through
memory per output row.
"""

from __future__ import annotations

import torch

from kernels.int4_groups import GROUP_SIZE, Int4Groups
from kernels.linear import LinearKind
from kernels.native_library import BLOCK, NativeLibrary

assert BLOCK == GROUP_SIZE


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """float32 [n, nb] -> uint8 [n, nb, 4], the values' bytes."""
    return t.to(torch.float32).contiguous().view(torch.uint8).view(*t.shape, 4)


def pack_q4(groups: Int4Groups, lib: NativeLibrary) -> torch.Tensor:
    """uint8 [n, k / 32, 24]: per block d, m (float32) and 16 bytes of nibbles (value j low, j + 16 high)."""
    n, k = groups.shape
    q = groups.q.view(n, k // BLOCK, BLOCK)
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    blocks = torch.cat([_as_bytes(groups.scale), _as_bytes(groups.offset), nibbles], dim=-1).contiguous()
    if tuple(blocks.shape) != (n, k // BLOCK, lib.block_q4_bytes):
        raise ValueError(
            f"q4 blocks {tuple(blocks.shape)} do not fit the library's {lib.block_q4_bytes}-byte block"
        )
    return blocks


def quantize_q8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-block quantization: d = max |w| / 127 per 32 values, q = round(w / d)."""
    n, k = (int(s) for s in weight.shape)
    w = weight.to(torch.float32).reshape(n, k // BLOCK, BLOCK)
    d = w.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(w * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, d


def pack_q8(q: torch.Tensor, d: torch.Tensor, lib: NativeLibrary) -> torch.Tensor:
    """uint8 [n, k / 32, 36]: per block d (float32) and 32 int8 values."""
    blocks = torch.cat([_as_bytes(d), q.view(torch.uint8)], dim=-1).contiguous()
    if blocks.shape[-1] != lib.block_q8_bytes:
        raise ValueError(
            f"q8 blocks {tuple(blocks.shape)} do not fit the library's {lib.block_q8_bytes}-byte block"
        )
    return blocks


class _BlockLinear:
    kind: LinearKind

    def __init__(
        self, lib: NativeLibrary, blocks: torch.Tensor, n: int, k: int, bias: torch.Tensor | None
    ) -> None:
        if k % BLOCK:
            raise ValueError(f"block linears need in_features divisible by {BLOCK}, got {k}")
        self._lib = lib
        self._blocks = blocks
        self.out_features = n
        self.in_features = k
        self.bias = bias

    def weight_bytes(self) -> int:
        return self._blocks.numel()

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.to(torch.float32).contiguous()
        y = self._matmul(rows)
        if self.bias is not None:
            y.add_(self.bias)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


class Int4BlockLinear(_BlockLinear):
    kind = LinearKind.INT4_Q8

    def __init__(
        self,
        lib: NativeLibrary,
        groups: Int4Groups,
        bias: torch.Tensor | None = None,
        from_file: bool = False,
    ) -> None:
        n, k = groups.shape
        super().__init__(lib, pack_q4(groups, lib), n, k, bias)
        self.from_file = from_file

    def describe(self) -> str:
        return "int4_q8[file]" if self.from_file else "int4_q8[requant]"

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return self._lib.matmul_q4(
            self._blocks, self.out_features, self.in_features, self._lib.quantize_rows(rows)
        )


class Int8BlockLinear(_BlockLinear):
    kind = LinearKind.INT8_Q8

    def __init__(self, lib: NativeLibrary, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        n, k = (int(s) for s in weight.shape)
        q, d = quantize_q8_blocks(weight)
        super().__init__(lib, pack_q8(q, d, lib), n, k, bias)

    def describe(self) -> str:
        return "int8_q8"

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return self._lib.matmul_q8(
            self._blocks, self.out_features, self.in_features, self._lib.quantize_rows(rows)
        )
