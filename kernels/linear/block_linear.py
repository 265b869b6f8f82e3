"""Linears over 32-value weight blocks with 8-bit activation blocks, on the native CPU kernels.

Each call quantizes its input rows per block of 32 (x ~= s * q, q in -127..127; one scale
per 32 values, so an outlier costs only its own block, unlike one scale per tensor) and
multiplies them with the weight blocks in integer arithmetic (kernels/native/csrc/cpu_kernels.c):

- INT4_Q8: 4-bit weight groups, w = d * q + m (GGUF Q4_0/Q4_1 blocks kept exactly as
  stored, other weights re-quantized by group min/max);
- INT8_Q8: 8-bit weight blocks, w = d * q (GGUF Q8_0's scheme; a Q8_0 weight re-quantized
  from its dequantized values gets its own blocks back).

The weight's scales are kept beside their block's bytes: one stream through memory. Where out_features is a multiple of 8, 8 output rows are interleaved per block
(pack_q4x8, pack_q8x8): each SIMD lane accumulates one output row, so a broadcast of 4
activation bytes feeds 8 rows, a weight load feeds up to 4 input rows, and results are
stored without horizontal sums. Else one output row's blocks follow each other (pack_q4, pack_q8).
"""

from __future__ import annotations

from typing import Self

import torch

from kernels.linear.int4_groups import GROUP_SIZE, Int4Groups
from kernels.linear.linear_kind import LinearKind
from kernels.native.native_library import BLOCK, BlockLayout, LinearDesc, NativeLibrary

assert BLOCK == GROUP_SIZE


def _half_bytes(t: torch.Tensor) -> torch.Tensor:
    """float32 [..., 8] -> uint8 [..., 16]: the values as float16, which must hold them exactly."""
    h = t.to(torch.float16)
    if not torch.equal(h.to(torch.float32), t.to(torch.float32)):
        raise ValueError("8-row blocks store scales as float16; these scales are not float16 values")
    return h.contiguous().view(torch.uint8).view(*t.shape[:-1], 2 * t.shape[-1])


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


def pack_q4x8(groups: Int4Groups, lib: NativeLibrary) -> torch.Tensor:
    """uint8 [n / 8, k / 32, 160]: per 8 output rows and block, their d and m (float16, as the file's
    blocks and Int4Groups.quantize have them; ValueError otherwise), then 4 chunks of 32 bytes;
    chunk c holds for row i inputs 4c..4c+3 (low nibbles) and 4c+16..4c+19 (high)."""
    n, k = groups.shape
    if n % 8:
        raise ValueError(f"8-row q4 blocks need out_features divisible by 8, got {n}")
    g, nb = n // 8, k // BLOCK
    # [g, 8 rows, nb, 2 halves, 4 chunks, 4 inputs] -> [g, nb, half, chunk, row, input]
    q = groups.q.view(g, 8, nb, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(g, nb, 128)

    def per_block(t: torch.Tensor) -> torch.Tensor:  # [n, nb] -> [g, nb, 8 rows] as float16 bytes
        return _half_bytes(t.reshape(g, 8, nb).transpose(1, 2))

    blocks = torch.cat([per_block(groups.scale), per_block(groups.offset), qs], dim=-1).contiguous()
    if blocks.shape[-1] != lib.block_q4x8_bytes:
        raise ValueError(
            f"q4x8 blocks {tuple(blocks.shape)} do not fit the library's {lib.block_q4x8_bytes}-byte block"
        )
    return blocks


def quantize_q8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-block quantization: d = max |w| / 127 per 32 values (rounded to float16, as
    GGUF's Q8_0 stores it), q = round(w / d)."""
    n, k = (int(s) for s in weight.shape)
    w = weight.to(torch.float32).reshape(n, k // BLOCK, BLOCK)
    d = (w.abs().amax(-1) / 127).to(torch.float16).to(torch.float32)
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


def pack_q8x8(q: torch.Tensor, d: torch.Tensor, lib: NativeLibrary) -> torch.Tensor:
    """uint8 [n / 8, k / 32, 272]: per 8 output rows and block, their d (float16, as
    quantize_q8_blocks rounds it), then 8 chunks of 32 bytes; chunk c holds for row i inputs 4c..4c+3."""
    n, k = int(q.shape[0]), q.numel() // int(q.shape[0])  # q: [n, k] or [n, k / 32, 32]
    if n % 8:
        raise ValueError(f"8-row q8 blocks need out_features divisible by 8, got {n}")
    g, nb = n // 8, k // BLOCK
    qs = q.view(torch.uint8).view(g, 8, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(g, nb, 256)
    ds = _half_bytes(d.reshape(g, 8, nb).transpose(1, 2))
    blocks = torch.cat([ds, qs], dim=-1).contiguous()
    if blocks.shape[-1] != lib.block_q8x8_bytes:
        raise ValueError(
            f"q8x8 blocks {tuple(blocks.shape)} do not fit the library's {lib.block_q8x8_bytes}-byte block"
        )
    return blocks


def packed_shape(layout: BlockLayout, n: int, k: int, lib: NativeLibrary) -> tuple[int, int, int] | None:
    """The uint8 shape of `layout`'s blocks for an [n, k] weight (None: the layout cannot hold it)."""
    nb = k // BLOCK
    if layout in (BlockLayout.Q4X8, BlockLayout.Q8X8) and n % 8:
        return None
    match layout:
        case BlockLayout.Q4:
            return (n, nb, lib.block_q4_bytes)
        case BlockLayout.Q8:
            return (n, nb, lib.block_q8_bytes)
        case BlockLayout.Q4X8:
            return (n // 8, nb, lib.block_q4x8_bytes)
        case BlockLayout.Q8X8:
            return (n // 8, nb, lib.block_q8x8_bytes)


def _checked(
    lib: NativeLibrary, packed: tuple[BlockLayout, torch.Tensor], shape: tuple[int, int]
) -> torch.Tensor:
    """Bytes from outside this process reach the kernels only in the exact shape they read."""
    layout, blocks = packed
    want = packed_shape(layout, shape[0], shape[1], lib)
    if (
        want is None
        or blocks.dtype != torch.uint8
        or tuple(blocks.shape) != want
        or not blocks.is_contiguous()
    ):
        raise ValueError(f"packed {layout.name} blocks {tuple(blocks.shape)} do not fit a {shape} weight")
    return blocks


class BlockLinear:
    kind: LinearKind

    def __init__(
        self,
        lib: NativeLibrary,
        blocks: torch.Tensor,
        layout: BlockLayout,
        n: int,
        k: int,
        bias: torch.Tensor | None,
    ) -> None:
        if k % BLOCK:
            raise ValueError(f"block linears need in_features divisible by {BLOCK}, got {k}")
        self._lib = lib
        self._blocks = blocks
        self._layout = layout
        self.out_features = n
        self.in_features = k
        self.bias = bias

    @classmethod
    def from_packed(
        cls,
        lib: NativeLibrary,
        packed: tuple[BlockLayout, torch.Tensor],
        shape: tuple[int, int],
        bias: torch.Tensor | None,
    ) -> Self:
        """The linear over bytes an earlier one packed (its `packed`), used as they are;
        ValueError if they are not the shape the layout has for `shape`."""
        self = cls.__new__(cls)
        BlockLinear.__init__(self, lib, _checked(lib, packed, shape), packed[0], shape[0], shape[1], bias)
        return self

    @property
    def packed(self) -> tuple[BlockLayout, torch.Tensor]:
        """The weight bytes as the kernels read them, and their layout: what a later start can map
        back in (engine.model.packed_store) instead of packing the file's blocks again."""
        return self._layout, self._blocks

    def weight_bytes(self) -> int:
        return self._blocks.numel()

    def native_desc(self) -> LinearDesc | None:
        """This linear for the native decoder layer; None with a bias (the layer has no bias add)."""
        if self.bias is not None:
            return None
        return LinearDesc(self._layout.value, self._blocks.data_ptr(), self.out_features, self.in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype is torch.float32 and x.is_contiguous():  # a forward's rows: no reshaping
            out = self._lib.linear(self._layout, self._blocks, self.out_features, self.in_features, x)
            return out if self.bias is None else out.add_(self.bias)
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.to(torch.float32).contiguous()
        y = self._lib.linear(self._layout, self._blocks, self.out_features, self.in_features, rows)
        if self.bias is not None:
            y.add_(self.bias)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def silu_call(self, gate_up: torch.Tensor) -> torch.Tensor:
        """self(silu(gate) * up) for gate_up float32 [rows, 2 * in_features], without the
        activations in memory (the native kernel quantizes each row as it makes it)."""
        if gate_up.dim() != 2 or gate_up.shape[1] != 2 * self.in_features:
            raise ValueError(f"gate_up must be [rows, {2 * self.in_features}], got {tuple(gate_up.shape)}")
        out = self._lib.linear_silu(
            self._layout, self._blocks, self.out_features, self.in_features, gate_up.contiguous()
        )
        return out if self.bias is None else out.add_(self.bias)


class Int4BlockLinear(BlockLinear):
    kind = LinearKind.INT4_Q8
    from_file = False  # the file's own 4-bit blocks, not re-quantized

    def __init__(
        self,
        lib: NativeLibrary,
        groups: Int4Groups,
        bias: torch.Tensor | None = None,
        from_file: bool = False,
    ) -> None:
        n, k = groups.shape
        # 8-row interleaved blocks where the rows allow (every shape of the Llama family does):
        # faster at every batch size (2.2x the row-major kernel at 64 rows, 2x at one).
        try:
            blocks, layout = pack_q4x8(groups, lib), BlockLayout.Q4X8
        except ValueError:  # rows not in 8s, or scales beyond float16
            blocks, layout = pack_q4(groups, lib), BlockLayout.Q4
        super().__init__(lib, blocks, layout, n, k, bias)
        self.from_file = from_file

    def describe(self) -> str:
        return "int4_q8[file]" if self.from_file else "int4_q8[requant]"


class Int8BlockLinear(BlockLinear):
    kind = LinearKind.INT8_Q8

    def __init__(self, lib: NativeLibrary, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        n, k = (int(s) for s in weight.shape)
        q, d = quantize_q8_blocks(weight)
        try:
            blocks, layout = pack_q8x8(q, d, lib), BlockLayout.Q8X8
        except ValueError:  # rows not in 8s
            blocks, layout = pack_q8(q, d, lib), BlockLayout.Q8
        super().__init__(lib, blocks, layout, n, k, bias)

    def describe(self) -> str:
        return "int8_q8"
