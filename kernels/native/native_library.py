"""dyngen's native CPU kernels (kernels/native/csrc/cpu_kernels.c), built once per machine, called by ctypes.

torch has no CPU matmul over 4-bit weight blocks with 8-bit activation blocks (its int4
kernel computes in bfloat16, which AVX2-only CPUs emulate), and eager torch spends more
time dispatching a layer's small ops than computing them at one token per step. These
kernels are plain C with AVX2 intrinsics (VNNI dot products where the CPU has them, a
scalar path elsewhere), compiled with `-march=native` for the CPU at hand (or for the instruction
set DYNGEN_CPU_ISA caps it to, kernels/isa.py) and cached by
source, compiler and CPU flags, so a second start loads the shared object directly.

No compiler, or a failed build, leaves the library unavailable (`native_library()` is
None, the reason in `native_unavailable_reason()`); the quantized linears that need it
are then not offered, and the model keeps the torch kernels.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.cache_dir import default_cache_dir
from kernels.cpu_features import cpu_features

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.c"


@functools.cache
def source_digest() -> str:
    """The kernels' source, digested: what is timed or packed for one source is not reused for another."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11")
# The float K/V caches the native attention reads, and their element codes (DG_KV_* in the source).
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK = 32
# The tile paths dg_set_amx switches (DG_TILES_* in the source).
TILES_ATTENTION = 1
TILES_LINEARS = 2
SIMD_NAMES = {0: "scalar", 1: "avx2", 2: "avx2+avx_vnni", 3: "avx2+avx512_vnni", 4: "avx512_vnni"}

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float


class NativeBuildError(RuntimeError):
    pass


def cache_kind(dtype: torch.dtype) -> int:
    """The kernels' code for a float K/V cache's element type."""
    return CACHE_DTYPES.index(dtype)


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _build(compiler: str, march: str, target: Path) -> None:
    """Compile into `target` atomically: concurrent first starts each build, one file wins."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run(
            [compiler, *FLAGS, f"-march={march}", str(SOURCE), "-o", str(out), "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if proc.returncode != 0:
            raise NativeBuildError(f"{compiler} failed: {proc.stderr.strip()[-2000:]}")
        out.replace(target)


def library_path(compiler: str, march: str) -> Path:
    """Where the build for this source, compiler, target and CPU lives."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    cpu = cpu_features()
    key = "\n".join(
        [SOURCE.read_text(), " ".join(FLAGS), march, version, cpu.model_name, " ".join(sorted(cpu.flags))]
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return default_cache_dir() / "native" / f"cpu_kernels-{digest}.so"


# Pointer checks run for every argument of every call (hundreds per decode step), so they are
# the cheap ones: dtype and contiguity. The device is not checked: only CPU models (whose
# tensors are all on the CPU) use this library.
def _f32(t: torch.Tensor) -> int:
    if t.dtype is not torch.float32 or not t.is_contiguous():
        raise ValueError(f"native kernels take contiguous float32 tensors, got {t.dtype} {tuple(t.stride())}")
    return int(t.data_ptr())


def _ptr(t: torch.Tensor) -> int:
    if not t.is_contiguous():
        raise ValueError(f"native kernels take contiguous tensors, got strides {tuple(t.stride())}")
    return int(t.data_ptr())


class LinearDesc(ctypes.Structure):
    """A block linear as the native decoder layer takes it (dg_linear_desc)."""

    _fields_ = [
        ("layout", ctypes.c_int32),
        ("blocks", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
    ]


class BlockLayout(enum.Enum):
    """How a block linear's weight bytes are laid out (the kernels' `layout` argument)."""

    Q4 = 0  # block_q4 per output row, rows one after another
    Q8 = 1
    Q4X8 = 2  # block_q4x8: 8 output rows interleaved per block
    Q8X8 = 3


@dataclass(frozen=True)
class PeakRates:
    """Operations per second of the build's widest instructions on every thread, measured with
    the operands in registers (0: not in this build): int8 products (2 ops each), float32 FMA
    (2 flops), bfloat16 pair dot products (2 flops per product)."""

    int8_ops: float
    float32_flops: float
    bf16_flops: float


@dataclass(frozen=True)
class DecodeStep:
    """What every layer of one decode step shares; tensors contiguous, int64 or float32, on the CPU."""

    rows: int  # new tokens: one per sequence, or a chunk's tokens one after another (row_seq)
    positions: torch.Tensor  # [rows]
    slots: torch.Tensor  # [rows]: page * page_size + offset of each new K/V
    page_tables: torch.Tensor  # [sequences, max_pages]
    seq_lens: torch.Tensor  # [rows]: the keys each row sees, itself included (its position + 1)
    cos: torch.Tensor  # rotary tables [positions, head_dim]
    sin_signed: torch.Tensor
    heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    eps: float
    attn_scale: float
    row_seq: torch.Tensor | None = None  # [rows]: each row's sequence (None: row i is sequence i)


@dataclass(frozen=True)
class DecodeLayer:
    """One decoder layer's weights and K/V cache, for a LayerStack."""

    qkv: LinearDesc
    o: LinearDesc
    gate_up: LinearDesc
    down: LinearDesc
    ffn_norm: torch.Tensor
    next_norm: torch.Tensor | None  # the next layer's attention norm (None: the last layer)
    k_cache: torch.Tensor  # [pages, kv_heads, page_size, head_dim] float32, float16, bfloat16 or int8
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None = None  # an int8 cache's float16 scales [pages, kv_heads, page_size]
    v_scale: torch.Tensor | None = None


class LayerRef(ctypes.Structure):
    """One layer's own pointers for `NativeLibrary.decode_layers` (dg_layer_ref)."""

    _fields_ = [
        ("qkv", ctypes.POINTER(LinearDesc)),
        ("o", ctypes.POINTER(LinearDesc)),
        ("gate_up", ctypes.POINTER(LinearDesc)),
        ("down", ctypes.POINTER(LinearDesc)),
        ("ffn_norm", ctypes.c_void_p),
        ("next_norm", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("k_scale", ctypes.c_void_p),
        ("v_scale", ctypes.c_void_p),
    ]


KV_INT8 = 3  # dg_decode_layers' code for an int8 cache with float16 scales (DG_KV_I8)


def _stack_cache_kind(layer: DecodeLayer) -> int:
    if layer.k_scale is None or layer.v_scale is None:
        return cache_kind(layer.k_cache.dtype)
    if layer.k_cache.dtype is not torch.int8 or layer.k_scale.dtype is not torch.float16:
        raise ValueError("a decode layer's quantized cache is int8 with float16 scales")
    return KV_INT8


class LayerStack:
    """A model's decode layers as one array for `NativeLibrary.decode_layers`. It holds the layers,
    so that what the array points at (their descriptors, norms and caches) lives as long as it."""

    def __init__(self, layers: Sequence[DecodeLayer]) -> None:
        if not layers:
            raise ValueError("a layer stack needs at least one layer")
        kinds = {_stack_cache_kind(layer) for layer in layers}
        if len(kinds) != 1:
            raise ValueError("a layer stack's caches must share one element type")
        self.layers = tuple(layers)
        self.kv_kind = kinds.pop()
        refs = (LayerRef * len(self.layers))()
        for ref, layer in zip(refs, self.layers, strict=True):
            for name in ("ffn_norm", "k_cache", "v_cache", "k_scale", "v_scale"):
                tensor = getattr(layer, name)
                if tensor is None:  # the scales of a float cache
                    continue
                if not tensor.is_contiguous():
                    raise ValueError(f"a decode layer's {name} must be contiguous")
                setattr(ref, name, tensor.data_ptr())
            ref.next_norm = layer.next_norm.data_ptr() if layer.next_norm is not None else None
            ref.qkv, ref.o = ctypes.pointer(layer.qkv), ctypes.pointer(layer.o)
            ref.gate_up, ref.down = ctypes.pointer(layer.gate_up), ctypes.pointer(layer.down)
        self.refs = refs

    def __len__(self) -> int:
        return len(self.layers)


@dataclass(frozen=True)
class QuantizedRows:
    """Activations quantized per row and block of 32: x ~= s * q, with s * sum(q) per block."""

    q: torch.Tensor  # int8 [rows, k]
    s: torch.Tensor  # float32 [rows, k / 32]
    ssum: torch.Tensor  # float32 [rows, k / 32]

    @property
    def rows(self) -> int:
        return int(self.q.shape[0])


class NativeLibrary:
    """Typed wrappers over the shared object; arguments are checked, then passed as pointers."""

    def __init__(self, path: Path) -> None:
        self.path = path
        lib = ctypes.CDLL(str(path))
        lib.dg_quantize_q8.argtypes = [_P, _I, _I, _P, _P, _P]
        lib.dg_quantize_q8.restype = None
        lib.dg_matmul_q4.argtypes = [_P, _I, _I, _P, _P, _P, _I, _P]
        lib.dg_matmul_q4.restype = None
        lib.dg_matmul_q8.argtypes = [_P, _I, _I, _P, _P, _I, _P]
        lib.dg_matmul_q8.restype = None
        lib.dg_matmul_q4x8.argtypes = [_P, _I, _I, _P, _P, _P, _I, _P]
        lib.dg_matmul_q4x8.restype = None
        lib.dg_matmul_q8x8.argtypes = [_P, _I, _I, _P, _P, _I, _P]
        lib.dg_matmul_q8x8.restype = None
        lib.dg_set_amx.argtypes = [ctypes.c_int, ctypes.c_int]
        lib.dg_set_amx.restype = ctypes.c_int
        lib.dg_tile_linear_calls.argtypes = []
        lib.dg_tile_linear_calls.restype = ctypes.c_int64
        lib.dg_shared_attention_tasks.argtypes = []
        lib.dg_shared_attention_tasks.restype = ctypes.c_int64
        lib.dg_amx_attends.argtypes = [_I, _I, _I, _I]
        lib.dg_amx_attends.restype = ctypes.c_int
        lib.dg_linear.argtypes = [ctypes.c_int, _P, _I, _I, _P, _I, _P]
        lib.dg_linear.restype = ctypes.c_int
        lib.dg_linear_silu.argtypes = [ctypes.c_int, _P, _I, _I, _P, _I, _P]
        lib.dg_linear_silu.restype = ctypes.c_int
        # x, h, layers, n_layers, eps, cos, sin, positions, kv_kind, slots, page_tables, max_pages,
        # row_seq, seq_lens, B, H, KVH, D, page_size, attn_scale
        lib.dg_decode_layers.argtypes = [_P, _P, _P, _I, _F, _P, _P, _P, ctypes.c_int, _P, _P, _I, _P, _P]
        lib.dg_decode_layers.argtypes += [_I, _I, _I, _I, _I, _F]
        lib.dg_decode_layers.restype = ctypes.c_int
        lib.dg_add_rms_norm.argtypes = [_P, _P, _P, _P, _I, _I, _F]
        lib.dg_add_rms_norm.restype = None
        lib.dg_rotary.argtypes = [_P, _I, _I, _I, _I, _P, _P, _P]
        lib.dg_rotary.restype = None
        lib.dg_silu_mul.argtypes = [_P, _I, _I, _P]
        lib.dg_lora_rows.argtypes = [_P, _I, _I, _I, _P, _I, _P, _I, _P, _I]
        lib.dg_lora_rows.restype = None
        lib.dg_argmax_rows.argtypes = [_P, _I, _I, _P]
        lib.dg_inverse_cdf.argtypes = [_P, _I, _I, _P, _P]
        lib.dg_inverse_cdf.restype = None
        lib.dg_top_mass.argtypes = [_P, _I, _I, _P, _I, _P, _P]
        lib.dg_top_mass.restype = None
        lib.dg_top_p_rows.argtypes = [_P, _P, _I, _I, _P]
        lib.dg_top_p_rows.restype = ctypes.c_int
        lib.dg_peak.argtypes = [ctypes.c_int, _I]
        lib.dg_peak.restype = ctypes.c_double
        lib.dg_argmax_rows.restype = None
        lib.dg_silu_mul.restype = None
        lib.dg_decode_attention.argtypes = [
            _P,
            _I,
            _P,
            _P,
            _P,
            _P,
            ctypes.c_int,
            ctypes.c_int,
            _P,
            _I,
            _P,
            _P,
            _I,
            _I,
            _I,
            _I,
            _I,
            _F,
            _P,
        ]
        lib.dg_decode_attention.restype = None
        lib.dg_to_half_array.argtypes = [_P, _I, _P]
        lib.dg_to_half_array.restype = None
        lib.dg_to_bf16_array.argtypes = [_P, _I, _P]
        lib.dg_to_bf16_array.restype = None
        self._lib = lib
        self.block_q4_bytes = int(lib.dg_block_q4_size())
        self.block_q8_bytes = int(lib.dg_block_q8_size())
        self.block_q4x8_bytes = int(lib.dg_block_q4x8_size())
        self.block_q8x8_bytes = int(lib.dg_block_q8x8_size())
        self.simd = SIMD_NAMES.get(int(lib.dg_simd()), "unknown")

    def quantize_rows(self, x: torch.Tensor) -> QuantizedRows:
        """x float32 [rows, k], k a multiple of 32."""
        rows, k = (int(d) for d in x.shape)
        if k % BLOCK:
            raise ValueError(f"quantize_rows: k must be a multiple of {BLOCK}, got {k}")
        q = torch.empty((rows, k), dtype=torch.int8)
        s = torch.empty((rows, k // BLOCK), dtype=torch.float32)
        ssum = torch.empty_like(s)
        self._lib.dg_quantize_q8(_f32(x), rows, k, _ptr(q), _f32(s), _f32(ssum))
        return QuantizedRows(q, s, ssum)

    def matmul_q4(self, blocks: torch.Tensor, n: int, k: int, x: QuantizedRows) -> torch.Tensor:
        """[rows, n] float32 from q4 blocks (uint8 [n, k / 32, block_q4_bytes], checked when packed)."""
        assert x.q.shape[1] == k
        y = torch.empty((x.rows, n), dtype=torch.float32)
        self._lib.dg_matmul_q4(_ptr(blocks), n, k, _ptr(x.q), _f32(x.s), _f32(x.ssum), x.rows, _f32(y))
        return y

    def linear(
        self, layout: BlockLayout, blocks: torch.Tensor, n: int, k: int, x: torch.Tensor
    ) -> torch.Tensor:
        """[rows, n] float32: x (float32 [rows, k], contiguous) quantized and multiplied in one call."""
        rows = int(x.shape[0])
        y = torch.empty((rows, n), dtype=torch.float32)
        if self._lib.dg_linear(layout.value, blocks.data_ptr(), n, k, x.data_ptr(), rows, y.data_ptr()):
            raise MemoryError(f"no memory for {rows} x {k} quantized activations")
        return y

    def linear_silu(
        self, layout: BlockLayout, blocks: torch.Tensor, n: int, k: int, gate_up: torch.Tensor
    ) -> torch.Tensor:
        """`linear` of silu(gate) * up for gate_up (float32 [rows, 2k], contiguous), without the
        [rows, k] activations in memory; equal to linear(silu_mul(gate_up)) bit for bit."""
        rows = int(gate_up.shape[0])
        y = torch.empty((rows, n), dtype=torch.float32)
        if self._lib.dg_linear_silu(layout.value, blocks.data_ptr(), n, k, _f32(gate_up), rows, y.data_ptr()):
            raise MemoryError(f"no memory for {rows} x {k} quantized activations")
        return y

    def decode_layers(self, step: DecodeStep, x: torch.Tensor, h: torch.Tensor, stack: LayerStack) -> None:
        """Every layer of a decode step in one call (dg_decode_layers: dg_decode_layer for each in
        turn): x += every layer's attention and MLP outputs in place; h holds the first layer's
        normed input in, and is scratch after."""
        rc = self._lib.dg_decode_layers(
            _f32(x),
            _f32(h),
            ctypes.addressof(stack.refs),
            len(stack),
            step.eps,
            step.cos.data_ptr(),
            step.sin_signed.data_ptr(),
            step.positions.data_ptr(),
            stack.kv_kind,
            step.slots.data_ptr(),
            step.page_tables.data_ptr(),
            step.page_tables.shape[1],
            step.row_seq.data_ptr() if step.row_seq is not None else None,
            step.seq_lens.data_ptr(),
            step.rows,
            step.heads,
            step.kv_heads,
            step.head_dim,
            step.page_size,
            step.attn_scale,
        )
        if rc:
            raise MemoryError("no memory for the decoder layer's scratch")

    def matmul_q4x8(self, blocks: torch.Tensor, n: int, k: int, x: QuantizedRows) -> torch.Tensor:
        """[rows, n] float32 from 8-row q4 blocks (uint8 [n / 8, k / 32, block_q4x8_bytes])."""
        assert x.q.shape[1] == k and n % 8 == 0
        y = torch.empty((x.rows, n), dtype=torch.float32)
        self._lib.dg_matmul_q4x8(_ptr(blocks), n, k, _ptr(x.q), _f32(x.s), _f32(x.ssum), x.rows, _f32(y))
        return y

    def matmul_q8x8(self, blocks: torch.Tensor, n: int, k: int, x: QuantizedRows) -> torch.Tensor:
        """[rows, n] float32 from 8-row q8 blocks (uint8 [n / 8, k / 32, block_q8x8_bytes])."""
        assert x.q.shape[1] == k and n % 8 == 0
        y = torch.empty((x.rows, n), dtype=torch.float32)
        self._lib.dg_matmul_q8x8(_ptr(blocks), n, k, _ptr(x.q), _f32(x.s), x.rows, _f32(y))
        return y

    def matmul_q8(self, blocks: torch.Tensor, n: int, k: int, x: QuantizedRows) -> torch.Tensor:
        """[rows, n] float32 from q8 blocks (uint8 [n, k / 32, block_q8_bytes], checked when packed)."""
        assert x.q.shape[1] == k
        y = torch.empty((x.rows, n), dtype=torch.float32)
        self._lib.dg_matmul_q8(_ptr(blocks), n, k, _ptr(x.q), _f32(x.s), x.rows, _f32(y))
        return y

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """x += delta in place (when given); returns RMSNorm(x) * weight. x [rows, dim] float32."""
        rows, dim = x.shape
        if weight.shape[0] != dim or (delta is not None and delta.shape != x.shape):
            raise ValueError(f"add_rms_norm: x {tuple(x.shape)}, weight {tuple(weight.shape)}")
        out = torch.empty_like(x)
        self._lib.dg_add_rms_norm(
            _f32(x), None if delta is None else _f32(delta), _f32(weight), _f32(out), rows, dim, eps
        )
        return out

    def rotary_(
        self,
        x: torch.Tensor,
        heads: int,
        head_dim: int,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """Rotate the first `heads` heads of each row of x [rows, >= heads * head_dim] in place
        (halves layout); cos and sin_signed are [positions, head_dim] tables."""
        rows, width = x.shape
        if x.stride(1) != 1 or width < heads * head_dim or cos.shape[1] != head_dim:
            raise ValueError(f"rotary_: x {tuple(x.shape)} strides {x.stride()}, {heads} heads of {head_dim}")
        if positions.dtype is not torch.int64 or positions.shape[0] != rows:
            raise ValueError(f"rotary_: positions must be int64 [{rows}]")
        self._lib.dg_rotary(
            int(x.data_ptr()),
            rows,
            x.stride(0),
            heads,
            head_dim,
            _f32(cos),
            _f32(sin_signed),
            _ptr(positions),
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [rows, 2 * inter] float32 -> [rows, inter]."""
        rows, width = gate_up.shape
        out = torch.empty((rows, width // 2), dtype=torch.float32)
        self._lib.dg_silu_mul(_f32(gate_up), rows, width // 2, _f32(out))
        return out

    def lora_rows_(self, x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, y: torch.Tensor) -> None:
        """y += (x A^T) B^T in place, each row alone (dg_lora_rows): x [m, k] and y [m, n] float32 with
        unit column stride (rows may be strided views), A [r, k] and B^T [r, n] contiguous float32."""
        m, k = x.shape
        r, n = b_t.shape
        if a.shape != (r, k) or y.shape != (m, n):
            raise ValueError(
                f"lora_rows_: shapes x {tuple(x.shape)}, A {tuple(a.shape)}, B^T {(r, n)}, y {tuple(y.shape)}"
            )
        for t in (x, a, b_t, y):
            if t.dtype is not torch.float32 or t.stride(-1) != 1:
                raise ValueError("lora_rows_: float32 tensors with unit column stride")
        self._lib.dg_lora_rows(
            int(x.data_ptr()), x.stride(0), m, k, _ptr(a), r, _ptr(b_t), n, int(y.data_ptr()), y.stride(0)
        )

    def tile_attention(self, on: bool | None = None) -> bool:
        """Whether the attention over a bfloat16 or int8 cache runs on AMX tiles (where the build,
        CPU and OS have them; head size 32 or 64, pages of 32s). `on` turns it off or back on for this
        process: tests and benchmarks compare it with the vector path."""
        return bool(self._lib.dg_set_amx(TILES_ATTENTION, -1 if on is None else int(on)))

    def tile_linears(self, on: bool | None = None) -> bool:
        """Whether the 8-row block linears of 13 or more rows (and 128 or more inputs) run on AMX tiles
        (where the build, CPU and OS have them); they give the vector tiles' bits. `on` as in
        tile_attention."""
        return bool(self._lib.dg_set_amx(TILES_LINEARS, -1 if on is None else int(on)))

    def tile_linear_calls(self) -> int:
        """How many block linears the AMX tiles have run in this process (tests check that the
        dispatch reaches them)."""
        return int(self._lib.dg_tile_linear_calls())

    def shared_attention_tasks(self) -> int:
        """How many tile attention tasks have served the decode rows of several sequences at once, over
        the pages their tables share (tests check that shared prompts reach them)."""
        return int(self._lib.dg_shared_attention_tasks())

    def tile_attends(self, heads: int, kv_heads: int, head_dim: int, page_size: int) -> bool:
        """Whether a bfloat16 or int8 cache of this geometry is attended on AMX tiles here (the
        kernel's own condition, dg_amx_attends)."""
        return bool(self._lib.dg_amx_attends(heads, kv_heads, head_dim, page_size))

    def peak_rates(self, seconds: float = 0.2) -> PeakRates:
        """This build's peak arithmetic rates on every thread at once (see dg_peak), each timed
        for about `seconds`."""

        def rate(kind: int) -> float:
            probe = 200_000
            first = float(self._lib.dg_peak(kind, probe))
            if first <= 0:
                return 0.0
            ops_per_iter = {0: 12 * 128, 1: 12 * 32, 2: 12 * 64}[kind]  # an upper bound, for sizing only
            iters = max(probe, int(seconds * first / ops_per_iter))
            return max(first, float(self._lib.dg_peak(kind, iters)))

        return PeakRates(int8_ops=rate(0), float32_flops=rate(1), bf16_flops=rate(2))

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """torch.argmax(x, dim=-1) for x [rows, n] float32 (lowest index among equals, the first NaN's
        where a row has one), int64 [rows]."""
        rows, n = x.shape
        if n == 0:
            raise ValueError("argmax of an empty row")
        out = torch.empty(rows, dtype=torch.int64)
        self._lib.dg_argmax_rows(_f32(x), rows, n, int(out.data_ptr()))
        return out

    def inverse_cdf(self, probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        """int64 [rows]: per row of probs (float32 [rows, w], >= 0), the first column whose float64
        running sum exceeds uniforms[row] (float32 [rows]) times the row's total; w - 1 if none."""
        rows, w = probs.shape
        if w == 0 or uniforms.shape != (rows,):
            raise ValueError(
                f"inverse_cdf needs [rows, w > 0] probabilities and [rows] uniforms, got {list(probs.shape)}"
            )
        out = torch.empty(rows, dtype=torch.int64)
        self._lib.dg_inverse_cdf(_f32(probs), rows, w, _f32(uniforms), int(out.data_ptr()))
        return out

    def top_mass(
        self, probs: torch.Tensor, top_p: torch.Tensor, cap: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row of probs (float32 [rows, n], >= 0): ids (int64 [rows, cap]) whose first count[row]
        entries, in increasing order, are every token at or above a value edge and hold at least
        top_p[row] (float64 [rows]) of the row's mass, the rest distinct ids outside that set;
        count (int64 [rows]) is -1 where such a set would pass cap tokens."""
        rows, n = probs.shape
        if not 0 < cap <= n or top_p.dtype != torch.float64 or top_p.shape != (rows,):
            raise ValueError(f"top_mass needs 0 < cap <= {n} and float64 [rows] top_p")
        ids = torch.empty((rows, cap), dtype=torch.int64)
        count = torch.empty(rows, dtype=torch.int64)
        top_p = top_p.contiguous()
        self._lib.dg_top_mass(
            _f32(probs), rows, n, int(top_p.data_ptr()), cap, int(ids.data_ptr()), int(count.data_ptr())
        )
        return ids, count

    def top_p_rows_(self, s: torch.Tensor, p: torch.Tensor, top_p: torch.Tensor) -> None:
        """In place on s (float32 [rows, n]): per row, ranked by s descending (ties: lower column
        first), -inf from the first rank whose float64 mass of p above it reaches top_p[row]
        (float64 [rows]; +inf leaves the row alone)."""
        rows, n = s.shape
        if p.shape != s.shape or top_p.dtype != torch.float64 or top_p.shape != (rows,):
            raise ValueError("top_p_rows_ needs s and p of one shape and float64 [rows] top_p")
        top_p = top_p.contiguous()
        if not self._lib.dg_top_p_rows(_f32(s), _f32(p), rows, n, int(top_p.data_ptr())):
            raise MemoryError(f"no memory to rank {n} values")

    def to_half(self, x: torch.Tensor) -> torch.Tensor:
        """float32 -> float16 as the decoder layer writes a float16 KV cache (nearest, ties to even)."""
        out = torch.empty(x.shape, dtype=torch.float16)
        self._lib.dg_to_half_array(_f32(x), x.numel(), int(out.data_ptr()))
        return out

    def to_bfloat16(self, x: torch.Tensor) -> torch.Tensor:
        """float32 -> bfloat16 as the decoder layer writes a bfloat16 KV cache (nearest, ties to even)."""
        out = torch.empty(x.shape, dtype=torch.bfloat16)
        self._lib.dg_to_bf16_array(_f32(x), x.numel(), int(out.data_ptr()))
        return out

    def decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
        page_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        row_seq: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Query rows q [B, H, D] float32 against a layer's paged cache [pages, KVH, page_size, D]
        (float32, float16 or bfloat16, or int8 with [pages, KVH, page_size] float32/float16 scales) ->
        [B, H * D].
        Row b sees the first seq_lens[b] keys of page table row_seq[b] (of b without row_seq: one
        query per sequence, a decode step); each row's result is what it would be alone."""
        b, heads, dim = q.shape
        _, kv_heads, page_size, _ = k_cache.shape
        if q.stride(2) != 1 or q.stride(1) != dim:
            raise ValueError(f"decode_attention: q's heads must be contiguous rows, strides {q.stride()}")
        if page_tables.dtype is not torch.int64 or seq_lens.dtype is not torch.int64:
            raise ValueError("decode_attention: page tables and lengths must be int64")
        if seq_lens.shape != (b,) or (
            row_seq is not None and (row_seq.dtype is not torch.int64 or row_seq.shape != (b,))
        ):
            raise ValueError("decode_attention: one int64 length (and sequence) per query row")
        if row_seq is None and page_tables.shape[0] != b:
            raise ValueError("decode_attention: one page table per query row without row_seq")
        quant = k_scale is not None and v_scale is not None
        want = (torch.int8,) if quant else CACHE_DTYPES
        if k_cache.dtype not in want or v_cache.dtype is not k_cache.dtype:
            raise ValueError(
                f"decode_attention: a {'quantized' if quant else 'float'} cache must be one of {want}"
            )
        if (
            quant
            and k_scale is not None
            and v_scale is not None
            and (k_scale.dtype is not v_scale.dtype or k_scale.dtype not in (torch.float32, torch.float16))
        ):
            raise ValueError("decode_attention: scales must be float32 or float16, both the same")
        out = torch.empty((b, heads * dim), dtype=torch.float32)
        self._lib.dg_decode_attention(
            int(q.data_ptr()),
            q.stride(0),
            _ptr(k_cache),
            _ptr(v_cache),
            _ptr(k_scale) if quant and k_scale is not None else None,
            _ptr(v_scale) if quant and v_scale is not None else None,
            int(quant and k_scale is not None and k_scale.dtype == torch.float16),
            0 if quant else cache_kind(k_cache.dtype),
            _ptr(page_tables),
            int(page_tables.shape[1]),
            _ptr(row_seq) if row_seq is not None else None,
            _ptr(seq_lens),
            b,
            heads,
            kv_heads,
            dim,
            page_size,
            scale,
            _f32(out),
        )
        return out


_failure: list[str] = []


def build_library(march: str | None = None) -> NativeLibrary:
    """Build (or find the build of) the library for `-march=march` (default: the CPU's, or the
    instruction set DYNGEN_CPU_ISA caps it to); raises NativeBuildError."""
    march = cpu_features().march if march is None else march
    compiler = _compiler()
    if compiler is None:
        raise NativeBuildError("no C compiler (cc, gcc or clang) on PATH")
    try:
        path = library_path(compiler, march)
        if not path.exists():
            _build(compiler, march, path)
        return NativeLibrary(path)
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeBuildError(str(e)) from e


_build_lock = threading.Lock()  # a load starts the build on a thread; a second caller waits for it


def native_library() -> NativeLibrary | None:
    """The library for this machine's CPU, built on first use; None where it cannot be built."""
    with _build_lock:
        return _native_library()


@functools.cache
def _native_library() -> NativeLibrary | None:
    if os.environ.get("DYNGEN_NATIVE", "1") == "0":
        _failure.append("disabled by DYNGEN_NATIVE=0")
        return None
    try:
        return build_library()
    except NativeBuildError as e:
        _failure.append(str(e))
        return None


def native_unavailable_reason() -> str | None:
    return _failure[-1] if native_library() is None and _failure else None
