"""The INT4 groups on the GPU: a Triton matmul that dequantizes 4-bit weights inside its K loop.

The groups (kernels.linear.int4_groups: w = scale * q + offset per 32 inputs, GGUF's Q4_0/Q4_1)
are held on the device as packed nibbles, two inputs per byte, and float16 scale and offset
per group (kernels.linear.triton_q4_kernels has the layout): 0.625 bytes per weight, against 2
for bfloat16. Each call reads them once and accumulates in float32.

Float16 scale and offset are exact for a file's blocks (GGUF stores d and m as float16, and
Q4_0's offset -8 d is d scaled by a power of two) and for Int4Groups.quantize, which rounds
both to float16 as Q4_1 does. Groups from anywhere else would have their float32 scale and
offset rounded to float16 (2^-11 relative); values beyond float16's range are refused.

Triton has no CPU backend: on CPU tensors the kernel only runs under the interpreter
(TRITON_INTERPRET=1 set before the kernels module is first imported, which is at the first
call, not at this module's import), which is how the tests compare it with the dequantized
product. Importing this module needs neither triton nor a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from types import ModuleType

import torch

from kernels.linear.int4_groups import GROUP_SIZE, Int4Groups
from kernels.linear.linear_kind import LinearKind

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Q4Tiles:
    """Tile sizes of the kernel (compile-time constants; powers of two)."""

    block_m: int  # rows of x per program; >= 16 for tl.dot
    block_n: int  # output features per program
    block_k: int  # inputs per K step: a multiple of the group size
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for size in (self.block_m, self.block_n, self.block_k):
            if size < 16 or size & (size - 1):
                raise ValueError(f"tile sizes must be powers of two >= 16, got {self}")
        if self.block_k % GROUP_SIZE:
            raise ValueError(f"block_k must be a multiple of {GROUP_SIZE}, got {self}")


# Decode (a few rows): the weights dominate, so tiles are narrow in M and deep in K, with many
# programs along N. Prefill: wider M tiles reuse each dequantized weight tile across more rows.
DECODE_TILES = Q4Tiles(block_m=16, block_n=64, block_k=128)
PREFILL_TILES = Q4Tiles(block_m=64, block_n=128, block_k=64)
DECODE_MAX_ROWS = 16


def tiles_for(rows: int) -> Q4Tiles:
    return DECODE_TILES if rows <= DECODE_MAX_ROWS else PREFILL_TILES


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] (values 0..15, K even) -> [N, K // 2]: column 2j in the low nibble, 2j + 1 in the high."""
    if q.dtype != torch.uint8 or q.dim() != 2 or q.shape[1] % 2:
        raise ValueError(f"expected uint8 [N, even K], got {q.dtype} {tuple(q.shape)}")
    return (q[:, 0::2] & 0xF) | ((q[:, 1::2] & 0xF) << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_nibbles: uint8 [N, K // 2] -> [N, K]."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


@cache
def _kernels() -> ModuleType:
    # Imported at the first launch: importing decorates the kernel, which reads TRITON_INTERPRET then.
    from kernels.linear import triton_q4_kernels

    return triton_q4_kernels


@cache
def interpreted() -> bool:
    """Whether the kernel was defined under TRITON_INTERPRET (and so runs on CPU tensors)."""
    from triton.runtime import JITFunction

    return not isinstance(_kernels().q4_matmul_kernel, JITFunction)


def q4_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiles: Q4Tiles | None = None,
) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, N] in x's dtype, W [N, K] given as pack_nibbles(q) [N, K // 2]
    and float16 scale, offset [N, K // GROUP_SIZE] (w = scale * q + offset per group)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {tuple(x.shape)}")
    rows, k = (int(d) for d in x.shape)
    n = int(packed.shape[0])
    if k % GROUP_SIZE:
        raise ValueError(f"the Q4 matmul needs K divisible by {GROUP_SIZE}, got {k}")
    if tuple(packed.shape) != (n, k // 2) or packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8 [N, {k // 2}], got {packed.dtype} {tuple(packed.shape)}")
    groups = (n, k // GROUP_SIZE)
    if any(tuple(t.shape) != groups or t.dtype != torch.float16 for t in (scale, offset)):
        raise ValueError(f"scale and offset must be float16 {groups}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"activations must be one of {ACTIVATION_DTYPES}, got {x.dtype}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    if len({t.device for t in (x, packed, scale, offset)}) != 1:
        raise ValueError("x and the weights must be on one device")
    if x.device.type == "cpu" and not interpreted():
        raise RuntimeError(
            "the Triton Q4 matmul on CPU tensors needs TRITON_INTERPRET=1 set before "
            "kernels.linear.triton_q4_kernels is imported"
        )
    # The kernel reads rows through their stride, columns contiguous; scale and offset share strides.
    if x.stride(1) != 1:
        x = x.contiguous()
    packed, scale, offset = packed.contiguous(), scale.contiguous(), offset.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return y
    t = tiles if tiles is not None else tiles_for(rows)
    grid = (-(-rows // t.block_m), -(-n // t.block_n))
    _kernels().q4_matmul_kernel[grid](
        x, packed, scale, offset, bias if bias is not None else y, y,
        rows, n, k, x.stride(0), packed.stride(0), scale.stride(0), y.stride(0),
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, EVEN_K=k % t.block_k == 0,
        HAS_BIAS=bias is not None, UPCAST_DOT=interpreted(),
        num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    return y


def _to_float16(values: torch.Tensor, what: str) -> torch.Tensor:
    half = values.to(torch.float16)
    if not bool(torch.isfinite(half).all()):
        raise ValueError(f"int4 group {what} beyond float16's range")
    return half.contiguous()


class TritonQ4Linear:
    """y = x @ W^T (+ bias) for x [..., in_features] on `device`, W the INT4 groups kept 4-bit."""

    kind = LinearKind.TRITON_Q4

    def __init__(
        self,
        groups: Int4Groups,
        device: torch.device,
        bias: torch.Tensor | None = None,
        from_file: bool = False,
        tiles: Q4Tiles | None = None,
    ) -> None:
        self.out_features, self.in_features = groups.shape
        self.from_file = from_file
        self.device = device
        self.tiles = tiles  # None: chosen per call by the number of rows
        self.packed = pack_nibbles(groups.q).to(device)
        self.scale = _to_float16(groups.scale, "scales").to(device)
        self.offset = _to_float16(groups.offset, "offsets").to(device)
        self.bias = bias.to(device).contiguous() if bias is not None else None

    def describe(self) -> str:
        return "triton_q4[file]" if self.from_file else "triton_q4[requant]"

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.offset))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = q4_matmul(rows, self.packed, self.scale, self.offset, self.bias, self.tiles)
        return y.reshape(*x.shape[:-1], self.out_features)
