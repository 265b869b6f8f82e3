"""Partial-page prefix hits: the K/V of a shared prefix's last, partly shared page is copied, not recomputed.

Pool lookups on their own, then a tiny random model: the copied tokens must give the same
tokens and log-probabilities as computing everything, with float and int8 caches, for a
donor page that is registered (a finished job's) or still being filled (a running job's).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine.cache.cache_manager import KEEP_COMPUTED
from engine.cache.kv_cache import KVCacheKind
from engine.cache.pages import PagePool, PageState
from engine.completion import Completion
from engine.generator import DynamicGenerator, GeneratorConfig
from engine.ids import PageId
from engine.jobs import JobSpec
from engine.model.loader import LoadedModel, load_model
from engine.scheduler import SchedulerConfig
from tests.tiny_llama import TINY_VOCAB, save_tiny_llama

PS = 8  # page size of the generator tests


def test_find_partial_picks_the_longest_match_on_the_same_parent() -> None:
    pool = PagePool(8, 4)
    first = pool.allocate(3)
    assert first is not None
    a = pool.register_full(first[0], None, [1, 2, 3, 4])
    b = pool.register_full(first[1], a, [5, 6, 7, 8])
    c = pool.register_full(first[2], a, [5, 6, 9, 9])
    assert pool.find_partial(a, [5, 6, 7, 0]) == (b, 3)
    assert pool.find_partial(a, [5, 6, 9]) == (c, 3)
    assert pool.find_partial(a, [7]) is None
    assert pool.find_partial(None, [1, 2, 0]) == (a, 2)
    assert pool.find_partial(b, [1]) is None  # nothing registered on top of b
    assert pool.find_partial(None, [1, 2], salt="tenant") is None  # another salt's chain
    pool.retain([a])
    pool.check_invariants([[a, b], [a, c]])


def test_a_held_cached_page_is_not_evicted_and_goes_back_to_the_cache() -> None:
    pool = PagePool(2, 4)
    pages = pool.allocate(1)
    assert pages is not None
    page = pool.register_full(pages[0], None, [1, 2, 3, 4])
    pool.release([page])
    assert pool.state(page) is PageState.CACHED
    pool.hold(page)
    assert pool.allocate(2) is None  # only the other page is available
    other = pool.allocate(1)
    assert other is not None and other[0] != page
    pool.release([page])
    assert pool.state(page) is PageState.CACHED
    assert pool.find_partial(None, [1, 2, 0]) == (page, 2)
    pool.release(other)
    pool.check_invariants([])
    with pytest.raises(ValueError, match="free"):
        pool.hold(PageId(other[0]))


def test_evicted_pages_leave_the_partial_index() -> None:
    pool = PagePool(2, 2)
    pages = pool.allocate(2)
    assert pages is not None
    a = pool.register_full(pages[0], None, [1, 2])
    b = pool.register_full(pages[1], a, [3, 4])
    pool.release([a, b])
    fresh = pool.allocate(2)  # evicts both
    assert fresh is not None
    assert pool.find_partial(None, [1]) is None
    pool.check_invariants([fresh])


_TINY: LoadedModel | None = None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    global _TINY  # noqa: PLW0603 - one tiny model for the module
    if _TINY is None:
        folder: Path = tmp_path_factory.mktemp("tiny")
        save_tiny_llama(folder, with_tokenizer=True, max_position_embeddings=1024)
        _TINY = load_model(folder, progress=False)
    return _TINY


def generator(tiny: LoadedModel, kv: KVCacheKind, prefix_cache: bool = True) -> DynamicGenerator:
    sched = SchedulerConfig(max_batch_size=16, max_chunk_size=256, prefix_cache=prefix_cache)
    return DynamicGenerator(tiny.model, tiny.tokenizer, GeneratorConfig(PS, 64, scheduler=sched, kv_cache=kv))


def spec(tokens: list[int], salt: str = "") -> JobSpec:
    return JobSpec(tuple(tokens), max_new_tokens=6, ignore_eos=True, return_logprobs=True, cache_salt=salt)


def same_result(got: Completion, want: Completion) -> None:
    assert got.token_ids == want.token_ids
    for g, w in zip(got.logprobs, want.logprobs, strict=True):
        assert g.logprob == pytest.approx(w.logprob, abs=1e-3)


def prompts(seed: int, shared: int, tails: int) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, TINY_VOCAB) for _ in range(shared)]
    return [prefix + [rng.randrange(3, TINY_VOCAB) for _ in range(rng.randint(1, 12))] for _ in range(tails)]


@pytest.mark.parametrize("kv", [KVCacheKind.FLOAT, KVCacheKind.INT8])
@pytest.mark.parametrize("shared", [2 * PS + 3, 3 * PS - 1, 5])
def test_a_later_job_copies_the_shared_part_of_a_finished_jobs_page(
    tiny: LoadedModel, kv: KVCacheKind, shared: int
) -> None:
    first, second = prompts(shared, shared, 2)
    alone = generator(tiny, kv, prefix_cache=False).generate([spec(second)])[0]
    gen = generator(tiny, kv)
    # The first job's output fills the page its prompt ends in, so that page is registered.
    gen.generate([JobSpec(tuple(first), max_new_tokens=2 * PS, ignore_eos=True)])
    before = gen.stats().forwarded_tokens
    got = gen.generate([spec(second)])[0]
    shared_with_first = next(i for i, (x, y) in enumerate(zip(first, second, strict=False)) if x != y)
    assert got.finished.cached_tokens == min(shared_with_first, len(second) - KEEP_COMPUTED)
    assert gen.stats().forwarded_tokens - before == len(second) - got.finished.cached_tokens + 5
    same_result(got, alone)
    gen.check_invariants()
    assert gen.stats().pages_used == 0  # the hold on the copied page was given back


@pytest.mark.parametrize("kv", [KVCacheKind.FLOAT, KVCacheKind.INT8])
def test_jobs_arriving_together_copy_from_the_page_a_running_job_is_filling(
    tiny: LoadedModel, kv: KVCacheKind
) -> None:
    shared = 2 * PS + 5
    ps = prompts(7, shared, 6)
    alone = generator(tiny, kv, prefix_cache=False).generate([spec(p) for p in ps])
    gen = generator(tiny, kv)
    got = gen.generate([spec(p) for p in ps])
    assert got[0].finished.cached_tokens == 0
    # The others wait for the two shared whole pages, then copy the 5 tokens of the third.
    for r, p in zip(got[1:], ps[1:], strict=True):
        assert r.finished.cached_tokens >= min(shared, len(p) - KEEP_COMPUTED)
    for g, w in zip(got, alone, strict=True):
        same_result(g, w)
    gen.check_invariants()
    assert gen.stats().pages_used == 0


def test_other_salts_never_copy(tiny: LoadedModel) -> None:
    a, b = prompts(3, PS + 4, 2)
    gen = generator(tiny, KVCacheKind.FLOAT)
    gen.generate([JobSpec(tuple(a), max_new_tokens=PS, ignore_eos=True, cache_salt="x")])
    got = gen.generate([spec(b, salt="y")])[0]
    assert got.finished.cached_tokens == 0
    same_with_salt = gen.generate([spec(b, salt="x")])[0]
    assert same_with_salt.finished.cached_tokens == PS + 4
