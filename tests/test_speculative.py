"""Speculative decoding: exact greedy output, exact sampled distribution, pages intact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.cache.kv_cache import PagedKVCache
from engine.errors import InvalidRequestError
from engine.forward_batch import ForwardBatch, SequenceInput
from engine.generator import DynamicGenerator, GeneratorConfig
from engine.ids import PageId
from engine.jobs import JobFinished, JobId, JobSpec, SamplingSettings, StopReason, TokensGenerated
from engine.model.llama import LlamaModel
from engine.model.loader import LoadedModel, WeightDtype, load_model, open_weight_source
from engine.model.tokenizer import ChatMessage
from engine.scheduler import SchedulerConfig
from engine.speculation.draft_policy import StepCost
from engine.speculation.speculative import (
    DrafterKind,
    DraftModelDrafter,
    DraftRequest,
    NgramDrafter,
    SpeculationConfig,
    evidence_class,
)
from tests.conftest import PARITY_PROMPTS
from tests.tiny_llama import save_tiny_llama

WORKLOADS = Path(__file__).resolve().parents[2] / "shared" / "workloads.json"


def spec_config(kind: DrafterKind, batch: int = 8) -> GeneratorConfig:
    return GeneratorConfig(
        page_size=16,
        num_pages=256,
        speculation=SpeculationConfig(kind, num_draft_tokens=4, max_batch_size=batch),
    )


# -- n-gram drafter ------------------------------------------------------------------------------


def test_ngram_proposes_the_continuation_of_the_longest_match() -> None:
    d = NgramDrafter(max_ngram=3)

    tokens = [1, 2, 3, 4, 9, 9, 2, 3]
    (draft,) = d.propose([DraftRequest(JobId("a"), tokens, [], 3)])
    assert draft.tokens == (4, 9, 9)  # "2 3" was followed by "4 9 9"
    (none,) = d.propose([DraftRequest(JobId("b"), [5, 6, 7], [], 3)])
    assert none.tokens == ()  # nothing repeats: no blind guess
    d.forget(JobId("a"))
    d.forget(JobId("b"))


def test_ngram_follows_the_place_whose_match_reaches_furthest_back() -> None:
    """Of the places a short n-gram continued, the one whose match with the sequence's end is
    longest proposes: the text being copied, not the latest repetition of a common n-gram."""
    d = NgramDrafter(max_ngram=2)
    copied = [7, 8, 5, 6, 1, 2, 3]  # "5 6" continued with "1 2 3" after "7 8"
    other = [9, 5, 6, 4, 4, 4]  # ... and later with "4 4 4" after "9"
    tokens = [*copied, *other, 7, 8, 5, 6]  # the end copies the first place
    (draft,) = d.propose([DraftRequest(JobId("a"), tokens, [], 3)])
    assert draft.tokens == (1, 2, 3)
    tokens = [*copied, *other, 9, 5, 6]  # the end copies the second
    (draft,) = d.propose([DraftRequest(JobId("b"), tokens, [], 3)])
    assert draft.tokens == (4, 4, 4)


def test_ngram_continues_a_loop_past_the_sequences_end() -> None:
    """A match whose continuation reaches the end copies on through its own proposal: a text
    looping with period 3 is proposed for as many tokens as asked, not cut at the end."""
    d = NgramDrafter(max_ngram=3)
    tokens = [5, 1, 2, 3, 1, 2, 3, 1, 2]  # "1 2" last continued with "3" two tokens before the end
    (draft,) = d.propose([DraftRequest(JobId("a"), tokens, [], 7)])
    assert draft.tokens == (3, 1, 2, 3, 1, 2, 3)
    (short,) = d.propose([DraftRequest(JobId("b"), [4, 4], [], 5)])
    assert short.tokens == (4, 4, 4, 4, 4)  # period 1


def test_ngram_evidence_marks_where_the_places_part_ways() -> None:
    """Each draft token's evidence class counts the places that continued the matched n-gram as
    the draft does up to that token: all of them while the text is shared, fewer after a branch."""
    d = NgramDrafter(max_ngram=1)
    # "5" continued four times; all four go on "6 7", then two ways: "8" (the latest, proposed) and "9".
    tokens = [5, 6, 7, 9, 5, 6, 7, 9, 5, 6, 7, 8, 5, 6, 7, 8, 5]
    (draft,) = d.propose([DraftRequest(JobId("a"), tokens, [], 4)])
    assert draft.tokens == (6, 7, 8, 5)
    all_four, two_of_four = evidence_class(4, 4, 1), evidence_class(4, 2, 1)
    assert draft.evidence == (all_four, all_four, two_of_four, two_of_four)
    assert len({evidence_class(p, a, m) for p in range(1, 5) for a in range(1, p + 1) for m in (1, 8)}) == 20


# -- generator on a tiny model: rejections, pages, limits ----------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    folder = tmp_path_factory.mktemp("tiny_spec")
    save_tiny_llama(folder, with_tokenizer=True, max_position_embeddings=1024)
    return load_model(folder, progress=False)


def test_pages_stay_consistent_through_rejections_and_cancel(tiny: LoadedModel) -> None:
    gen = DynamicGenerator(tiny.model, tiny.tokenizer, spec_config(DrafterKind.NGRAM))
    # Repetitive prompts make the n-gram drafter propose a lot; a random model rejects most of it.
    prompts = [tuple([5, 6, 7, 8] * 6 + [i + 9]) for i in range(4)]
    ids = [gen.enqueue(JobSpec(p, max_new_tokens=37, ignore_eos=True)) for p in prompts]
    finished: dict[JobId, JobFinished] = {}
    steps = 0
    while gen.has_work():
        for e in gen.iterate():
            if isinstance(e, JobFinished):
                finished[e.job_id] = e
        gen.check_invariants()
        steps += 1
        if steps == 6:
            gen.cancel(ids[0])
    assert finished[ids[0]].stop_reason is StopReason.CANCELLED
    for job in ids[1:]:
        assert finished[job].new_tokens == 37  # max_new_tokens exact, not k early or late
    stats = gen.stats()
    assert stats.accepted_draft_tokens + stats.rejected_draft_tokens > 0
    assert stats.rejected_draft_tokens > 0
    assert stats.pages_used == 0
    assert isinstance(gen.drafter, NgramDrafter) and gen.drafter.tracked_jobs() == 0


def test_the_warmups_outputs_are_no_text_for_drafts_to_copy(tiny: LoadedModel) -> None:
    """Warm-up runs ~70 throwaway jobs of BOS tokens; none of them reaches the n-gram corpus, and
    a real job's output afterwards does."""
    config = GeneratorConfig(
        page_size=16, num_pages=256, speculation=SpeculationConfig(DrafterKind.NGRAM, num_draft_tokens=4)
    )
    gen = DynamicGenerator(tiny.model, tiny.tokenizer, config)
    gen.warmup()
    assert gen.speculation.policy is not None  # warm-up did run its timed jobs
    drafter = gen.drafter
    assert isinstance(drafter, NgramDrafter) and drafter.corpus is not None
    assert drafter.corpus.tokens + drafter.corpus.queued_tokens == 0
    gen.generate([JobSpec((5, 6, 7, 8), max_new_tokens=6, ignore_eos=True)])
    assert drafter.corpus.queued_tokens > 0
    gen.close()


def test_adaptive_drafts_wait_while_a_prompt_is_queued_or_prefilling(tiny: LoadedModel) -> None:
    config = GeneratorConfig(
        page_size=16,
        num_pages=256,
        scheduler=SchedulerConfig(max_chunk_size=64, prefill_while_decoding=16),
        speculation=SpeculationConfig(DrafterKind.NGRAM, num_draft_tokens=4),
    )
    gen = DynamicGenerator(tiny.model, tiny.tokenizer, config)
    gen.speculation.measured(StepCost((1, 64), (1.0, 1.0)))  # a flat table: every likely draft pays

    def budget(job: JobId) -> int:
        return next(j.draft_budget for j in gen.scheduler.running if j.job_id == job)

    def decoding(job: JobId) -> bool:
        return next(j.decoding for j in gen.scheduler.running if j.job_id == job)

    a = gen.enqueue(JobSpec(tuple([5, 6, 7, 8] * 6), max_new_tokens=300, ignore_eos=True))
    gen.iterate()  # its prompt
    gen.iterate()
    assert budget(a) > 0  # alone and decoding: it drafts
    b = gen.enqueue(JobSpec(tuple(range(10, 110)), max_new_tokens=300, ignore_eos=True))
    gen.iterate()  # b waits in the queue when this step is planned
    assert budget(a) == 0
    steps = 0
    while not decoding(b):  # b's prompt goes in slices of 16 beside a's decode steps
        gen.iterate()
        assert budget(a) == 0
        steps += 1
    assert steps >= 5
    gen.iterate()
    assert budget(a) > 0 and budget(b) > 0  # no prompt waits: both draft again
    for job in (a, b):
        gen.cancel(job)
    while gen.has_work():
        gen.iterate()
    gen.close()


def test_seeded_sampling_gives_the_same_tokens_with_and_without_drafts(tmp_path: Path) -> None:
    ref = save_tiny_llama(tmp_path, with_tokenizer=True, max_position_embeddings=1024)
    with torch.no_grad():
        ref.lm_head.weight.mul_(40.0)  # peaky distributions: outputs repeat, so drafts are kept too
    ref.save_pretrained(str(tmp_path))
    peaky = load_model(tmp_path, progress=False)
    specs = [
        JobSpec(
            tuple([5, 6, 7, 8] * 6 + [i + 9]),
            max_new_tokens=60,
            ignore_eos=True,
            sampling=SamplingSettings(temperature=0.8, top_p=0.95, seed=i),
        )
        for i in range(4)
    ]
    plain = DynamicGenerator(peaky.model, peaky.tokenizer, spec_config(DrafterKind.NONE)).generate(specs)
    gen = DynamicGenerator(peaky.model, peaky.tokenizer, spec_config(DrafterKind.NGRAM))
    drafted = gen.generate(specs)
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    stats = gen.stats()
    assert stats.accepted_draft_tokens > 0 and stats.rejected_draft_tokens > 0


def test_draft_model_with_another_vocabulary_is_refused(tiny: LoadedModel, tmp_path: Path) -> None:
    save_tiny_llama(tmp_path, vocab_size=256)
    other = LlamaModel.from_source(open_weight_source(tmp_path), progress=False)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        DynamicGenerator(tiny.model, tiny.tokenizer, spec_config(DrafterKind.DRAFT_MODEL), draft_model=other)


# -- the real model: greedy output identical with each drafter -----------------------------------


@pytest.fixture(scope="module")
def draft(smollm: LoadedModel) -> LoadedModel:
    # A cheaper copy of the shipped model: its first 10 of 30 layers.
    return load_model(smollm.path, WeightDtype.FLOAT32, progress=False, num_layers=10)


@pytest.mark.slow
def test_greedy_output_identical_with_each_drafter_amid_other_jobs(
    smollm: LoadedModel, draft: LoadedModel
) -> None:
    repeat = json.loads(WORKLOADS.read_text())["W3"]["user_messages"][0]
    texts = [repeat, *PARITY_PROMPTS[:3]]
    greedy = [
        JobSpec(
            tuple(smollm.tokenizer.encode_chat([ChatMessage("user", t)])), max_new_tokens=128, ignore_eos=True
        )
        for t in texts
    ]
    # Neighbours that do not speculate the same way: a sampled job and a penalised one.
    neighbours = [
        JobSpec(greedy[1].prompt_ids, max_new_tokens=40, sampling=SamplingSettings(temperature=0.8, seed=5)),
        JobSpec(greedy[2].prompt_ids, max_new_tokens=40, sampling=SamplingSettings(repetition_penalty=1.3)),
    ]
    plain = DynamicGenerator(smollm.model, smollm.tokenizer, spec_config(DrafterKind.NONE)).generate(
        [*greedy, *neighbours]
    )
    for kind in (DrafterKind.NGRAM, DrafterKind.DRAFT_MODEL):
        gen = DynamicGenerator(smollm.model, smollm.tokenizer, spec_config(kind), draft_model=draft.model)
        results = gen.generate([*greedy, *neighbours])
        # The seeded neighbour too: each position draws its own uniform, whatever the drafts.
        for a, b in zip(plain, results, strict=True):
            assert b.token_ids == a.token_ids, kind
        assert gen.stats().accepted_draft_tokens > 0, kind
        gen.check_invariants()


def chi_square_critical(dof: int, z: float = 3.09) -> float:
    """Upper 0.1% point of chi-square (Wilson-Hilferty), to keep scipy out of the test deps."""
    return float(dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3)


def test_speculatively_sampled_token_follows_the_target_distribution(tmp_path: Path) -> None:
    ref = save_tiny_llama(tmp_path, with_tokenizer=True, max_position_embeddings=1024)
    with torch.no_grad():
        ref.lm_head.weight.mul_(40.0)  # peaky distributions: a few tokens carry the mass
    ref.save_pretrained(str(tmp_path))
    tiny_peaky = load_model(tmp_path, progress=False)
    # The draft: the same model's first 2 of 3 layers, so its greedy proposals are often but not
    # always the target's likeliest token (both acceptance and rejection happen).
    draft = LlamaModel.from_source(open_weight_source(tmp_path), progress=False, num_layers=2)
    prompt = tuple(range(3, 320))
    config = GeneratorConfig(
        page_size=16,
        num_pages=256,
        scheduler=SchedulerConfig(max_q_size=4096),
        speculation=SpeculationConfig(DrafterKind.DRAFT_MODEL, num_draft_tokens=2, max_batch_size=64),
    )
    gen = DynamicGenerator(tiny_peaky.model, tiny_peaky.tokenizer, config, draft_model=draft)
    # Token 1 comes from the prefill; token 2 from verifying one draft (3 tokens leave room for one).
    specs = [
        JobSpec(prompt, max_new_tokens=3, ignore_eos=True, sampling=SamplingSettings(temperature=1.0, seed=s))
        for s in range(2000)
    ]
    results = gen.generate(specs)
    assert gen.stats().accepted_draft_tokens > 0 and gen.stats().rejected_draft_tokens > 0
    firsts = torch.tensor([r.token_ids[0] for r in results])
    t1 = int(torch.mode(firsts).values)
    seconds = torch.tensor([r.token_ids[1] for r in results if r.token_ids[0] == t1])
    # The target's own distribution of token 2 after prompt + t1.
    cache = tiny_peaky.model.new_cache(num_pages=32, page_size=16)
    batch = ForwardBatch.build(
        [SequenceInput([*prompt, t1], 0, [PageId(i) for i in range(21)])], 16, tiny_peaky.model.device
    )
    p = torch.softmax(tiny_peaky.model.forward(batch, cache)[0], dim=-1)
    n = len(seconds)
    expected = p * n
    counts = torch.bincount(seconds, minlength=p.shape[0]).float()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    assert n > 500
    assert chi2 < chi_square_critical(len(obs) - 1), (chi2, len(obs))


def test_draft_model_rewind_recomputes_from_the_position(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    drafter = DraftModelDrafter(tiny.model, tiny.model.config.vocab_size, num_pages=8, page_size=16)
    starts: list[int] = []
    real = tiny.model.forward

    def forward(batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        starts.append(int(batch.positions[0]))
        return real(batch, cache)

    monkeypatch.setattr(tiny.model, "forward", forward)
    job, pages = JobId("j"), [PageId(0), PageId(1), PageId(2)]
    tokens = list(range(3, 40))
    drafter.propose([DraftRequest(job, tokens, pages, 2)])
    assert starts[0] == 0
    starts.clear()
    drafter.propose([DraftRequest(job, [*tokens, 7], pages, 2)])
    assert starts[0] == len(tokens)  # catches up on the new token only
    drafter.rewind(job, 16)  # page 1 was swapped for an identical page: its draft K/V is unknown
    starts.clear()
    drafter.propose([DraftRequest(job, [*tokens, 7, 8], pages, 2)])
    assert starts[0] == 16
    drafter.rewind(JobId("unknown"), 0)  # nothing to do for a job it never saw
    drafter.forget(job)


def test_a_page_swapped_by_live_dedup_rewinds_the_drafter(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two identical greedy jobs a step apart: the later one's output pages dedup onto the earlier's,
    whose draft-model K/V this job's drafter never computed, so the drafter rewinds to each swapped page."""
    draft = LlamaModel.from_source(open_weight_source(tiny.path), progress=False, num_layers=2)
    prompt = tuple([5, 6, 7, 8] * 4 + [9, 10])  # its first page a whole prefix hit for the second job
    spec = JobSpec(prompt, max_new_tokens=40, ignore_eos=True)
    plain = DynamicGenerator(tiny.model, tiny.tokenizer, spec_config(DrafterKind.NONE)).generate([spec])[0]
    gen = DynamicGenerator(
        tiny.model, tiny.tokenizer, spec_config(DrafterKind.DRAFT_MODEL), draft_model=draft
    )
    assert gen.drafter is not None
    rewinds: list[tuple[JobId, int]] = []
    real = gen.drafter.rewind

    def rewind(job_id: JobId, position: int) -> None:
        rewinds.append((job_id, position))
        real(job_id, position)

    monkeypatch.setattr(gen.drafter, "rewind", rewind)
    first = gen.enqueue(spec)
    tokens: dict[JobId, list[int]] = {first: []}
    while gen.has_work():
        if len(tokens) == 1 and gen.stats().iterations == 1:
            tokens[gen.enqueue(spec)] = []
        for e in gen.iterate():
            if isinstance(e, TokensGenerated):
                tokens[e.job_id].extend(e.token_ids)
        gen.check_invariants()
    second = next(j for j in tokens if j != first)
    assert tokens[first] == tokens[second] == list(plain.token_ids)
    assert gen.pool.stats().dedup_hits > 0
    assert rewinds and all(j == second and p % 16 == 0 and p >= 16 for j, p in rewinds)
