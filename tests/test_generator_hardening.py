"""Generator hardening on a tiny random model: preemption with speculation, bounded scheduler state,
admission retries that neither re-hash nor miscount, caller-minted job ids, cache salts, stats."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from engine.cache import pages
from engine.cache.cache_manager import KEEP_COMPUTED
from engine.errors import InvalidRequestError
from engine.generator import DynamicGenerator, GeneratorConfig
from engine.ids import PageId
from engine.jobs import JobFinished, JobId, JobSpec, new_job_id
from engine.model.llama import LlamaModel
from engine.model.loader import LoadedModel, load_model, open_weight_source
from engine.scheduler import SchedulerConfig
from engine.speculation.speculative import DrafterKind, SpeculationConfig
from tests.tiny_llama import save_tiny_llama


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_hardening")
    save_tiny_llama(folder, with_tokenizer=True, max_position_embeddings=1024)
    return folder


@pytest.fixture(scope="module")
def tiny(tiny_folder: Path) -> LoadedModel:
    return load_model(tiny_folder, progress=False)


@pytest.fixture(scope="module")
def tiny_draft(tiny_folder: Path) -> LlamaModel:
    # The same model's first 2 of 3 layers: proposals are often, not always, the target's choice.
    return LlamaModel.from_source(open_weight_source(tiny_folder), progress=False, num_layers=2)


def make(
    tiny: LoadedModel,
    num_pages: int = 64,
    page_size: int = 8,
    kind: DrafterKind = DrafterKind.NONE,
    draft: LlamaModel | None = None,
    chunk: int = 64,
    batch: int = 16,
) -> DynamicGenerator:
    config = GeneratorConfig(
        page_size=page_size,
        num_pages=num_pages,
        scheduler=SchedulerConfig(max_batch_size=batch, max_chunk_size=chunk),
        speculation=SpeculationConfig(kind, num_draft_tokens=4, max_batch_size=8),
    )
    return DynamicGenerator(tiny.model, tiny.tokenizer, config, draft_model=draft)


def run(gen: DynamicGenerator, specs: Sequence[JobSpec]) -> tuple[dict[JobId, list[int]], int]:
    """Run the specs to the end, checking page invariants at every step; (tokens per job, preemptions)."""
    ids = [gen.enqueue(s) for s in specs]
    tokens: dict[JobId, list[int]] = {i: [] for i in ids}
    preempted: set[JobId] = set()
    for _ in range(5000):
        if not gen.has_work():
            break
        for e in gen.iterate():
            if isinstance(e, JobFinished):
                assert e.error is None, e.error
            elif hasattr(e, "token_ids"):
                tokens[e.job_id].extend(e.token_ids)
        gen.check_invariants()
        preempted.update(j.job_id for j in gen.jobs.values() if j.preemptions)
    assert not gen.has_work(), "jobs never finished"
    return tokens, len(preempted)


# Repetitive prompts, so the n-gram drafter proposes a lot.
SPEC_PROMPTS = [tuple([5 + i, 6, 7, 8] * 5 + [9 + i]) for i in range(6)]


@pytest.mark.parametrize("kind", [DrafterKind.NGRAM, DrafterKind.DRAFT_MODEL])
def test_preemption_with_speculation_gives_the_plain_greedy_tokens(
    tiny: LoadedModel, tiny_draft: LlamaModel, kind: DrafterKind
) -> None:
    specs = [JobSpec(p, max_new_tokens=28, ignore_eos=True) for p in SPEC_PROMPTS]
    plain, plain_preempted = run(make(tiny, num_pages=128), specs)
    assert plain_preempted == 0
    # 6 jobs of 21 + 28 tokens need ~42 pages of 8; 16 pages force preemption and recompute.
    gen = make(tiny, num_pages=16, kind=kind, draft=tiny_draft)
    spec_tokens, preempted = run(gen, specs)
    assert preempted > 0
    assert list(spec_tokens.values()) == list(plain.values())
    stats = gen.stats()
    assert stats.accepted_draft_tokens + stats.rejected_draft_tokens > 0
    assert stats.pages_used == 0 and stats.running == 0 and stats.queued == 0


# -- the scheduler forgets what it no longer needs -----------------------------------------------


def test_inflight_prefix_entries_leave_with_their_jobs(tiny: LoadedModel) -> None:
    gen = make(tiny, num_pages=24, page_size=4, chunk=32, batch=4)
    # Unique prompts of several full pages each; a small pool also preempts some of them.
    specs = [
        JobSpec(tuple(3 + (i * 7 + k) % 300 for k in range(17 + i % 9)), max_new_tokens=6) for i in range(40)
    ]
    ids = [gen.enqueue(s) for s in specs[:20]]
    for _ in range(3):
        gen.iterate()
    gen.cancel(ids[-1])  # one queued or running job cancelled
    for s in specs[20:]:
        gen.enqueue(s)
    steps = 0
    while gen.has_work():
        gen.iterate()
        # Only running jobs' uncomputed prompt pages may be in flight.
        bound = sum(len(j.pages) for j in gen.scheduler.running)
        assert gen.scheduler.inflight_pages() <= bound
        steps += 1
        assert steps < 5000
    assert gen.scheduler.inflight_pages() == 0


# -- admission retries: hashed once, counted once ------------------------------------------------


def test_a_queued_job_is_hashed_once_and_counted_once(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[int, ...]] = []
    real = pages.chain_hash

    def counting(parent: int | None, tokens: Sequence[int]) -> int:
        calls.append(tuple(tokens))
        return real(parent, tokens)

    monkeypatch.setattr(pages, "chain_hash", counting)  # every chain hash goes through here
    gen = make(tiny, num_pages=16, page_size=8)
    a = JobSpec(tuple(range(3, 63)), max_new_tokens=20, ignore_eos=True)  # 8 pages, then up to 10
    b_prompt = tuple(range(100, 164))  # 8 pages: cannot fit beside a (one spare page per running job)
    b = JobSpec(b_prompt, max_new_tokens=4, ignore_eos=True)
    a_id, b_id = gen.enqueue(a), gen.enqueue(b)
    waited = 0
    while b_id not in [j.job_id for j in gen.scheduler.running]:
        gen.iterate()
        waited += 1
        assert waited < 100
    assert waited > 5  # b failed admission at many steps
    assert calls.count(b_prompt[:8]) <= 2  # its page hashes are kept on the job, not recomputed per try
    while gen.has_work():
        gen.iterate()
    s = gen.pool.stats()
    assert s.prefix_lookups == 2  # one per admission, not per failed try
    assert s.prefix_query_tokens == (60 - KEEP_COMPUTED) + (64 - KEEP_COMPUTED)
    assert s.prefix_hit_tokens == 0
    # The same prompt again: 7 of its 8 pages hit and the 8th is copied but for the last tokens
    # (always computed).
    again = gen.generate([JobSpec(b_prompt, max_new_tokens=2)])[0]
    assert again.finished.cached_tokens == 64 - KEEP_COMPUTED
    s = gen.pool.stats()
    k = KEEP_COMPUTED
    assert (s.prefix_lookups, s.prefix_query_tokens, s.prefix_hit_tokens) == (
        3,
        60 - k + 2 * (64 - k),
        64 - k,
    )
    assert gen.stats().prefix_hit_tokens == 64 - KEEP_COMPUTED and a_id not in gen.jobs


def test_jobs_that_cannot_fit_even_with_every_page_cached_skip_the_lookup(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = make(tiny, num_pages=16, page_size=8)
    lookups: list[int] = []
    real = gen.pool.find_prefix

    def find_prefix(token_ids: Sequence[int], *args: object, **kwargs: object) -> list[PageId]:
        lookups.append(len(token_ids))
        return real(token_ids, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(gen.pool, "find_prefix", find_prefix)
    big = gen.enqueue(JobSpec(tuple(range(3, 115)), max_new_tokens=10, ignore_eos=True))  # 14 pages, then 16
    for _ in range(3):  # two prefill chunks, then its first decode step takes its 15th page
        gen.iterate()
    assert len(gen.jobs[big].pages) == 15
    for i in range(5):
        gen.enqueue(JobSpec(tuple(range(150 + i, 190 + i)), max_new_tokens=2))
    lookups.clear()
    for _ in range(5):
        gen.iterate()
    assert lookups == []  # 5 pages each, at most 4 of them cached: never fits in 1 free page
    while gen.has_work():
        gen.iterate()
    assert gen.stats().failed_jobs == 0 and gen.pool.stats().prefix_lookups == 6


# -- caller-minted job ids -----------------------------------------------------------------------


def test_enqueue_uses_the_callers_job_id_and_refuses_one_in_use(tiny: LoadedModel) -> None:
    gen = make(tiny)
    mine = new_job_id()
    assert gen.enqueue(JobSpec((5, 6, 7), max_new_tokens=3), job_id=mine) == mine
    assert mine in gen.jobs
    with pytest.raises(InvalidRequestError, match="in use"):
        gen.enqueue(JobSpec((5, 6, 7), max_new_tokens=3), job_id=mine)
    assert len(gen.jobs) == 1 and len(gen.scheduler.queue) == 1
    minted = gen.enqueue(JobSpec((5, 6, 7), max_new_tokens=3))
    assert minted != mine and len(minted) == 32
    with pytest.raises(InvalidRequestError, match="job id"):
        gen.enqueue(JobSpec((5, 6, 7), max_new_tokens=3), job_id=JobId(""))
    while gen.has_work():
        gen.iterate()
    # A finished job's id may be used again (the generator forgot it).
    assert gen.enqueue(JobSpec((5, 6, 7), max_new_tokens=3), job_id=mine) == mine


# -- cache salts ---------------------------------------------------------------------------------


def test_cache_salts_keep_tenants_prefixes_apart(tiny: LoadedModel) -> None:
    gen = make(tiny, num_pages=64, page_size=8)
    prompt = tuple(range(10, 60))

    def cached(salt: str) -> int:
        return gen.generate([JobSpec(prompt, max_new_tokens=3, cache_salt=salt)])[0].finished.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # same prompt, other salt: nothing shared
    assert cached("") == 0
    assert cached("tenant-a") == 48  # same salt: 6 full pages hit
    assert cached("") == 48
    gen.check_invariants()


def test_cache_salts_never_share_live_pages(tiny: LoadedModel) -> None:
    """Jobs arriving together with the same prompt: only same-salt jobs share (wait for or dedup) pages."""
    gen = make(tiny, num_pages=64, page_size=8)
    prompt = tuple(range(10, 60))
    salts = ["x", "y", "x", ""]
    ids = [gen.enqueue(JobSpec(prompt, max_new_tokens=3, cache_salt=s)) for s in salts]
    finished: dict[JobId, JobFinished] = {}
    while gen.has_work():
        for e in gen.iterate():
            if isinstance(e, JobFinished):
                finished[e.job_id] = e
            # Pages held by two running jobs belong to jobs of the same salt.
            holders: dict[int, set[str]] = {}
            for j in gen.jobs.values():
                for p in j.pages:
                    holders.setdefault(p, set()).add(j.spec.cache_salt)
            assert all(len(s) == 1 for s in holders.values())
        gen.check_invariants()
    tokens = {i: finished[i].cached_tokens for i in ids}
    assert tokens[ids[0]] == 0 and tokens[ids[1]] == 0 and tokens[ids[3]] == 0
    # Waited for the first x job's pages, then hit them (48) and copied from its last page all but the
    # tokens every admission computes.
    assert tokens[ids[2]] == 50 - KEEP_COMPUTED


def test_cache_salt_is_bounded(tiny: LoadedModel) -> None:
    gen = make(tiny)
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        gen.enqueue(JobSpec((5, 6), cache_salt="s" * 257))
    gen.enqueue(JobSpec((5, 6), max_new_tokens=2, cache_salt="s" * 256))


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (JobSpec((1.5, 2.0)), "prompt_ids"),  # type: ignore[arg-type]
        (JobSpec("hello"), "prompt_ids"),  # type: ignore[arg-type]
        (JobSpec((5, 6), max_new_tokens=2.5), "max_new_tokens"),  # type: ignore[arg-type]
        (JobSpec((5, 6), stop_strings="the"), "stop_strings"),  # type: ignore[arg-type]
        (JobSpec((5, 6), tenant="t" * 300), "tenant"),
    ],
)
def test_values_of_the_wrong_type_are_the_callers_error_at_enqueue(
    tiny: LoadedModel, spec: JobSpec, field: str
) -> None:
    """Not a range check passed (a float id), nor a failure deep in the forward counted as the
    engine's: InvalidRequestError naming the field, and nothing queued."""
    gen = make(tiny)
    with pytest.raises(InvalidRequestError) as refused:
        gen.enqueue(spec)
    assert refused.value.field == field
    assert not gen.jobs and not gen.has_work()


def test_generate_is_all_or_nothing(tiny: LoadedModel) -> None:
    """A refused spec leaves none of the others queued (the caller never learns their ids), and the
    error says which spec it was."""
    gen = make(tiny, num_pages=16)
    specs = [
        JobSpec((5, 6), max_new_tokens=4),
        JobSpec((7, 8), max_new_tokens=4),
        JobSpec((9,), max_new_tokens=0),
    ]
    with pytest.raises(InvalidRequestError, match="max_new_tokens") as refused:
        gen.generate(specs)
    assert refused.value.spec_index == 2
    assert not gen.jobs and not gen.has_work() and gen.stats().pages_used == 0
    done = gen.generate([JobSpec((5, 6), max_new_tokens=3)])
    assert done[0].finished.new_tokens == 3 and not gen.jobs


# -- stats ---------------------------------------------------------------------------------------


def test_stats_show_no_pages_used_when_idle(tiny: LoadedModel) -> None:
    gen = make(tiny, num_pages=16)
    gen.generate([JobSpec(tuple(range(3, 40)), max_new_tokens=5), JobSpec((7, 8, 9), max_new_tokens=4)])
    s = gen.stats()
    assert (s.running, s.queued, s.pages_used, s.failed_jobs) == (0, 0, 0, 0)
    assert s.pages_free + s.pages_cached == 16
