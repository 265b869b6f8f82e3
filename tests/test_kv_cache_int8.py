"""The int8 KV cache: quantization bound, torch and Triton attention over it, page copies, a tiny model.

Triton kernels run on the CPU under the interpreter, so TRITON_INTERPRET is set before
anything imports kernels.triton_* (see tests/test_triton_attention.py).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import copy
import random
from pathlib import Path

import pytest
import torch

from engine.cache.kv_cache import CacheShape, KVCacheKind, PagedKVCache
from engine.forward_batch import ForwardBatch, SequenceInput
from engine.generator import DynamicGenerator, GeneratorConfig
from engine.ids import PageId
from engine.jobs import JobSpec
from engine.model.loader import LoadedModel, load_model
from engine.scheduler import SchedulerConfig
from kernels.attention.backend import AttentionKind, select_attention
from kernels.attention.kv_layer import KV_SCALE_DTYPE, KVLayer, dequantize_kv, quantize_kv
from kernels.attention.torch_attention import TorchPagedAttention
from kernels.attention.triton_attention import (
    GPU_TILES,
    INTERPRETER_TILES,
    Tiles,
    TritonPagedAttention,
    interpreted,
)
from tests.reference_generate import GenerationSettings, generate_batch
from tests.tiny_llama import save_tiny_llama

KV_HEADS = 2
CPU = torch.device("cpu")
# |x - q * scale| <= scale / 2, plus float32 rounding of x / scale + 0.5 (|y| < 128: < 1e-5 of a step).
ROUND_TRIP_SLACK = 1e-5
# Attention over an int8 cache vs a float one, K/V ~ N(0, 1), outputs O(1): a quantization step
# is ~0.02 (scale ~ 2.7 / 127), so each output moves by about half a step; measured max ~0.021.
INT8_VS_FLOAT_MAX = 0.05
INT8_VS_FLOAT_MEAN = 0.005
# Decode sequences of more than 32 keys run as several splits (and the reduction kernel).
SMALL_SPLITS = Tiles(block_n=16, block_rows=GPU_TILES.block_rows, split_len=32)


def assert_within_half_step(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    deq = dequantize_kv(q, scale, torch.float32)
    bound = scale.to(torch.float32).unsqueeze(-1) * (0.5 + ROUND_TRIP_SLACK)
    err = (x.to(torch.float32) - deq).abs()
    assert bool((err <= bound).all()), f"worst error {float((err / bound).max())} half-steps"


def test_round_trip_error_is_at_most_half_a_step() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, KV_HEADS, 64, generator=gen)
    # Rows of very different magnitudes, an all-zero row and one below float16's normal range.
    x *= torch.logspace(-3, 4, 64).view(64, 1, 1)
    x[0] = 0.0
    x[1] = 1e-7
    q, scale = quantize_kv(x)
    assert q.dtype == torch.int8 and scale.dtype == KV_SCALE_DTYPE and scale.shape == (64, KV_HEADS)
    assert int(q.abs().max()) <= 127 and bool((scale > 0).all())
    assert_within_half_step(x, q, scale)
    assert bool((q[0] == 0).all())
    # A row whose scale is a float16 normal uses the whole int8 range: absmax -> +-127.
    full = x.abs().amax(-1) >= 127 * torch.finfo(KV_SCALE_DTYPE).tiny
    assert int(full.sum()) > 100 and bool((q.abs().amax(-1)[full] == 127).all())
    # From bfloat16 activations too.
    xb = x[2:].to(torch.bfloat16)
    qb, sb = quantize_kv(xb)
    assert_within_half_step(xb, qb, sb)


def build_batch(page_size: int, seed: int) -> tuple[ForwardBatch, int]:
    """Decodes at page edges, prefill chunks and k+1 verifications, tables shuffled over the pool."""
    ps = page_size
    shapes = [(0, 1), (ps - 1, 1), (ps, 1), (2 * ps + 3, 1), (ps - 3, 5), (0, min(ps, 24)), (ps, 4)]
    rng = random.Random(seed)
    shapes += [(rng.randrange(0, 2 * ps), rng.choice([1, 2, 7])) for _ in range(2)]
    needs = [-(-(start + n) // ps) for start, n in shapes]
    num_pages = sum(needs) + 2
    pool = list(range(num_pages))
    rng.shuffle(pool)
    seqs, at = [], 0
    for (start, n), need in zip(shapes, needs, strict=True):
        seqs.append(SequenceInput(list(range(n)), start, [PageId(p) for p in pool[at : at + need]]))
        at += need
    rng.shuffle(seqs)
    return ForwardBatch.build(seqs, ps, CPU), num_pages


def random_layers(num_pages: int, page_size: int, head_dim: int, seed: int) -> tuple[KVLayer, KVLayer]:
    """A float layer of N(0, 1) K/V and an int8 layer holding the same values quantized."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_pages, KV_HEADS, page_size, head_dim)
    k, v = torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)
    (qk, sk), (qv, sv) = quantize_kv(k), quantize_kv(v)
    return KVLayer(k, v), KVLayer(qk, qv, sk, sv)


def dequantized(layer: KVLayer, dtype: torch.dtype = torch.float32) -> KVLayer:
    assert layer.k_scale is not None and layer.v_scale is not None
    return KVLayer(dequantize_kv(layer.k, layer.k_scale, dtype), dequantize_kv(layer.v, layer.v_scale, dtype))


def test_torch_write_lands_in_its_slots_within_half_a_step() -> None:
    batch, num_pages = build_batch(16, seed=1)
    _, layer = random_layers(num_pages, 16, 64, seed=1)
    gen = torch.Generator().manual_seed(2)
    k, v = (
        torch.randn(batch.num_tokens, KV_HEADS, 64, generator=gen),
        torch.randn(batch.num_tokens, KV_HEADS, 64),
    )
    TorchPagedAttention().prepare(batch, 6, KV_HEADS, torch.float32).write_kv(layer, k, v)
    pages, offsets = batch.slot_mapping // 16, batch.slot_mapping % 16
    assert layer.k_scale is not None and layer.v_scale is not None
    assert_within_half_step(k, layer.k[pages, :, offsets], layer.k_scale[pages, :, offsets])
    assert_within_half_step(v, layer.v[pages, :, offsets], layer.v_scale[pages, :, offsets])


@pytest.mark.parametrize(("page_size", "per_kv"), [(16, 3), (64, 1)])
def test_torch_attention_int8_close_to_float(page_size: int, per_kv: int) -> None:
    batch, num_pages = build_batch(page_size, seed=page_size + per_kv)
    heads = KV_HEADS * per_kv
    float_layer, int8_layer = random_layers(num_pages, page_size, 64, seed=page_size)
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(batch.num_tokens, n, 64, generator=gen) for n in (heads, KV_HEADS, KV_HEADS))
    attn = TorchPagedAttention().prepare(batch, heads, KV_HEADS, torch.float32)
    attn.write_kv(float_layer, k, v)
    attn.write_kv(int8_layer, k, v)
    expected = attn.attend(q, float_layer)
    got = attn.attend(q, int8_layer)
    # Exactly attention over the dequantized cache (the int8 * scale products are exact in float32) ...
    torch.testing.assert_close(got, attn.attend(q, dequantized(int8_layer)), atol=1e-6, rtol=1e-6)
    # ... and close to attention over the unquantized values.
    err = (got - expected).abs()
    assert float(err.max()) <= INT8_VS_FLOAT_MAX and float(err.mean()) <= INT8_VS_FLOAT_MEAN, (
        float(err.max()),
        float(err.mean()),
    )


def test_kernels_run_interpreted() -> None:
    assert interpreted()


# Triton int8 vs torch int8 on the same bytes: the kernels dequantize as the torch path does, so
# float32 agrees to rounding; bfloat16 as tests/test_triton_attention.py allows for bfloat16.
TRITON_TOLERANCE = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (3e-2, 2e-2)}


@pytest.mark.parametrize(
    ("page_size", "per_kv", "dtype", "tiles"),
    [
        (16, 3, torch.float32, SMALL_SPLITS),
        (64, 1, torch.float32, INTERPRETER_TILES),
        (16, 8, torch.bfloat16, INTERPRETER_TILES),
    ],
    ids=["ps16-gqa3-f32-splits", "ps64-mha-f32", "ps16-gqa8-bf16"],
)
def test_triton_int8_matches_torch_int8(
    page_size: int, per_kv: int, dtype: torch.dtype, tiles: Tiles
) -> None:
    batch, num_pages = build_batch(page_size, seed=page_size * per_kv)
    heads = KV_HEADS * per_kv
    _, base = random_layers(num_pages, page_size, 64, seed=per_kv)
    assert base.k_scale is not None and base.v_scale is not None

    def copy() -> KVLayer:
        assert base.k_scale is not None and base.v_scale is not None
        return KVLayer(base.k.clone(), base.v.clone(), base.k_scale.clone(), base.v_scale.clone())

    ref_layer, tri_layer = copy(), copy()
    gen = torch.Generator().manual_seed(11)
    q, k, v = (
        torch.randn(batch.num_tokens, n, 64, generator=gen).to(dtype) for n in (heads, KV_HEADS, KV_HEADS)
    )
    ref = TorchPagedAttention().prepare(batch, heads, KV_HEADS, dtype)
    ref.write_kv(ref_layer, k, v)
    tri = TritonPagedAttention(tiles).prepare(batch, heads, KV_HEADS, dtype)
    tri.write_kv(tri_layer, k, v)
    # The write kernel quantizes with the same arithmetic: the same bytes and scales.
    assert torch.equal(tri_layer.k, ref_layer.k) and torch.equal(tri_layer.v, ref_layer.v)
    assert tri_layer.k_scale is not None and ref_layer.k_scale is not None
    assert tri_layer.v_scale is not None and ref_layer.v_scale is not None
    assert torch.equal(tri_layer.k_scale, ref_layer.k_scale) and torch.equal(
        tri_layer.v_scale, ref_layer.v_scale
    )
    expected = ref.attend(q, ref_layer)
    got = tri.attend(q, tri_layer)
    assert got.dtype == dtype and got.shape == expected.shape
    atol, rtol = TRITON_TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=rtol)


def test_bytes_per_token_and_capacity_within_a_budget() -> None:
    # SmolLM2-135M: 30 layers, 3 K/V heads of 64.
    shape = CacheShape(num_layers=30, num_pages=1, page_size=64, num_kv_heads=3, head_dim=64)
    f32 = shape.bytes_per_token(torch.float32)
    bf16 = shape.bytes_per_token(torch.bfloat16)
    i8 = shape.bytes_per_token(torch.float32, KVCacheKind.INT8)
    assert (f32, bf16, i8) == (46080, 23040, 11880)  # int8: 64 bytes + a 2-byte scale per head
    assert shape.bytes_per_token(torch.bfloat16, KVCacheKind.INT8) == i8  # independent of the model dtype
    budget = 256 * 2**20
    pages = {k: shape.pages_within(budget, torch.float32, k) for k in KVCacheKind}
    assert pages[KVCacheKind.FLOAT] == budget // (64 * f32)
    assert pages[KVCacheKind.INT8] == budget // (64 * i8)
    assert pages[KVCacheKind.INT8] >= 3.8 * pages[KVCacheKind.FLOAT]
    cache = PagedKVCache(CacheShape(2, 5, 4, 2, 16), torch.float32, CPU, KVCacheKind.INT8)
    assert cache.nbytes == cache.shape.num_slots * cache.bytes_per_token
    assert cache.describe().startswith("int8")


@pytest.mark.parametrize("kind", list(KVCacheKind))
def test_page_copy_carries_scales(kind: KVCacheKind) -> None:
    page_size, heads = 8, 4
    cache = PagedKVCache(CacheShape(2, 6, page_size, KV_HEADS, 16), torch.float32, CPU, kind)
    batch = ForwardBatch.build([SequenceInput(list(range(11)), 0, [PageId(1), PageId(4)])], page_size, CPU)
    attn = TorchPagedAttention().prepare(batch, heads, KV_HEADS, torch.float32)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(11, heads, 16, generator=gen)
    for i in range(2):
        k, v = torch.randn(11, KV_HEADS, 16, generator=gen), torch.randn(11, KV_HEADS, 16, generator=gen) * 5
        attn.write_kv(cache.layer(i), k, v)
    before = [attn.attend(q, cache.layer(i)) for i in range(2)]
    cache.copy_pages([1, 4], [2, 5])
    for t in (cache.k, cache.v, cache.k_scale, cache.v_scale):
        if t is not None:
            assert torch.equal(t[:, [2, 5]], t[:, [1, 4]])
    assert (cache.k_scale is not None) == (kind is KVCacheKind.INT8)
    # The copies answer as the originals did: same K/V, same scales.
    moved = ForwardBatch.build([SequenceInput(list(range(11)), 0, [PageId(2), PageId(5)])], page_size, CPU)
    attn2 = TorchPagedAttention().prepare(moved, heads, KV_HEADS, torch.float32)
    for i in range(2):
        assert torch.equal(attn2.attend(q, cache.layer(i)), before[i])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    folder: Path = tmp_path_factory.mktemp("tiny_kv_int8")
    save_tiny_llama(folder, with_tokenizer=True)
    return load_model(folder, progress=False)


PROMPTS = [tuple((7 * i + 13 * j) % 300 + 3 for j in range(5 + 9 * i)) for i in range(6)]
NEW_TOKENS = 24
# The tiny model's logits reach ~0.8; int8 vs float measured worst 3.4e-3 (teacher-forced), and
# all six prompts gave the same greedy tokens (one may flip on a near tie).
LOGIT_TOLERANCE = 1e-2


def test_tiny_model_generation_with_int8_kv_matches_float(tiny: LoadedModel) -> None:
    def run(kind: KVCacheKind) -> list[tuple[int, ...]]:
        config = GeneratorConfig(
            page_size=8, num_pages=64, scheduler=SchedulerConfig(max_chunk_size=40), kv_cache=kind
        )
        gen = DynamicGenerator(tiny.model, tiny.tokenizer, config)
        assert gen.cache.kind is kind
        try:
            done = gen.generate([JobSpec(p, max_new_tokens=NEW_TOKENS, ignore_eos=True) for p in PROMPTS])
        finally:
            gen.close()
        return [c.token_ids for c in done]

    float_tokens, int8_tokens = run(KVCacheKind.FLOAT), run(KVCacheKind.INT8)
    same = sum(a == b for a, b in zip(float_tokens, int8_tokens, strict=True))
    assert same >= len(PROMPTS) - 1, f"only {same}/{len(PROMPTS)} prompts give the same greedy tokens"

    # Teacher-forced on the float run's tokens: the logits of every position close.
    for prompt, out in zip(PROMPTS, float_tokens, strict=True):
        full = [*prompt, *out]
        table = [PageId(p) for p in range(-(-len(full) // 8))]
        seq = SequenceInput(full, 0, table, logit_positions=len(full))
        batch = ForwardBatch.build([seq], 8, CPU)
        logits = [
            tiny.model.forward(batch, tiny.model.new_cache(len(table), 8, kind)) for kind in KVCacheKind
        ]
        diff = float((logits[0] - logits[1]).abs().max())
        assert diff < LOGIT_TOLERANCE, diff


def test_tiny_model_triton_int8_matches_torch_int8(tmp_path: Path) -> None:
    # The model's seam with the Triton backend (and its fused kernels): head_dim 16, the kernels' least.
    save_tiny_llama(tmp_path, with_tokenizer=True, num_attention_heads=4, num_key_value_heads=2)
    model = load_model(tmp_path, progress=False).model
    triton_model = copy.copy(model)  # shares the weights; only the attention backend differs
    triton_model.attention = select_attention(AttentionKind.TRITON, CPU)
    triton_model.fused = True
    prompts = [list(p) for p in PROMPTS[:4]]
    settings = GenerationSettings(max_new_tokens=4, ignore_eos=True, max_chunk_tokens=32)
    runs = []
    for m in (model, triton_model):
        cache = m.new_cache(num_pages=32, page_size=16, kind=KVCacheKind.INT8)
        runs.append(generate_batch(m, cache, prompts, settings, keep_logits=True))
    for ours, theirs in zip(*runs, strict=True):
        assert ours.token_ids == theirs.token_ids
        for a, b in zip(ours.step_logits, theirs.step_logits, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.timeout(300)
def test_serve_with_int8_kv_cache_reports_it(tmp_path: Path) -> None:
    from dyngen_client import Request, collect
    from tests.service_harness import start_tiny_server
    from tests.tiny_service_model import write_servable_tiny_gguf

    s = start_tiny_server(write_servable_tiny_gguf(tmp_path / "tiny.gguf"), "--kv-cache", "int8")
    try:
        with s.client() as c:
            info = c.model_info()
            assert info.kv_cache.startswith("int8") and "bytes/token" in info.kv_cache
            r = collect(list(c.generate(Request("hello", max_new_tokens=6, ignore_eos=True), timeout=60)))
            assert r.finished.new_tokens == 6
        assert s.wait_log("engine_ready")["kv_cache"] == info.kv_cache
    finally:
        assert s.stop() == 0
