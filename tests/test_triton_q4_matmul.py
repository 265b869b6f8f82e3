"""The Triton Q4 matmul (4-bit weights dequantized inside the K loop) against the dequantized product.

Run on the CPU under the Triton interpreter; TRITON_INTERPRET is set before the kernels module is
imported (see test_triton_attention; kernels.linear.triton_q4_linear imports it at the first call).
The interpreter pays per operation, so shapes are small; they still cross every edge: M below,
at and above a tile, N not a multiple of BLOCK_N, K not a multiple of BLOCK_K.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import gguf
import numpy as np
import pytest
import torch

from engine.model.gguf_blocks import RawTensor, int4_groups
from kernels.linear.int4_groups import Int4Groups
from kernels.linear.make_linear import LinearKind, make_linear
from kernels.linear.triton_q4_linear import (
    DECODE_TILES,
    PREFILL_TILES,
    Q4Tiles,
    TritonQ4Linear,
    interpreted,
    pack_nibbles,
    q4_matmul,
    tiles_for,
    unpack_nibbles,
)

CPU = torch.device("cpu")
# (rows, out, in): M 1/3/17/64 (decode and prefill tiles, one and two M tiles), N 8/40/96 (all
# below or across BLOCK_N), K 32/64/160 (K steps of 128 and 64: full, partial and several).
SHAPES = [(m, n, k) for m in (1, 3, 17, 64) for n in (8, 40, 96) for k in (32, 64, 160)]
STYLES = ["q4_0", "q4_1"]


def random_groups(out: int, inp: int, style: str, seed: int) -> Int4Groups:
    """Groups as a file stores them: float16 scale (d) and offset (-8 d for Q4_0, m for Q4_1)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out, inp), generator=gen, dtype=torch.uint8)
    shape = (out, inp // 32)
    scale = (torch.rand(shape, generator=gen) * 0.02 + 1e-3).half().float()
    if style == "q4_0":
        offset = -8 * scale
    else:
        offset = (-8 * scale + torch.randn(shape, generator=gen) * 0.01).half().float()
    return Int4Groups(q, scale, offset)


def assert_matches(y: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-4) -> None:
    """Float32 accumulation against the float32 product: relative error, with an absolute floor
    relative to the output's magnitude (sums that cancel carry the inputs' rounding, not their own)."""
    atol = rtol * float(ref.abs().max())
    torch.testing.assert_close(y.float(), ref, rtol=rtol, atol=atol)


def test_kernels_run_interpreted() -> None:
    assert interpreted(), "TRITON_INTERPRET=1 must be set before kernels.linear.triton_q4_kernels is imported"


def test_packing_round_trip() -> None:
    q = torch.randint(0, 16, (5, 64), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    packed = pack_nibbles(q)
    assert packed.shape == (5, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_nibbles(packed), q)
    # Two consecutive columns per byte, the first in the low nibble.
    q2 = torch.zeros(1, 32, dtype=torch.uint8)
    q2[0, :4] = torch.tensor([1, 2, 15, 0])
    assert pack_nibbles(q2)[0, :2].tolist() == [0x21, 0x0F]


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize(("rows", "out", "inp"), SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
def test_matches_the_dequantized_product(rows: int, out: int, inp: int, style: str) -> None:
    groups = random_groups(out, inp, style, seed=rows * 10_000 + out * 100 + inp)
    x = torch.randn(rows, inp, generator=torch.Generator().manual_seed(rows + inp))
    lin = TritonQ4Linear(groups, CPU)
    y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (rows, out)
    assert_matches(y, x @ groups.dequantize().T)


@pytest.mark.parametrize("tiles", [DECODE_TILES, PREFILL_TILES, Q4Tiles(16, 16, 32)], ids=str)
def test_every_tile_config_at_any_rows(tiles: Q4Tiles) -> None:
    """Each config on rows it is not chosen for (decode tiles at 17 rows: two M tiles)."""
    groups = random_groups(40, 160, "q4_1", seed=3)
    x = torch.randn(17, 160, generator=torch.Generator().manual_seed(4))
    y = TritonQ4Linear(groups, CPU, tiles=tiles)(x)
    assert_matches(y, x @ groups.dequantize().T)


def test_tiles_by_rows() -> None:
    assert tiles_for(1) is DECODE_TILES and tiles_for(16) is DECODE_TILES
    assert tiles_for(17) is PREFILL_TILES and tiles_for(4096) is PREFILL_TILES
    with pytest.raises(ValueError, match="multiple of 32"):
        Q4Tiles(16, 16, 16)
    with pytest.raises(ValueError, match="powers of two"):
        Q4Tiles(16, 48, 64)


@pytest.mark.parametrize(
    ("dtype", "rtol"),
    # bfloat16: weights and output rounded to 8 bits (the interpreter truncates, a GPU rounds).
    [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)],
    ids=["bf16", "fp16"],
)
def test_half_precision_activations(dtype: torch.dtype, rtol: float) -> None:
    groups = random_groups(40, 160, "q4_0", seed=5)
    x = torch.randn(3, 160, generator=torch.Generator().manual_seed(6)).to(dtype)
    y = TritonQ4Linear(groups, CPU)(x)
    assert y.dtype == dtype
    assert_matches(y, x.float() @ groups.dequantize().T, rtol=rtol)


def test_bias_and_leading_dims() -> None:
    groups = random_groups(40, 64, "q4_1", seed=7)
    bias = torch.randn(40, generator=torch.Generator().manual_seed(8))
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(9))
    lin = TritonQ4Linear(groups, CPU, bias=bias)
    y = lin(x)
    assert y.shape == (2, 3, 40)
    assert_matches(y, x @ groups.dequantize().T + bias)
    # Rows read through their stride: a column slice of a wider tensor, no copy needed.
    wide = torch.randn(5, 100, generator=torch.Generator().manual_seed(10))
    assert_matches(lin(wide[:, :64]), wide[:, :64] @ groups.dequantize().T + bias)
    assert lin(torch.zeros(0, 64)).shape == (0, 40)


def test_k_must_be_a_multiple_of_32() -> None:
    x = torch.randn(2, 48)
    packed = torch.zeros(8, 24, dtype=torch.uint8)
    halves = torch.ones(8, 1, dtype=torch.float16)
    with pytest.raises(ValueError, match="divisible by 32"):
        q4_matmul(x, packed, halves, halves)
    with pytest.raises(ValueError, match="divisible by 32"):
        make_linear(LinearKind.TRITON_Q4, torch.randn(8, 48))


def test_make_linear_requantizes_or_keeps_the_stored_groups() -> None:
    weight = torch.randn(40, 96, generator=torch.Generator().manual_seed(11)) * 0.05
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(12))
    lin = make_linear(LinearKind.TRITON_Q4, weight, device=CPU)
    assert lin.kind is LinearKind.TRITON_Q4 and lin.describe() == "triton_q4[requant]"
    assert (lin.out_features, lin.in_features) == (40, 96)
    # 4 bits per weight and two float16 per group of 32.
    assert lin.weight_bytes() == 40 * 96 // 2 + 40 * 3 * 2 * 2
    # Int4Groups.quantize rounds scale and offset to float16: the kernel's float16 copies are exact.
    assert_matches(lin(x), x @ Int4Groups.quantize(weight).dequantize().T)
    stored = make_linear(LinearKind.TRITON_Q4, None, stored=Int4Groups.quantize(weight))
    assert stored.describe() == "triton_q4[file]"


QTYPES = (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1)


@pytest.mark.parametrize("qtype", QTYPES, ids=[t.name for t in QTYPES])
def test_gguf_blocks(qtype: gguf.GGMLQuantizationType) -> None:
    """Groups read from GGUF blocks (as GGUFSource.stored_int4 reads a file's) multiply as dequantized."""
    rng = np.random.default_rng(13)
    weight = (rng.standard_normal((40, 160)) * 0.05).astype(np.float32)
    blocks = gguf.quants.quantize(weight, qtype)
    groups = int4_groups(RawTensor(qtype, (40, 160), torch.from_numpy(np.ascontiguousarray(blocks))))
    assert groups is not None
    lin = make_linear(LinearKind.TRITON_Q4, None, stored=groups)
    assert lin.describe() == "triton_q4[file]"
    x = torch.randn(5, 160, generator=torch.Generator().manual_seed(14))
    assert_matches(lin(x), x @ groups.dequantize().T)


@pytest.mark.slow
def test_the_model_with_triton_q4_linears_gives_the_float_models_greedy_tokens() -> None:
    """The shipped model's first layers with every projection on the Triton Q4 kernel over the
    file's own Q4_1 blocks, against the same blocks dequantized into float32 linears: the same
    greedy tokens for prompts run together (prefill rows and decode rows)."""
    from engine.model.llama import LlamaModel
    from engine.model.loader import open_weight_source
    from engine.model.quantization import LinearPlan
    from engine.model.shipped_model import default_model_path
    from tests.reference_generate import GenerationSettings, generate_batch

    source = open_weight_source(default_model_path())
    f, q4 = LinearKind.FLOAT, LinearKind.TRITON_Q4
    models = [
        LlamaModel.from_source(source, torch.float32, progress=False, num_layers=2, plan=plan)
        for plan in (LinearPlan(q4, q4, q4, q4, f), LinearPlan.uniform(f))
    ]
    assert models[0].describe().count("triton_q4[file]") == 4
    prompts = [[1, 504, 3575, 282, 4649, 314], [1, 19161, 253, 33638, 563, 260, 3426, 30]]
    settings = GenerationSettings(max_new_tokens=4, ignore_eos=True)
    tokens = [
        [
            list(c.token_ids)
            for c in generate_batch(m, m.new_cache(num_pages=8, page_size=16), prompts, settings)
        ]
        for m in models
    ]
    assert tokens[0] == tokens[1]
