"""The Triton paged-attention kernels against the torch path, on the CPU under the Triton interpreter.

TRITON_INTERPRET is read when a kernel is decorated, i.e. when kernels.triton_* is first
imported, so it is set here before that import (pytest imports every test module at
collection, before any test runs; nothing else in the process imports those modules).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import random
from dataclasses import dataclass

import pytest
import torch

from engine.forward_batch import ForwardBatch, SequenceInput
from engine.ids import PageId
from kernels.attention.backend import AttentionKind, resolve_attention, select_attention
from kernels.attention.kv_layer import KVLayer
from kernels.attention.torch_attention import TorchPagedAttention
from kernels.attention.triton_attention import (
    GPU_TILES,
    INTERPRETER_TILES,
    PagedMeta,
    Tiles,
    TritonPagedAttention,
    interpreted,
    paged_attention,
)
from kernels.native.native_library import native_library

KV_HEADS = 2
# The GPU tile sizes, with decode splits short enough that sequences of a few pages span
# several; and the interpreter's own larger tiles.
SMALL_SPLITS = Tiles(block_n=GPU_TILES.block_n, block_rows=GPU_TILES.block_rows, split_len=64)

# (atol, rtol) of the kernel's output against the torch path run in float32 on the same
# (rounded) inputs. Outputs are O(1); the low-precision bounds are a few units in the last
# place of the output plus the probabilities rounded to the input dtype before P @ V.
TOLERANCE = {
    torch.float32: (2e-5, 1e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 2e-2),
}


def test_kernels_run_interpreted() -> None:
    assert interpreted(), (
        "TRITON_INTERPRET=1 must be set before kernels.attention.triton_attention is imported"
    )


@dataclass(frozen=True)
class Case:
    page_size: int
    per_kv: int
    head_dim: int
    dtype: torch.dtype
    tiles: Tiles = SMALL_SPLITS


def shapes(page_size: int, seed: int) -> list[tuple[int, int]]:
    """(tokens already cached, new tokens) per sequence: page edges, single tokens, k+1 verification."""
    ps = page_size
    fixed = [
        (0, 1),  # a one-token sequence
        (ps - 1, 1),  # decode filling a page to its end
        (ps, 1),  # decode starting a new page
        (2 * ps + 3, 1),  # long decode: several splits at page size 64 and 256
        (ps - 3, 5),  # chunk crossing a page boundary
        (0, min(ps, 40)),  # first chunk of a prompt
        (ps, 4),  # k+1 = 4 verification tokens starting a page
    ]
    rng = random.Random(seed)
    extra = [(rng.randrange(0, 2 * ps), rng.choice([1, 1, 2, 7])) for _ in range(3)]
    return fixed + extra


def build_batch(page_size: int, seed: int) -> tuple[ForwardBatch, int]:
    seqs_shape = shapes(page_size, seed)
    needs = [-(-(start + n) // page_size) for start, n in seqs_shape]
    num_pages = sum(needs) + 3
    pool = list(range(num_pages))
    random.Random(seed).shuffle(pool)  # tables point anywhere, in any order
    seqs, at = [], 0
    for (start, n), need in zip(seqs_shape, needs, strict=True):
        table = [PageId(p) for p in pool[at : at + need]]
        at += need
        seqs.append(SequenceInput(list(range(n)), start, table))
    random.Random(seed + 1).shuffle(seqs)  # decode and multi-query sequences interleaved
    return ForwardBatch.build(seqs, page_size, torch.device("cpu")), num_pages


def run_case(case: Case, seed: int) -> None:
    batch, num_pages = build_batch(case.page_size, seed)
    heads = KV_HEADS * case.per_kv
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(case.dtype)

    cache_shape = (num_pages, KV_HEADS, case.page_size, case.head_dim)
    k_cache, v_cache = rand(*cache_shape), rand(*cache_shape)
    tokens = batch.num_tokens
    q, k, v = (
        rand(tokens, heads, case.head_dim),
        rand(tokens, KV_HEADS, case.head_dim),
        rand(tokens, KV_HEADS, case.head_dim),
    )

    ref_k, ref_v = k_cache.float(), v_cache.float()
    ref = TorchPagedAttention().prepare(batch, heads, KV_HEADS, torch.float32)
    ref.write_kv(KVLayer(ref_k, ref_v), k.float(), v.float())
    expected = ref.attend(q.float(), KVLayer(ref_k, ref_v))

    ours = TritonPagedAttention(case.tiles).prepare(batch, heads, KV_HEADS, case.dtype)
    ours.write_kv(KVLayer(k_cache, v_cache), k, v)
    # The write is a copy: bit-identical to the torch path's index_copy_.
    assert torch.equal(k_cache.float(), ref_k) and torch.equal(v_cache.float(), ref_v)
    # And lands where the layout says, independently of the torch path: slot s -> [s // ps, :, s % ps].
    pages, offsets = batch.slot_mapping // case.page_size, batch.slot_mapping % case.page_size
    assert torch.equal(k_cache[pages, :, offsets], k) and torch.equal(v_cache[pages, :, offsets], v)
    got = ours.attend(q, KVLayer(k_cache, v_cache))
    assert got.dtype == case.dtype and got.shape == expected.shape
    atol, rtol = TOLERANCE[case.dtype]
    torch.testing.assert_close(got.float(), expected, atol=atol, rtol=rtol)


ALL_LAYOUTS = [(ps, g, d) for ps in (16, 64, 256) for g in (1, 3, 8) for d in (64, 128)]


@pytest.mark.parametrize(("page_size", "per_kv", "head_dim"), ALL_LAYOUTS)
def test_float32_matches_torch(page_size: int, per_kv: int, head_dim: int) -> None:
    run_case(Case(page_size, per_kv, head_dim, torch.float32), seed=page_size * 10 + per_kv + head_dim)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("page_size", "per_kv", "head_dim"), [(16, 3, 64), (64, 8, 128), (256, 1, 64)])
def test_half_precision_matches_torch(page_size: int, per_kv: int, head_dim: int, dtype: torch.dtype) -> None:
    run_case(Case(page_size, per_kv, head_dim, dtype), seed=page_size + per_kv)


@pytest.mark.parametrize("page_size", [16, 256])
def test_interpreter_tiles_match_torch(page_size: int) -> None:
    # The tile sizes the whole-model check runs with.
    run_case(Case(page_size, 3, 64, torch.float32, INTERPRETER_TILES), seed=page_size + 5)


def test_sequence_without_keys_gives_zeros_and_leaves_others_alone() -> None:
    # The forward batch never holds such a sequence; the kernels still must not produce NaN.
    page_size, heads, head_dim = 16, 6, 64
    batch = ForwardBatch.build(
        [SequenceInput([1], 20, [PageId(0), PageId(1)]), SequenceInput([1, 2, 3], 5, [PageId(2)])],
        page_size,
        torch.device("cpu"),
    )
    meta = PagedMeta.build(batch, torch.device("cpu"))
    empty = PagedMeta(
        page_tables=torch.cat([meta.page_tables, meta.page_tables[:1]]),
        seq_lens=torch.cat([meta.seq_lens, torch.tensor([0], dtype=torch.int32)]),
        query_lens=torch.cat([meta.query_lens, torch.tensor([1], dtype=torch.int32)]),
        query_starts=torch.cat([meta.query_starts, torch.tensor([4], dtype=torch.int32)]),
        decode_ids=torch.tensor([0, 2], dtype=torch.int32),
        decode_rows=torch.tensor([0, 4], dtype=torch.int32),
        multi_ids=meta.multi_ids,
        page_size=page_size,
        max_decode_len=meta.max_decode_len,
        max_multi_query=meta.max_multi_query,
    )
    k_cache, v_cache = torch.randn(3, 2, page_size, head_dim), torch.randn(3, 2, page_size, head_dim)
    q = torch.randn(5, heads, head_dim)
    cache = KVLayer(k_cache, v_cache)
    with_empty = paged_attention(q, cache, empty, tiles=Tiles(split_len=32))
    alone = paged_attention(q[:4], cache, meta, tiles=Tiles(split_len=32))
    assert torch.equal(with_empty[4], torch.zeros(heads * head_dim))
    assert torch.equal(with_empty[:4], alone)


def test_split_count_does_not_change_the_result() -> None:
    batch, num_pages = build_batch(16, seed=3)
    k_cache, v_cache = torch.randn(num_pages, 2, 16, 64), torch.randn(num_pages, 2, 16, 64)
    q = torch.randn(batch.num_tokens, 6, 64)
    meta = PagedMeta.build(batch, torch.device("cpu"))
    cache = KVLayer(k_cache, v_cache)
    one = paged_attention(q, cache, meta, tiles=Tiles(split_len=1024))
    many = paged_attention(q, cache, meta, tiles=Tiles(split_len=32))
    torch.testing.assert_close(one, many, atol=1e-6, rtol=1e-6)


def test_strided_cache_view_matches_contiguous() -> None:
    # The kernels address the cache through its page, head and offset strides: a
    # [pages, page_size, kv_heads, head_dim] buffer viewed as [pages, kv_heads, page_size,
    # head_dim] must give what the contiguous layout gives.
    batch, num_pages = build_batch(16, seed=4)
    view_k = torch.zeros(num_pages, 16, 2, 64).transpose(1, 2)
    view_v = torch.zeros(num_pages, 16, 2, 64).transpose(1, 2)
    dense_k, dense_v = torch.zeros(num_pages, 2, 16, 64), torch.zeros(num_pages, 2, 16, 64)
    k, v = torch.randn(batch.num_tokens, 2, 64), torch.randn(batch.num_tokens, 2, 64)
    q = torch.randn(batch.num_tokens, 6, 64)
    attn = TritonPagedAttention(SMALL_SPLITS).prepare(batch, 6, 2, torch.float32)
    view, dense = KVLayer(view_k, view_v), KVLayer(dense_k, dense_v)
    attn.write_kv(view, k, v)
    attn.write_kv(dense, k, v)
    assert torch.equal(view_k, dense_k) and torch.equal(view_v, dense_v)
    assert torch.equal(attn.attend(q, view), attn.attend(q, dense))


def test_dispatch() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    native = native_library() is not None
    assert resolve_attention(AttentionKind.AUTO, cpu) is (
        AttentionKind.NATIVE if native else AttentionKind.TORCH
    )
    assert resolve_attention(AttentionKind.AUTO, cuda) is AttentionKind.TRITON  # triton imports here
    assert resolve_attention(AttentionKind.TORCH, cuda) is AttentionKind.TORCH
    assert resolve_attention(AttentionKind.TRITON, cpu) is AttentionKind.TRITON
    assert isinstance(select_attention(AttentionKind.TORCH, cpu), TorchPagedAttention)
    assert isinstance(select_attention(AttentionKind.TRITON, cpu), TritonPagedAttention)


@pytest.mark.parametrize("page_size", [16, 64])
def test_float16_cache_under_float32_queries_matches_torch(page_size: int) -> None:
    """KVCacheKind.FLOAT16: the write rounds to float16 as torch's does; attention reads it in float32."""
    batch, num_pages = build_batch(page_size, seed=page_size + 11)
    heads, head_dim = KV_HEADS * 3, 64
    gen = torch.Generator().manual_seed(page_size)
    shape = (num_pages, KV_HEADS, page_size, head_dim)
    k_cache, v_cache = torch.randn(*shape, generator=gen).half(), torch.randn(*shape, generator=gen).half()
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    q = torch.randn(batch.num_tokens, heads, head_dim, generator=gen)
    k, v = (torch.randn(batch.num_tokens, KV_HEADS, head_dim, generator=gen) for _ in range(2))
    ref = TorchPagedAttention().prepare(batch, heads, KV_HEADS, torch.float32)
    ref.write_kv(KVLayer(ref_k, ref_v), k, v)
    expected = ref.attend(q, KVLayer(ref_k, ref_v))
    ours = TritonPagedAttention().prepare(batch, heads, KV_HEADS, torch.float32)
    ours.write_kv(KVLayer(k_cache, v_cache), k, v)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    got = ours.attend(q, KVLayer(k_cache, v_cache))
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
