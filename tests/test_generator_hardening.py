"""Generator hardening on a tiny random model: preemption with speculation, bounded scheduler state,
admission retries that neither re-hash nor miscount, caller-minted job ids, cache salts, stats."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from engine import pages
from engine.errors import InvalidRequestError
from engine.generator import DynamicGenerator, GeneratorConfig
from engine.jobs import JobFinished, JobId, JobSpec, new_job_id
from engine.model.llama import LlamaModel
from engine.model.loader import LoadedModel, load_model, open_weight_source
from engine.scheduler import SchedulerConfig
from engine.speculative import DrafterKind, SpeculationConfig
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
