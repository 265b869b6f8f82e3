"""The native CPU kernels (kernels/native/csrc/cpu_kernels.c) against torch references.

Every test runs on the builds this host can run: `-march=native` (512-bit VNNI block matmuls
where the CPU has AVX-512 VNNI, else AVX2 intrinsics), `-march=cascadelake` (the 512-bit code
without bfloat16 pair products, on hosts that have them natively), `-march=x86-64-v3` (the AVX2
code, on hosts with AVX2) and `-march=x86-64` (the portable scalar code), so every path this CPU
can execute is checked.

Tolerances: integer block dot products are exact, so a matmul must equal the float32
product of the dequantized weights and the dequantized activations up to float32
summation error (relative 1e-5 of the output's scale); against the unquantized
activations the error is bounded by sum |w| * s / 2 per output (each activation moves
by at most half its block's step s).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine.cache.kv_cache import KVCacheKind
from engine.model.config import ModelConfig
from engine.model.loader import load_model
from engine.model.quantization import QuantMode
from engine.model.rope import RotaryEmbedding
from kernels.attention.backend import AttentionKind
from kernels.cpu_features import cpu_features
from kernels.linear.block_linear import (
    Int4BlockLinear,
    Int8BlockLinear,
    pack_q4,
    pack_q4x8,
    pack_q8,
    pack_q8x8,
    quantize_q8_blocks,
)
from kernels.linear.int4_groups import Int4Groups
from kernels.native.native_library import (
    DecodeStep,
    NativeBuildError,
    NativeLibrary,
    QuantizedRows,
    build_library,
    native_library,
    native_unavailable_reason,
)
from tests.reference_generate import GenerationSettings, generate_batch
from tests.tiny_llama import save_tiny_llama

# What each build needs of the CPU beyond x86-64: cascadelake is the 512-bit VNNI code without
# bfloat16 pair products (a bfloat16 cache then widens to float32, as on AVX2).
NEEDS = {
    "x86-64-v3": {"avx2", "fma", "f16c"},
    "cascadelake": {
        "avx2",
        "fma",
        "f16c",
        "avx512f",
        "avx512bw",
        "avx512cd",
        "avx512dq",
        "avx512vl",
        "avx512_vnni",
    },
}


@pytest.fixture(scope="module", params=["native", "cascadelake", "x86-64-v3", "x86-64"])
def lib(request: pytest.FixtureRequest) -> NativeLibrary:
    if not NEEDS.get(str(request.param), set()) <= cpu_features().flags:
        pytest.skip(f"this CPU cannot run {request.param} code")
    if request.param == "cascadelake" and "avx512_bf16" not in cpu_features().flags:
        pytest.skip("the native build is this code already")
    try:
        return build_library(str(request.param))
    except NativeBuildError as e:
        pytest.skip(f"no native build: {e}")


def _dequant_rows(x: QuantizedRows) -> torch.Tensor:
    rows, k = x.q.shape
    return (x.q.view(rows, -1, 32).float() * x.s[..., None]).view(rows, k)


def _close(y: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> None:
    tol = rel * float(ref.abs().max()) + 1e-6
    assert float((y - ref).abs().max()) <= tol


def test_activation_quantization_matches_the_reference(lib: NativeLibrary) -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 96) * torch.tensor([1e-3, 1.0, 50.0]).repeat_interleave(32)
    x[2, 32:64] = 0.0  # an all-zero block: scale 0, values 0
    got = lib.quantize_rows(x)
    d = x.view(5, 3, 32).abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(x.view(5, 3, 32) * inv[..., None]).to(torch.int8)
    assert torch.equal(got.q, q.view(5, 96))
    assert torch.equal(got.s, d)
    assert torch.allclose(got.ssum, d * q.sum(-1).float())


@pytest.mark.parametrize("layout", ["rows", "x8"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 13, 64, 131])
def test_q4_matmul_equals_the_dequantized_product(lib: NativeLibrary, rows: int, layout: str) -> None:
    torch.manual_seed(rows)
    n, k = 72, 160
    groups = Int4Groups.quantize(torch.randn(n, k))
    x = torch.randn(rows, k)
    qx = lib.quantize_rows(x)
    if layout == "x8":
        y = lib.matmul_q4x8(pack_q4x8(groups, lib), n, k, qx)
    else:
        y = lib.matmul_q4(pack_q4(groups, lib), n, k, qx)
    w = groups.dequantize()
    _close(y, _dequant_rows(qx) @ w.T)
    # Against the float activations: within half a step per activation.
    bound = (w.abs() @ (qx.s.repeat_interleave(32, dim=1) / 2).T).T
    assert bool(((y - x @ w.T).abs() <= bound * 1.001 + 1e-5).all())


@pytest.mark.parametrize("layout", ["rows", "x8"])
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 70])
def test_q8_matmul_equals_the_dequantized_product(lib: NativeLibrary, rows: int, layout: str) -> None:
    torch.manual_seed(rows)
    n, k = 40, 96
    weight = torch.randn(n, k)
    q, d = quantize_q8_blocks(weight)
    x = torch.randn(rows, k)
    qx = lib.quantize_rows(x)
    if layout == "x8":
        y = lib.matmul_q8x8(pack_q8x8(q, d, lib), n, k, qx)
    else:
        y = lib.matmul_q8(pack_q8(q, d, lib), n, k, qx)
    w = (q.view(n, -1, 32).float() * d[..., None]).view(n, k)
    _close(y, _dequant_rows(qx) @ w.T)
    assert float((w - weight).abs().max()) <= float(d.max()) / 2 + 1e-6


# 8-row groups: a whole number of quads (the 512-bit build's 32-row tiles) and one more pair, one
# more group, a pair and a group, and too few for a quad
@pytest.mark.parametrize("n", [32, 48, 40, 56, 24])
@pytest.mark.parametrize("rows", [1, 3, 6, 8, 13, 33, 34, 67])
def test_every_build_gives_the_same_block_products(n: int, rows: int) -> None:
    """The 512-bit and 256-bit builds agree bit for bit (exact integer block sums, then the same
    float steps in the same order); the scalar build, which sums its floats in another order,
    within float32 summation error."""
    builds: dict[str, NativeLibrary] = {}
    for march in ("native", "x86-64-v3", "x86-64"):
        if march == "x86-64-v3" and not {"avx2", "fma", "f16c"} <= cpu_features().flags:
            continue
        try:
            builds[march] = build_library(march)
        except NativeBuildError as e:
            pytest.skip(f"no native build: {e}")
    torch.manual_seed(n + rows)
    k = 128
    groups = Int4Groups.quantize(torch.randn(n, k))
    q, d = quantize_q8_blocks(torch.randn(n, k))
    x = torch.randn(rows, k)
    out = {}
    for march, lib in builds.items():
        qx = lib.quantize_rows(x)
        out[march] = (
            lib.matmul_q4x8(pack_q4x8(groups, lib), n, k, qx),
            lib.matmul_q8x8(pack_q8x8(q, d, lib), n, k, qx),
        )
    simd = [out[m] for m in ("native", "x86-64-v3") if m in out]
    for a, b in zip(simd[0], simd[-1], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(simd[0], out["x86-64"], strict=True):
        _close(a, b)


@pytest.mark.parametrize(("n", "k"), [(40, 128), (24, 160), (64, 576), (56, 1536)])
@pytest.mark.parametrize("rows", [13, 16, 17, 40, 67])
def test_tile_linears_give_each_row_the_bits_it_gets_alone(
    lib: NativeLibrary, n: int, k: int, rows: int
) -> None:
    """The block linears on AMX tiles (calls of 13 rows or more) give every row the bits the vector
    tiles give it, in that call and alone: exact integer block sums, the same float steps. The
    shapes: an odd last group, 5 blocks (a pair's first blocks made during the last pair's), the
    body's inputs; rows past whole 16-row tiles and more than one tile."""
    if not lib.tile_linears(True):
        pytest.skip("no AMX tiles in this build, CPU or OS")
    torch.manual_seed(n * k + rows)
    groups = Int4Groups.quantize(torch.randn(n, k))
    q, d = quantize_q8_blocks(torch.randn(n, k))
    q4, q8 = pack_q4x8(groups, lib), pack_q8x8(q, d, lib)
    x = torch.randn(rows, k)
    qx = lib.quantize_rows(x)
    try:
        before = lib.tile_linear_calls()
        tiled = (lib.matmul_q4x8(q4, n, k, qx), lib.matmul_q8x8(q8, n, k, qx))
        assert lib.tile_linear_calls() == before + 2  # both ran on the tiles
        lib.tile_linears(False)
        vectors = (lib.matmul_q4x8(q4, n, k, qx), lib.matmul_q8x8(q8, n, k, qx))
        assert lib.tile_linear_calls() == before + 2
    finally:
        lib.tile_linears(True)
    for t, v in zip(tiled, vectors, strict=True):
        assert torch.equal(t, v)
    for r in range(rows):
        alone = lib.quantize_rows(x[r : r + 1])
        assert torch.equal(tiled[0][r : r + 1], lib.matmul_q4x8(q4, n, k, alone))
        assert torch.equal(tiled[1][r : r + 1], lib.matmul_q8x8(q8, n, k, alone))


def _unpack_q4(blocks: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, offset) back from row-major q4 blocks [n, k / 32, 24]."""
    scale = blocks[..., 0:4].contiguous().view(torch.float32)[..., 0]
    offset = blocks[..., 4:8].contiguous().view(torch.float32)[..., 0]
    nib = blocks[..., 8:]
    return torch.cat([nib & 0x0F, nib >> 4], dim=-1).reshape(n, k), scale, offset


def _unpack_q4x8(blocks: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, offset) back from 8-row q4 blocks [n / 8, k / 32, 160], per the layout's comment."""
    g, nb = n // 8, k // 32

    def halves(b: torch.Tensor) -> torch.Tensor:
        return b.contiguous().view(torch.float16).float().view(g, nb, 8).transpose(1, 2).reshape(n, nb)

    scale, offset = halves(blocks[..., 0:16]), halves(blocks[..., 16:32])
    q = torch.zeros(n, k, dtype=torch.uint8)
    chunks = blocks[..., 32:].view(g, nb, 4, 8, 4)  # [group, block, chunk, row, byte]
    for c in range(4):
        for t in range(4):
            byte = chunks[:, :, c, :, t].transpose(1, 2).reshape(n, nb)  # [row, block]
            q.view(n, nb, 32)[:, :, 4 * c + t] = byte & 0x0F
            q.view(n, nb, 32)[:, :, 4 * c + t + 16] = byte >> 4
    return q, scale, offset


@pytest.mark.parametrize("n", [16, 12])  # interleaved 8-row blocks, and row-major blocks
def test_q4_linear_runs_the_files_blocks_exactly(lib: NativeLibrary, n: int) -> None:
    """Packed Q4_1-style groups keep every value: unpacking the bytes gives the groups back."""
    torch.manual_seed(1)
    groups = Int4Groups.quantize(torch.randn(n, 64))
    lin = Int4BlockLinear(lib, groups, from_file=True)
    unpack = _unpack_q4x8 if n % 8 == 0 else _unpack_q4
    q, scale, offset = unpack(lin._blocks, n, 64)
    assert (
        torch.equal(q, groups.q) and torch.equal(scale, groups.scale) and torch.equal(offset, groups.offset)
    )
    # One-hot rows quantize exactly (s * 127 = 1), so the product returns weight columns.
    eye = torch.eye(64)
    _close(lin(eye).T, groups.dequantize())
    assert lin.describe() == "int4_q8[file]"


def test_q4_scales_beyond_float16_fall_back_to_row_major_blocks(lib: NativeLibrary) -> None:
    torch.manual_seed(4)
    g = Int4Groups.quantize(torch.randn(16, 64))
    odd = Int4Groups(g.q, g.scale * (1 + 2**-20), g.offset)  # not float16 values any more
    lin = Int4BlockLinear(lib, odd)
    x = torch.randn(3, 64)
    _close(lin(x), _dequant_rows(lib.quantize_rows(x)) @ odd.dequantize().T)
    assert lin._blocks.shape == (16, 2, lib.block_q4_bytes)


@pytest.mark.parametrize("n", [24, 20])  # interleaved 8-row blocks, and row-major blocks
def test_block_linears_keep_shape_dtype_and_bias(lib: NativeLibrary, n: int) -> None:
    torch.manual_seed(2)
    weight = torch.randn(n, 64)
    bias = torch.randn(n)
    x = torch.randn(2, 3, 64)
    for lin in (Int8BlockLinear(lib, weight, bias), Int4BlockLinear(lib, Int4Groups.quantize(weight), bias)):
        y = lin(x)
        assert y.shape == (2, 3, n) and y.dtype == torch.float32
        ref = F.linear(x, weight, bias)
        assert float((y - ref).abs().max()) < 0.15 * float(ref.abs().max())
        assert lin(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_add_rms_norm(lib: NativeLibrary) -> None:
    torch.manual_seed(3)
    x = torch.randn(3, 100)
    delta = torch.randn(3, 100)
    w = torch.randn(100)
    expected_x = x + delta
    ref = w * (expected_x * torch.rsqrt(expected_x.pow(2).mean(-1, keepdim=True) + 1e-5))
    out = lib.add_rms_norm(x, delta, w, 1e-5)
    assert torch.allclose(x, expected_x, atol=0, rtol=0)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    assert torch.allclose(lib.add_rms_norm(x, None, w, 1e-5), ref, rtol=1e-5, atol=1e-6)


def test_rotary_matches_the_rotary_embedding(lib: NativeLibrary) -> None:
    torch.manual_seed(4)
    config = ModelConfig(
        vocab_size=10,
        hidden_size=192,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=48,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    rope = RotaryEmbedding(config, torch.float32)
    qkv = torch.randn(5, (4 + 2 + 2) * 48)
    positions = torch.tensor([0, 7, 3, 63, 12])
    qk = qkv[:, : 6 * 48].view(5, 6, 48)
    cos, sin = rope.tables(positions)
    ref = rope.apply(qk, cos, sin)
    v_before = qkv[:, 6 * 48 :].clone()
    lib.rotary_(qkv, 6, 48, rope.cos, rope.sin_signed, positions)
    assert torch.allclose(qkv[:, : 6 * 48].view(5, 6, 48), ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, 6 * 48 :], v_before)


def test_silu_mul(lib: NativeLibrary) -> None:
    torch.manual_seed(5)
    gu = torch.randn(3, 2 * 90) * 10
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -88.0])
    gate, up = gu.chunk(2, dim=-1)
    assert torch.allclose(lib.silu_mul(gu), F.silu(gate) * up, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize(("k", "r", "n"), [(96, 4, 100), (576, 16, 1728), (37, 3, 5)])
def test_lora_rows_add_the_delta_and_each_row_is_its_own(lib: NativeLibrary, k: int, r: int, n: int) -> None:
    """y += (x A^T) B^T to float32 rounding, and a row's result is the same bit for bit whatever
    rows come with it (the kernel's whole point: BLAS rounds one row apart from several)."""
    torch.manual_seed(k + r)
    x = torch.randn(40, k + 3)[:, :k]  # rows with a stride, as a run's slice of a wider batch
    a, b = torch.randn(r, k), torch.randn(n, r)
    start = torch.randn(40, n)
    y = start.clone()
    lib.lora_rows_(x, a, b.T.contiguous(), y)
    assert torch.allclose(y, start + (x @ a.T) @ b.T, rtol=1e-3, atol=1e-3)  # sums of 576 products
    for lo, hi in ((0, 1), (5, 6), (3, 20), (39, 40)):
        part = start[lo:hi].clone()
        lib.lora_rows_(x[lo:hi], a, b.T.contiguous(), part)
        assert torch.equal(part, y[lo:hi])


@pytest.mark.parametrize("n", [1, 7, 16, 33, 49152])
def test_argmax_rows_answers_as_torch(lib: NativeLibrary, n: int) -> None:
    """Lowest index among equal maxima, the first NaN where a row has one, -inf and -0.0 rows."""
    torch.manual_seed(n)
    x = torch.randn(9, n)
    x[1] = x[1].round()  # ties
    x[2] = float("-inf")
    x[3] = 0.0
    x[3, n // 2] = -0.0
    x[4, n - 1] = float("nan")
    x[5, :: max(1, n // 3)] = float("nan")
    x[6] = x[6].clamp(max=0.5)  # many equal maxima
    x[7, n - 1] = 1e9  # the maximum last
    x[8, 0] = float("inf")
    assert torch.equal(lib.argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize("n", [1, 5, 128, 129, 1000, 49152, 300_000])
def test_inverse_cdf_draws_the_column_torch_draws(lib: NativeLibrary, n: int) -> None:
    """searchsorted(cumsum(p, float64), u * total, right=True), clamped: the same column for any u,
    uniforms landing exactly on a running sum included, and rows with zeros and a zero total."""
    g = torch.Generator().manual_seed(n)
    p = torch.softmax(torch.randn(12, n, generator=g) * 4, dim=-1)
    p[1, : n // 2] = 0.0
    p[2, 1::2] = 0.0
    p[3] = 0.0  # no mass: the last column
    cdf = p.cumsum(dim=-1, dtype=torch.float64)
    at = torch.randint(0, n, (12,), generator=g)
    on_sum = (cdf.gather(-1, at[:, None]).squeeze(-1) / cdf[:, -1].clamp(min=1e-300)).float()
    for u in (torch.rand(12, generator=g), on_sum, torch.zeros(12), torch.full((12,), 1 - 2**-24)):
        ref = torch.searchsorted(cdf, u.double()[:, None] * cdf[:, -1:], right=True).squeeze(-1)
        assert torch.equal(lib.inverse_cdf(p, u), ref.clamp(max=n - 1))


@pytest.mark.parametrize("n", [1, 3, 256, 1000, 49152])
def test_top_p_rows_cut_where_the_stable_sort_cuts(lib: NativeLibrary, n: int) -> None:
    """The same -inf as torch's stable descending sort, float64 cumsum of p above each rank and
    top_p's cut: ties (kept in id order), -inf entries, rows left alone (+inf), tiny and near-1 top_p."""
    g = torch.Generator().manual_seed(n)
    s = torch.randn(10, n, generator=g) * torch.tensor([0.3, 1, 3, 8, 1, 1, 1, 1, 2, 2])[:, None]
    s[4] = s[4].round()  # ties everywhere
    s[5, 1::3] = float("-inf")  # banned tokens
    s[6] = 0.0  # all equal: kept lowest ids first
    s = s - s.amax(dim=-1, keepdim=True)
    p = torch.softmax(s, dim=-1)
    top_p = torch.tensor(
        [0.9, 0.5, 0.95, 0.99, 0.7, 0.8, 0.5, math.inf, 1e-6, 1 - 1e-12], dtype=torch.float64
    )
    order = s.sort(dim=-1, descending=True, stable=True).indices
    above = F.pad(p.gather(-1, order).cumsum(dim=-1, dtype=torch.float64)[:, :-1], (1, 0))
    ref = s.masked_fill(
        torch.zeros_like(order, dtype=torch.bool).scatter(-1, order, above >= top_p[:, None]), float("-inf")
    )
    got = s.clone()
    lib.top_p_rows_(got, p, top_p)
    assert torch.equal(got, ref)
    assert torch.equal(got[7], s[7])


@pytest.mark.parametrize("cap", [1, 64, 1024])
def test_top_mass_is_a_top_set_holding_top_p(lib: NativeLibrary, cap: int) -> None:
    """Each row's set: every probability at or above its smallest member, at least top_p of the
    mass, no more than cap ids, increasing; the padding distinct and outside; -1 past the cap."""
    n = 49152
    g = torch.Generator().manual_seed(cap)
    scales = torch.tensor([0.5, 2.0, 4.0, 8.0, 16.0, 3.0, 3.0, 3.0])
    p = torch.softmax(torch.randn(8, n, generator=g) * scales[:, None], dim=-1)
    p[5] = torch.softmax((torch.randn(n, generator=g) * 3).round(), dim=-1)  # many ties at every edge
    p[6] = 0.0
    p[6, 7] = 1.0  # one token
    top_p = torch.tensor([0.9, 0.95, 0.5, 0.99, 0.3, 0.9, 0.9, 1e-3], dtype=torch.float64)
    ids, count = lib.top_mass(p, top_p, cap)
    assert ids.shape == (8, cap)
    for r in range(8):
        c = int(count[r])
        if c < 0:
            # Only where the nucleus and the values within its edge's bucket (2**-8 of the edge,
            # the kernel's finest) pass cap tokens.
            ranked = p[r].double().sort(descending=True).values
            k = min(int((ranked.cumsum(0) < top_p[r]).sum()) + 1, n)
            assert int((p[r].double() >= ranked[k - 1] * (1 - 2**-8)).sum()) > cap
            continue
        members = ids[r, :c]
        assert 1 <= c <= cap and bool((members[1:] > members[:-1]).all())
        inside = torch.zeros(n, dtype=torch.bool)
        inside[members] = True
        assert float(p[r][inside].double().sum()) >= float(top_p[r])
        assert float(p[r][inside].min()) >= float(p[r][~inside].max())
        pad = ids[r, c:]
        assert not bool(inside[pad].any()) and len(set(pad.tolist())) == len(pad)
    assert int(count[6]) == 1 and int(ids[6, 0]) == 7
    if cap >= 64:
        assert int(count[3]) > 0 and int(count[4]) > 0  # peaky rows fit


def test_float16_conversion_rounds_as_torch(lib: NativeLibrary) -> None:
    """The decoder layer's float16 cache writes equal torch's .half() (the per-op path's), bit for bit."""
    torch.manual_seed(3)
    tiny = torch.finfo(torch.float16).tiny
    edges = torch.tensor(
        [
            0.0,
            -0.0,
            1.0,
            65504.0,
            65519.0,
            65520.0,
            1e6,
            -1e6,
            float("inf"),
            float("-inf"),
            tiny,
            tiny / 2,
            tiny / 1024,
            tiny / 2048,
            tiny / 4096,
            2.0**-25,
            2.0**-25 * 1.0001,
            2.0**-26,
            1.0 + 2.0**-11,
            1.0 + 3 * 2.0**-11,
            1.0 + 2.0**-11 + 2.0**-20,
            3e-5,
            -7e-6,
        ],
    )
    spread = torch.randn(20000) * torch.exp2(torch.randint(-30, 18, (20000,)).float())
    x = torch.cat([edges, spread, torch.randn(5000)])
    got = lib.to_half(x)
    assert torch.equal(got.view(torch.int16), x.half().view(torch.int16))
    assert torch.isnan(lib.to_half(torch.tensor([float("nan")]))).all()


def test_bfloat16_conversion_rounds_as_torch(lib: NativeLibrary) -> None:
    """The decoder layer's bfloat16 cache writes equal torch's .bfloat16() (the per-op path's), bit for bit."""
    torch.manual_seed(4)
    big = torch.finfo(torch.float32).max
    ties = [1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-8 + 2.0**-20]  # halfway: to even, and just past
    edges = torch.tensor([0.0, -0.0, 1.0, *ties, big, -big, 1e-40, -3e-39, float("inf"), float("-inf")])
    spread = torch.randn(20000) * torch.exp2(torch.randint(-120, 120, (20000,)).float())
    x = torch.cat([edges, spread, torch.randn(5000)])
    got = lib.to_bfloat16(x)
    assert torch.equal(got.view(torch.int16), x.bfloat16().view(torch.int16))
    assert torch.isnan(lib.to_bfloat16(torch.tensor([float("nan")]))).all()


@pytest.fixture(params=[False, True], ids=["vectors", "tiles"])
def tiles(request: pytest.FixtureRequest, lib: NativeLibrary) -> Iterator[bool]:
    """The attention over a bfloat16 or int8 cache on each path this build and CPU have: vectors,
    and AMX tiles where the CPU, the OS and the build allow them."""
    on = bool(request.param)
    if on and not lib.tile_attention(True):
        pytest.skip("no AMX tiles in this build, CPU or OS")
    lib.tile_attention(on)
    yield on
    lib.tile_attention(True)


@pytest.mark.parametrize("heads", [6, 10])  # 3 or 5 query heads per K/V head (the V sums take 4 at once)
@pytest.mark.parametrize("quant", [None, torch.float32, torch.float16, "half", "bfloat16"])
@pytest.mark.parametrize(
    ("page_size", "dim", "seq_lens"),
    [
        (4, 32, (5, 1, 12)),
        (64, 64, (70, 1, 130)),  # 16-row score blocks, a part block at each sequence's end
        (24, 48, (17, 40, 72)),  # pages that are not a multiple of 16 rows
        (16, 40, (9, 33, 48)),  # a head size no 16-wide vector covers: the general path and its tail
    ],
)
def test_decode_attention_matches_the_torch_path(
    lib: NativeLibrary,
    quant: torch.dtype | str | None,
    page_size: int,
    dim: int,
    seq_lens: tuple[int, int, int],
    heads: int,
    tiles: bool,
) -> None:
    if tiles and quant in (None, "half"):
        pytest.skip("tiles read bfloat16 and int8 caches only")
    torch.manual_seed(6)
    pages, kvh = 9, 2
    k = torch.randn(pages, kvh, page_size, dim)
    v = torch.randn(pages, kvh, page_size, dim)
    k_scale = v_scale = None
    kq, vq = k, v
    if quant in ("half", "bfloat16"):  # a 2-byte cache: the reference sees its values
        kq, vq = (k.half(), v.half()) if quant == "half" else (k.bfloat16(), v.bfloat16())
        k, v = kq.float(), vq.float()
    elif isinstance(quant, torch.dtype):
        k_scale = (k.abs().amax(-1) / 127).to(quant)
        v_scale = (v.abs().amax(-1) / 127).to(quant)
        kq = torch.round(k / k_scale.float()[..., None]).clamp(-127, 127).to(torch.int8)
        vq = torch.round(v / v_scale.float()[..., None]).clamp(-127, 127).to(torch.int8)
        k = kq.float() * k_scale.float()[..., None]  # the reference sees the dequantized cache
        v = vq.float() * v_scale.float()[..., None]
    tables = torch.tensor([[3, 5, 0], [7, 0, 0], [1, 2, 8]])
    q = torch.randn(3, heads, dim)
    ref = torch.empty(3, heads * dim)
    for i, n in enumerate(seq_lens):  # plain attention over each sequence's keys, gathered slot by slot
        pos = torch.arange(n)
        pages_of = tables[i, pos // page_size]
        keys = k[pages_of, :, pos % page_size]  # [n, kvh, dim]
        vals = v[pages_of, :, pos % page_size]
        kv_of_head = torch.arange(heads) // (heads // kvh)
        s = torch.einsum("hd,nhd->hn", q[i], keys[:, kv_of_head]) * dim**-0.5
        ref[i] = torch.einsum("hn,nhd->hd", s.softmax(-1), vals[:, kv_of_head]).reshape(-1)
    got = lib.decode_attention(q, kq, vq, k_scale, v_scale, tables, torch.tensor(seq_lens), dim**-0.5)
    # With bfloat16 pair products (CPUs with AVX512_BF16, head sizes of 32s) the queries and the
    # softmax weights are rounded to bfloat16 too: 8 bits of mantissa. So on AMX tiles, int8 too.
    tol = 1e-2 if quant == "bfloat16" or (tiles and page_size % 32 == 0 and dim in (32, 64)) else 1e-5
    assert torch.allclose(got, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize(
    ("page_size", "dim", "chunks"),
    [
        (64, 64, ((0, 130), (40, 1), (100, 37))),  # (cached tokens, new tokens) per sequence
        (24, 32, ((0, 5), (17, 70), (48, 1))),  # pages that end inside 16-key blocks
        (16, 48, ((0, 1), (3, 33), (0, 64))),
        (64, 64, ((600, 9), (7, 4))),  # verification rows at a long context: small row groups
    ],
)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_chunk_rows_match_plain_causal_attention_and_decoding_alone(
    lib: NativeLibrary,
    page_size: int,
    dim: int,
    chunks: tuple[tuple[int, int], ...],
    cache_dtype: torch.dtype,
    tiles: bool,
) -> None:
    if tiles and cache_dtype is not torch.bfloat16:
        pytest.skip("tiles read bfloat16 caches only")
    torch.manual_seed(page_size + dim)
    kvh, heads, pages = 2, 6, 40
    k = torch.randn(pages, kvh, page_size, dim)
    v = torch.randn(pages, kvh, page_size, dim)
    kc, vc = k.to(cache_dtype), v.to(cache_dtype)
    k, v = kc.float(), vc.float()  # the reference sees the cache's values
    seq_lens = [c + n for c, n in chunks]
    per_seq = max(-(-n // page_size) for n in seq_lens)
    order = torch.randperm(pages)  # each sequence's pages scattered over the pool
    tables = order[: len(chunks) * per_seq].view(len(chunks), per_seq).contiguous()
    tokens = sum(n for _, n in chunks)
    q = torch.randn(tokens, heads * dim + 16)[:, : heads * dim].view(tokens, heads, dim)  # rows with a stride
    # Each chunk token is a row of its own: its sequence's table, the keys up to its position.
    row_seq = torch.tensor([i for i, (_, n) in enumerate(chunks) for _ in range(n)])
    row_lens = torch.tensor([c + j + 1 for c, n in chunks for j in range(n)])
    got = lib.decode_attention(q, kc, vc, None, None, tables, row_lens, dim**-0.5, row_seq)
    # Bit for bit what each token decoded alone gets: a job's tokens do not depend on its chunking.
    for r in range(tokens):
        seq = int(row_seq[r])
        alone = lib.decode_attention(
            q[r : r + 1].contiguous(),
            kc,
            vc,
            None,
            None,
            tables[seq : seq + 1],
            row_lens[r : r + 1],
            dim**-0.5,
        )
        assert torch.equal(alone[0], got[r])
    ref = torch.empty(tokens, heads * dim)
    kv_of_head = torch.arange(heads) // (heads // kvh)
    row = 0
    for i, (cached, new) in enumerate(chunks):
        pos = torch.arange(cached + new)
        pages_of = tables[i, pos // page_size]
        keys = k[pages_of, :, pos % page_size][:, kv_of_head]  # [n, heads, dim]
        vals = v[pages_of, :, pos % page_size][:, kv_of_head]
        qi = q[row : row + new]
        s = torch.einsum("qhd,nhd->hqn", qi, keys) * dim**-0.5
        visible = pos[None, :] <= (cached + torch.arange(new))[:, None]
        s = s.masked_fill(~visible, float("-inf"))
        ref[row : row + new] = torch.einsum("hqn,nhd->qhd", s.softmax(-1), vals).reshape(new, -1)
        row += new
    tol = 1e-2 if cache_dtype is torch.bfloat16 else 1e-5  # bfloat16 queries and weights (see above)
    assert torch.allclose(got, ref, rtol=tol, atol=tol)


def _cache_numbers_only_at(
    slots: list[tuple[int, int]], int8: bool, pages: int, kvh: int, page_size: int, dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A paged K/V cache (bfloat16, or int8 with float16 scales) holding numbers only at the (page,
    slot)s given, NaN everywhere else (an int8 cache: NaN scales there), as a reused page may hold."""
    nan = float("nan")
    if int8:  # whatever bytes past the ends, NaN scales there
        kc = torch.randint(-127, 128, (pages, kvh, page_size, dim), dtype=torch.int8)
        vc = torch.randint(-127, 128, (pages, kvh, page_size, dim), dtype=torch.int8)
        ks: torch.Tensor | None = torch.full((pages, kvh, page_size), nan, dtype=torch.float16)
        vs: torch.Tensor | None = torch.full((pages, kvh, page_size), nan, dtype=torch.float16)
    else:
        kc = torch.full((pages, kvh, page_size, dim), nan).bfloat16()
        vc = kc.clone()
        ks = vs = None
    for page, slot in slots:
        if ks is not None and vs is not None:
            ks[page, :, slot] = (torch.rand(kvh) / 64 + 1e-3).half()
            vs[page, :, slot] = (torch.rand(kvh) / 64 + 1e-3).half()
        else:
            kc[page, :, slot] = torch.randn(kvh, dim).bfloat16()
            vc[page, :, slot] = torch.randn(kvh, dim).bfloat16()
    return kc, vc, ks, vs


@pytest.mark.parametrize("int8", [False, True], ids=["bfloat16", "int8"])
@pytest.mark.parametrize("per_kv", [3, 16, 17])  # 5 rows a tile task, 1, and past the tiles' 16 columns
def test_tile_attention_matches_the_vectors_and_reads_no_slot_past_a_sequence(
    lib: NativeLibrary, per_kv: int, int8: bool
) -> None:
    """Verification and prefill rows of a sequence share a tile task (16 query vectors, up to 5
    rows at 3 heads a K/V head): each gets what it gets alone, close to the vector path, and
    slots past a sequence's keys (NaN here, or NaN scales of an int8 cache, as a reused page may
    hold) reach no output."""
    if not lib.tile_attention(True):
        pytest.skip("no AMX tiles in this build, CPU or OS")
    torch.manual_seed(per_kv)
    kvh, dim, page_size, pages = 2, 64, 64, 24
    heads = kvh * per_kv
    chunks = ((0, 23), (90, 1), (31, 2), (200, 7), (5, 64))  # (cached tokens, new tokens)
    per_seq = 4
    tables = torch.randperm(pages)[: len(chunks) * per_seq].view(len(chunks), per_seq).contiguous()
    own = [
        (int(tables[i, pos // page_size]), pos % page_size)
        for i, (c, n) in enumerate(chunks)
        for pos in range(c + n)
    ]
    kc, vc, ks, vs = _cache_numbers_only_at(own, int8, pages, kvh, page_size, dim)
    row_seq = torch.tensor([i for i, (_, n) in enumerate(chunks) for _ in range(n)])
    row_lens = torch.tensor([c + j + 1 for c, n in chunks for j in range(n)])
    q = torch.randn(len(row_lens), heads, dim)
    # Slots past a row's own keys but inside its chunk are the later rows' keys: numbers, zero weight.
    got = lib.decode_attention(q, kc, vc, ks, vs, tables, row_lens, dim**-0.5, row_seq)
    assert torch.isfinite(got).all()
    for r in range(len(row_lens)):
        seq = int(row_seq[r])
        alone = lib.decode_attention(
            q[r : r + 1].contiguous(), kc, vc, ks, vs, tables[seq : seq + 1], row_lens[r : r + 1], dim**-0.5
        )
        assert torch.equal(alone[0], got[r])
    lib.tile_attention(False)
    try:
        vectors = lib.decode_attention(q, kc, vc, ks, vs, tables, row_lens, dim**-0.5, row_seq)
    finally:
        lib.tile_attention(True)
    scale = 1.0 if ks is None else 127 / 64  # an int8 cache's values here reach ~127 * 1/64
    # The tiles round queries and weights to bfloat16 (the vectors do for bfloat16 only).
    assert torch.allclose(got, vectors, rtol=2e-2, atol=2e-2 * scale)


@pytest.mark.parametrize("int8", [False, True], ids=["bfloat16", "int8"])
@pytest.mark.parametrize("per_kv", [3, 1])  # 5 sequences a tile task, and 16
def test_decode_rows_on_a_shared_prompt_share_tile_tasks_and_get_what_they_get_alone(
    lib: NativeLibrary, per_kv: int, int8: bool
) -> None:
    """Decode rows of sequences whose page tables begin with the same pages (a prompt the prefix
    cache shares) are attended together over those pages, then each over its own: every row gets,
    bit for bit, what it gets alone, in any mix (other sequences, a verify step's rows, tables that
    part after some shared pages, a sequence that ends inside the shared ones), close to the
    vector path, and slots past a sequence's keys (NaN) reach no output."""
    if not lib.tile_attention(True):
        pytest.skip("no AMX tiles in this build, CPU or OS")
    torch.manual_seed(7 + per_kv)
    kvh, dim, page_size, pages = 2, 64, 64, 80
    heads = kvh * per_kv
    prompt_a, prompt_b = list(range(0, 6)), list(range(6, 8))  # 384 and 128 shared keys
    spare = iter(torch.randperm(pages - 8).add(8).tolist())
    # (shared pages, keys): own pages follow the shared ones, the keys end anywhere in the last page
    plan = [(prompt_a, 384 + 1 + 37 * i) for i in range(7)]
    plan += [(prompt_a[:3], 192 + 90), (prompt_a[:3], 192 + 250)]  # tables that part after three pages
    plan += [(prompt_a, 200), (prompt_a, 384)]  # ends inside the prompt, or at its end
    plan += [(prompt_b, 128 + 20 + 31 * i) for i in range(3)]
    plan += [([], 150), ([], 64)]
    plan.append((prompt_a, 420))  # a verify step's 4 rows, last in the batch
    tables_list = [
        shared[: -(-keys // page_size)] + [next(spare) for _ in range(-(-keys // page_size) - len(shared))]
        for shared, keys in plan
    ]
    max_pages = max(len(t) for t in tables_list)
    tables = torch.tensor([t + [0] * (max_pages - len(t)) for t in tables_list])
    # a shared page's slot holds one value for every reader
    slots = {
        (t[pos // page_size], pos % page_size)
        for t, (_, keys) in zip(tables_list, plan, strict=True)
        for pos in range(keys)
    }
    kc, vc, ks, vs = _cache_numbers_only_at(sorted(slots), int8, pages, kvh, page_size, dim)
    decoders = torch.randperm(len(plan) - 1).tolist()  # the decode rows in any order
    verify = len(plan) - 1
    row_seq = torch.tensor(decoders + [verify] * 4)
    row_lens = torch.tensor([plan[s][1] for s in decoders] + [plan[verify][1] - 3 + j for j in range(4)])
    q = torch.randn(len(row_lens), heads, dim)
    before = lib.shared_attention_tasks()
    got = lib.decode_attention(q, kc, vc, ks, vs, tables, row_lens, dim**-0.5, row_seq)
    assert lib.shared_attention_tasks() > before  # the shared prompts took the shared tasks
    assert torch.isfinite(got).all()
    for r in range(len(row_lens)):
        seq = int(row_seq[r])
        alone = lib.decode_attention(
            q[r : r + 1].contiguous(), kc, vc, ks, vs, tables[seq : seq + 1], row_lens[r : r + 1], dim**-0.5
        )
        assert torch.equal(alone[0], got[r]), r
    lib.tile_attention(False)
    try:
        vectors = lib.decode_attention(q, kc, vc, ks, vs, tables, row_lens, dim**-0.5, row_seq)
    finally:
        lib.tile_attention(True)
    scale = 1.0 if ks is None else 127 / 64
    assert torch.allclose(got, vectors, rtol=2e-2, atol=2e-2 * scale)


@pytest.mark.parametrize("kind", list(KVCacheKind))
def test_native_attention_and_fused_ops_match_the_torch_model(tmp_path: Path, kind: KVCacheKind) -> None:
    """A tiny model through the native backend (decode kernel, fused ops) and through plain torch."""
    if native_library() is None:
        pytest.skip(f"native kernels unavailable: {native_unavailable_reason()}")
    save_tiny_llama(
        tmp_path, with_tokenizer=True, hidden_size=96, num_attention_heads=6, num_key_value_heads=2
    )
    native_model = load_model(tmp_path, progress=False, attention=AttentionKind.NATIVE).model
    torch_model = load_model(tmp_path, progress=False, attention=AttentionKind.TORCH).model
    assert native_model._native_ops is not None
    torch_model.native = None  # plain torch ops as well as torch attention
    prompts = [[(7 * i + 13 * j) % 300 + 3 for j in range(3 + 11 * i)] for i in range(4)]
    settings = GenerationSettings(max_new_tokens=12, ignore_eos=True, max_chunk_tokens=16)
    runs = []
    for model in (native_model, torch_model):
        cache = model.new_cache(num_pages=40, page_size=8, kind=kind)
        runs.append(generate_batch(model, cache, prompts, settings, keep_logits=True))
    for ours, theirs in zip(*runs, strict=True):
        assert ours.token_ids == theirs.token_ids
        for a, b in zip(ours.step_logits, theirs.step_logits, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "kind", [KVCacheKind.FLOAT, KVCacheKind.FLOAT16, KVCacheKind.BFLOAT16, KVCacheKind.INT8]
)
def test_one_call_decoder_layers_match_the_per_op_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: KVCacheKind
) -> None:
    """Steps of a block-quantized model run all their layers in one native call (decode rows, and
    prefill chunks a token per row, as a verification's drafts); same logits as per op, and the
    same bytes in the cache (an int8 cache's values and scales as quantize_kv stores them)."""
    lib = native_library()
    if lib is None:
        pytest.skip(f"native kernels unavailable: {native_unavailable_reason()}")
    # Heads of 32 values: a bfloat16 cache's pair products where the CPU has them.
    save_tiny_llama(
        tmp_path, with_tokenizer=True, hidden_size=192, num_attention_heads=6, num_key_value_heads=2
    )
    model = load_model(tmp_path, progress=False, attention=AttentionKind.NATIVE, quant=QuantMode.INT4).model
    calls = chunk_calls = 0
    real = NativeLibrary.decode_layers

    def counting(self: NativeLibrary, step: DecodeStep, *args: Any) -> None:
        nonlocal calls, chunk_calls
        calls += 1
        chunk_calls += step.row_seq is not None
        real(self, step, *args)

    monkeypatch.setattr(NativeLibrary, "decode_layers", counting)
    prompts = [[(5 * i + 11 * j) % 300 + 3 for j in range(2 + 9 * i)] for i in range(3)]
    settings = GenerationSettings(max_new_tokens=10, ignore_eos=True, max_chunk_tokens=16)
    caches = [model.new_cache(num_pages=40, page_size=8, kind=kind) for _ in range(2)]
    fused = generate_batch(model, caches[0], prompts, settings, keep_logits=True)
    assert calls > chunk_calls > 0  # decode steps and prompt chunks took the one-call path
    monkeypatch.setattr(type(model), "_native_layers", lambda *_: None)
    per_op = generate_batch(model, caches[1], prompts, settings, keep_logits=True)
    for name in ("k", "v", "k_scale", "v_scale"):
        a, b = getattr(caches[0], name), getattr(caches[1], name)
        assert (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b)), name
    for ours, theirs in zip(fused, per_op, strict=True):
        assert ours.token_ids == theirs.token_ids
        for a, b in zip(ours.step_logits, theirs.step_logits, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_peak_rates_are_measured_where_the_build_has_the_instructions(lib: NativeLibrary) -> None:
    rates = lib.peak_rates(seconds=0.01)
    if lib.simd == "scalar":  # the portable build: no vector instruction to time
        assert rates.int8_ops == rates.float32_flops == rates.bf16_flops == 0.0
    else:
        assert rates.int8_ops > 0 and rates.float32_flops > 0


@pytest.mark.parametrize("n", [48, 20])  # 8-row interleaved blocks, and the row-major ones
def test_linear_of_silu_equals_silu_then_linear_bit_for_bit(lib: NativeLibrary, n: int) -> None:
    torch.manual_seed(n)
    k, rows = 96, 37
    weight = torch.randn(n, k)
    gate_up = torch.randn(rows, 2 * k) * 4
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])
    for lin in (Int4BlockLinear(lib, Int4Groups.quantize(weight)), Int8BlockLinear(lib, weight)):
        assert torch.equal(lin.silu_call(gate_up), lin(lib.silu_mul(gate_up)))
