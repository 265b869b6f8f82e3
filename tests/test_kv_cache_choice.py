"""`--kv-cache auto`: which cache kind each model gets."""

from __future__ import annotations

import pytest
import torch

from engine import defaults
from engine.cache.kv_cache import KVCacheKind, choose_kv_cache


def test_auto_is_two_bytes_only_for_a_float32_model_with_quantized_linears() -> None:
    assert choose_kv_cache("auto", torch.float32, quantized=True) is KVCacheKind.FLOAT16
    # int8 where the attention runs it on AMX tiles.
    assert choose_kv_cache("auto", torch.float32, quantized=True, tiles=True) is KVCacheKind.INT8
    assert choose_kv_cache("auto", torch.float32, quantized=False, tiles=True) is KVCacheKind.FLOAT
    # Float weights keep float32 K/V: greedy tokens stay those of the float reference.
    assert choose_kv_cache("auto", torch.float32, quantized=False) is KVCacheKind.FLOAT
    # A 2-byte model's float cache is already as small as float16.
    assert choose_kv_cache("auto", torch.bfloat16, quantized=True) is KVCacheKind.FLOAT


@pytest.mark.parametrize("kind", [k for k in KVCacheKind])
def test_an_explicit_kind_is_taken_as_given(kind: KVCacheKind) -> None:
    for quantized in (False, True):
        assert choose_kv_cache(kind.value, torch.float32, quantized) is kind
        assert choose_kv_cache(kind.value, torch.float32, quantized, tiles=True) is kind


def test_every_offered_choice_resolves() -> None:
    assert defaults.KV_CACHE in defaults.KV_CACHE_KINDS
    for setting in defaults.KV_CACHE_KINDS:
        assert isinstance(choose_kv_cache(setting, torch.float32, True), KVCacheKind)
    with pytest.raises(ValueError):
        choose_kv_cache("float8", torch.float32, True)


def test_a_cache_larger_than_the_machine_is_refused_in_one_line() -> None:
    """The cache's memory is mapped lazily, so the OS may grant far more than the machine has and
    kill the engine later; its size is checked against the machine first."""
    from engine.cache.kv_cache import CacheShape, PagedKVCache
    from engine.errors import CacheTooLargeError, ErrorKind

    shape = CacheShape(num_layers=30, num_pages=10**9, page_size=64, num_kv_heads=3, head_dim=64)
    with pytest.raises(
        CacheTooLargeError, match=r"a KV cache of 64000000000 tokens .* is more than this machine"
    ):
        PagedKVCache(shape, torch.float32, torch.device("cpu"))
    assert CacheTooLargeError.kind is ErrorKind.RESOURCE_EXHAUSTED
