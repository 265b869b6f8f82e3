"""The per-job sampler: processors against HF's logits processors, per-job reproducibility, paths agree."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import replace
from types import ModuleType

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.errors import InvalidRequestError
from engine.jobs import SamplingSettings
from engine.sampling.sampler import TOP_P_CANDIDATES, Sampler, SampleRequest, SamplerMode, SamplerState

V = 1000
REALISTIC = SamplingSettings(temperature=0.8, top_p=0.9, top_k=50, repetition_penalty=1.1)
NO_IDS = torch.zeros(1, 0, dtype=torch.long)


@pytest.fixture(scope="module")
def hf() -> ModuleType:
    """transformers' logits processors, the reference for each of ours."""
    module: ModuleType = pytest.importorskip("transformers.generation.logits_process")
    return module


@pytest.fixture(scope="module", params=[SamplerMode.BATCHED, SamplerMode.THREADED])
def sampler(request: pytest.FixtureRequest) -> Iterator[Sampler]:
    with Sampler(V, mode=request.param) as s:
        yield s


def rand_logits(n: int, vocab: int = V, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def state(settings: SamplingSettings, prompt: Sequence[int] = (1, 2, 3), vocab: int = V) -> SamplerState:
    settings.validate(vocab)
    return SamplerState(settings, prompt, vocab)


def probs_of(sampler: Sampler, logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    vocab = logits.shape[1]
    requests = [SampleRequest(state(settings, vocab=vocab))]
    if sampler.vocab_size == vocab:
        return sampler.processed_probs(logits, requests)[0]
    with Sampler(vocab, mode=sampler.mode) as other:
        return other.processed_probs(logits, requests)[0]


def hf_probs(scores: torch.Tensor) -> torch.Tensor:
    return torch.softmax(scores, dim=-1)[0]


def assert_same_distribution(ours: torch.Tensor, ref_scores: torch.Tensor) -> None:
    kept = torch.isfinite(ref_scores[0])
    assert torch.equal(ours > 0, kept), f"kept {int((ours > 0).sum())} tokens, HF kept {int(kept.sum())}"
    torch.testing.assert_close(ours, hf_probs(ref_scores), rtol=1e-4, atol=1e-6)


# -- greedy -------------------------------------------------------------------------------------


def test_greedy_is_argmax_with_ties_to_lowest_id(sampler: Sampler) -> None:
    logits = rand_logits(6)
    logits[2, 10] = logits[2, 700] = logits[2].max() + 1
    reqs = [SampleRequest(state(SamplingSettings())) for _ in range(6)]
    tokens = [r.token_id for r in sampler.sample(logits, reqs)]
    assert tokens == logits.argmax(dim=-1).tolist()
    assert tokens[2] == 10


def test_greedy_applies_penalties_bias_and_bans(sampler: Sampler, hf: ModuleType) -> None:
    logits = rand_logits(1)
    top = int(logits.argmax())
    prompt = [top]
    st_rep = state(SamplingSettings(repetition_penalty=50.0), prompt)
    ref = hf.RepetitionPenaltyLogitsProcessor(50.0)(torch.tensor([prompt]), logits.clone())
    assert sampler.sample(logits, [SampleRequest(st_rep)])[0].token_id == int(ref.argmax())
    banned = state(SamplingSettings(banned_token_ids=frozenset({top})))
    assert sampler.sample(logits, [SampleRequest(banned)])[0].token_id != top
    extra = SampleRequest(state(SamplingSettings()), banned_extra=frozenset({top}))
    assert sampler.sample(logits, [extra])[0].token_id != top
    biased = state(SamplingSettings(logit_bias=((7, 100.0),)))
    assert sampler.sample(logits, [SampleRequest(biased)])[0].token_id == 7


# -- each processor against transformers ----------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature(sampler: Sampler, temperature: float, hf: ModuleType) -> None:
    logits = rand_logits(1, seed=1)
    ours = probs_of(sampler, logits, SamplingSettings(temperature=temperature))
    assert_same_distribution(ours, hf.TemperatureLogitsWarper(temperature)(NO_IDS, logits.clone()))


@pytest.mark.parametrize("top_k", [1, 5, 50, V - 1])
def test_top_k(sampler: Sampler, top_k: int, hf: ModuleType) -> None:
    logits = rand_logits(1, seed=2)
    ours = probs_of(sampler, logits, SamplingSettings(temperature=1.0, top_k=top_k))
    assert_same_distribution(ours, hf.TopKLogitsWarper(top_k)(NO_IDS, logits.clone()))


def test_top_k_keeps_ties_at_the_boundary(sampler: Sampler, hf: ModuleType) -> None:
    logits = torch.full((1, V), -5.0)
    logits[0, [3, 9, 40, 41, 42]] = torch.tensor([9.0, 8.0, 7.0, 7.0, 7.0])
    ours = probs_of(sampler, logits, SamplingSettings(temperature=1.0, top_k=3))
    assert_same_distribution(ours, hf.TopKLogitsWarper(3)(NO_IDS, logits.clone()))
    assert (ours > 0).nonzero().flatten().tolist() == [3, 9, 40, 41, 42]


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.99])
@pytest.mark.parametrize(("vocab", "scale"), [(V, 3.0), (4096, 6.0), (4096, 0.5)])
def test_top_p(sampler: Sampler, top_p: float, vocab: int, scale: float, hf: ModuleType) -> None:
    # V=1000: whole-row sort; 4096 peaky: nucleus found among the candidates; 4096 flat: falls back.
    logits = rand_logits(1, vocab, seed=3, scale=scale)
    ours = probs_of(sampler, logits, SamplingSettings(temperature=1.0, top_p=top_p))
    assert_same_distribution(ours, hf.TopPLogitsWarper(top_p)(NO_IDS, logits.clone()))


def test_top_p_candidate_shortcut_is_exercised() -> None:
    logits = rand_logits(1, 4096, seed=3, scale=6.0)
    probs = torch.softmax(logits[0], -1).sort(descending=True).values
    assert float(probs[:TOP_P_CANDIDATES].sum()) > 0.99  # the peaky case above stays within the candidates


def test_top_p_candidates_draw_as_the_topk_path_and_the_whole_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """The nucleus's candidates (the native top set) draw the tokens that the topk candidates (the
    path without the native kernel) draw, and give the whole-row sort's distribution, ties at the
    edge included, on rows of the shipped model's vocabulary."""
    import engine.sampling.sampler as sampler_module

    vocab, n = 49152, 15
    logits = rand_logits(n, vocab, seed=8, scale=4.0)
    logits[3] = logits[3].round()  # many ties at every edge
    logits[1] = -10.0
    logits[1, 100:140] = 5.0  # 40 equal tokens, top_p 0.5: the nucleus's edge cuts the tie
    settings = [
        SamplingSettings(temperature=t, top_p=p, seed=i)
        for i, (t, p) in enumerate(itertools.product((0.3, 0.8, 1.3), (0.05, 0.5, 0.9, 0.95, 0.99)))
    ]
    positions = [(j, p) for j in range(n) for p in (0, 1)]

    def draw(sampler: Sampler) -> list[int]:
        reqs = [SampleRequest(state(settings[j], vocab=vocab), position=pos) for j, pos in positions]
        rows = logits[[j for j, _ in positions]]
        return [r.token_id for r in sampler.sample(rows, reqs)]

    def probs(sampler: Sampler) -> torch.Tensor:
        return sampler.processed_probs(logits, [SampleRequest(state(st, vocab=vocab)) for st in settings])

    with Sampler(vocab) as native:
        native_tokens, native_probs = draw(native), probs(native)
        monkeypatch.setattr(sampler_module, "top_mass", lambda *_: None)
        topk_tokens, topk_probs = draw(native), probs(native)
        monkeypatch.setattr(sampler_module, "TOP_P_CANDIDATES", vocab)  # every row sorts the vocabulary
        whole_probs = probs(native)
    assert native_tokens == topk_tokens
    torch.testing.assert_close(native_probs, topk_probs, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(native_probs, whole_probs, rtol=1e-6, atol=1e-9)
    assert (native_probs[1] > 0).nonzero().flatten().tolist() == list(range(100, 120))  # lowest ids first


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 0.99])
def test_min_p(sampler: Sampler, min_p: float, hf: ModuleType) -> None:
    logits = rand_logits(1, seed=4)
    ours = probs_of(sampler, logits, SamplingSettings(temperature=1.0, min_p=min_p))
    assert_same_distribution(ours, hf.MinPLogitsWarper(min_p)(NO_IDS, logits.clone()))


@pytest.mark.parametrize("typical", [0.1, 0.5, 0.9, 0.99])
@pytest.mark.parametrize("top_k", [0, 40])
def test_typical(sampler: Sampler, typical: float, top_k: int, hf: ModuleType) -> None:
    logits = rand_logits(1, seed=5)
    ref = logits.clone()
    if top_k:
        ref = hf.TopKLogitsWarper(top_k)(NO_IDS, ref)
    ref = hf.TypicalLogitsWarper(typical)(NO_IDS, ref)
    ours = probs_of(sampler, logits, SamplingSettings(temperature=1.0, top_k=top_k, typical=typical))
    assert_same_distribution(ours, ref)


@pytest.mark.parametrize("penalty", [0.7, 1.3, 5.0])
def test_repetition_penalty_covers_prompt_and_output(
    sampler: Sampler, penalty: float, hf: ModuleType
) -> None:
    logits = rand_logits(1, seed=6)
    prompt = [5, 17, 17, 300, 999]
    st_ = state(SamplingSettings(temperature=1.0, repetition_penalty=penalty), prompt)
    for t in (0, 17, 42, 42):
        st_.accept(t)
    ids = torch.tensor([[*prompt, 0, 17, 42, 42]])
    ref = hf.RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    ours = sampler.processed_probs(logits, [SampleRequest(st_)])[0]
    assert_same_distribution(ours, ref)


def test_frequency_and_presence_penalties_count_output_only(sampler: Sampler) -> None:
    logits = rand_logits(1, seed=7)
    prompt = [1, 2, 3]
    st_ = state(SamplingSettings(temperature=1.0, frequency_penalty=0.7, presence_penalty=1.5), prompt)
    output = [3, 3, 3, 8, 500]
    for t in output:
        st_.accept(t)
    ref = logits.clone()
    for t in set(output):
        ref[0, t] -= output.count(t) * 0.7 + 1.5
    assert_same_distribution(sampler.processed_probs(logits, [SampleRequest(st_)])[0], ref)


def test_logit_bias_and_bans(sampler: Sampler) -> None:
    logits = rand_logits(1, seed=8)
    settings_ = SamplingSettings(
        temperature=1.0,
        logit_bias=((4, 2.5), (9, -3.0), (11, -20.0)),
        banned_token_ids=frozenset({20, 21}),
    )
    req = SampleRequest(state(settings_), banned_extra=frozenset({22}))
    ref = logits.clone()
    ref[0, 4] += 2.5
    ref[0, 9] -= 3.0
    ref[0, 11] -= 20.0
    ref[0, [20, 21, 22]] = float("-inf")
    assert_same_distribution(sampler.processed_probs(logits, [req])[0], ref)


def test_full_chain_in_transformers_order(sampler: Sampler, hf: ModuleType) -> None:
    """Every step at once, against transformers' processors in the order its generate() builds
    them (GenerationMixin._get_logits_processor): bias, repetition penalty, temperature, top_k,
    top_p, min_p, typical. The bias lands on a token the penalty also touches, and min_p and
    typical both cut, so a different order gives a different distribution."""
    logits = rand_logits(1, seed=9, scale=2.0)
    prompt = [int(i) for i in logits[0].topk(20).indices]  # penalize the favourites
    boosted = prompt[5]
    s = SamplingSettings(
        temperature=0.7,
        top_k=200,
        top_p=0.8,
        typical=0.6,
        min_p=0.05,
        repetition_penalty=1.3,
        logit_bias=((boosted, 3.0),),
    )
    ref = hf.SequenceBiasLogitsProcessor({(boosted,): 3.0})(torch.tensor([prompt]), logits.clone())
    ref = hf.RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt]), ref)
    for warper in (
        hf.TemperatureLogitsWarper(0.7),
        hf.TopKLogitsWarper(200),
        hf.TopPLogitsWarper(0.8),
        hf.MinPLogitsWarper(0.05),
        hf.TypicalLogitsWarper(0.6),
    ):
        ref = warper(NO_IDS, ref)
    ours = sampler.processed_probs(logits, [SampleRequest(state(s, prompt))])[0]
    assert_same_distribution(ours, ref)


def test_logit_bias_names_a_repeated_token() -> None:
    with pytest.raises(InvalidRequestError, match="token 4 twice") as caught:
        SamplingSettings(logit_bias=((4, 1.0), (9, 1.0), (4, 0.5))).validate(V)
    assert caught.value.field == "sampling.logit_bias[2].token_id"


# -- logprobs ---------------------------------------------------------------------------------------


def test_logprobs_and_top_n(sampler: Sampler, hf: ModuleType) -> None:
    logits = rand_logits(3, seed=10)
    sets = [
        REALISTIC,
        SamplingSettings(temperature=1.5, banned_token_ids=frozenset({int(logits[1].argmax())})),
        SamplingSettings(repetition_penalty=1.2),  # greedy: logprobs at temperature 1
    ]
    states = [state(s, prompt=[7, 8]) for s in sets]
    reqs = [SampleRequest(s_, want_logprobs=True, top_n=5) for s_ in states]
    results = sampler.sample(logits, reqs)
    for i, (res, s) in enumerate(zip(results, sets, strict=True)):
        x = hf.RepetitionPenaltyLogitsProcessor(s.repetition_penalty)(
            torch.tensor([[7, 8]]), logits[i : i + 1]
        )
        x[0, list(s.banned_token_ids)] = float("-inf")
        ref = torch.log_softmax(x[0] / (s.temperature or 1.0), dim=-1)
        assert res.logprob is not None
        assert res.logprob.token_id == res.token_id
        assert res.logprob.logprob == pytest.approx(float(ref[res.token_id]), abs=1e-4)
        top = res.logprob.top
        assert [t for t, _ in top] == ref.topk(5).indices.tolist()
        assert [v for _, v in top] == pytest.approx(ref.topk(5).values.tolist(), abs=1e-4)
        assert all(a[1] >= b[1] for a, b in itertools.pairwise(top))
    greedy = results[2].logprob
    assert greedy is not None and greedy.top[0][0] == results[2].token_id
    no = sampler.sample(logits[:1], [SampleRequest(state(REALISTIC))])[0]
    assert no.logprob is None


# -- reproducibility and the two paths ----------------------------------------------------------------


def mixed_settings(seed_base: int) -> list[SamplingSettings]:
    return [
        replace(REALISTIC, seed=seed_base),
        SamplingSettings(temperature=1.0, seed=seed_base + 1),
        SamplingSettings(temperature=0.6, top_p=0.5, seed=seed_base + 2),
        SamplingSettings(temperature=1.2, min_p=0.1, top_k=100, seed=seed_base + 3),
        SamplingSettings(temperature=0.9, typical=0.7, frequency_penalty=0.5, seed=seed_base + 4),
        SamplingSettings(repetition_penalty=1.3, seed=seed_base + 5),  # greedy
        SamplingSettings(temperature=1.0, top_k=40, presence_penalty=1.0, seed=seed_base + 6),
        SamplingSettings(temperature=0.7, top_k=7, logit_bias=((3, 4.0),), seed=seed_base + 7),
    ]


def run_jobs(
    sampler: Sampler, sets: Sequence[SamplingSettings], steps: int, vocab: int, rows: Sequence[int]
) -> dict[int, list[int]]:
    """Jobs sets[j] for j in rows (in that row order) decoding side by side; prompt and logits depend
    on the job alone, so a job's tokens must not depend on which rows surround it."""
    states = {j: state(sets[j], prompt=[j, j + 1, 100], vocab=vocab) for j in rows}
    out: dict[int, list[int]] = {j: [] for j in rows}
    for step in range(steps):
        logits = torch.cat([rand_logits(1, vocab, seed=1000 * j + step) for j in rows])
        results = sampler.sample(
            logits, [SampleRequest(states[j], want_logprobs=True, top_n=2) for j in rows]
        )
        for j, r in zip(rows, results, strict=True):
            states[j].accept(r.token_id)
            out[j].append(r.token_id)
    return out


@pytest.mark.parametrize("vocab", [V, 49152])
def test_batched_and_threaded_give_identical_tokens(vocab: int) -> None:
    sets = mixed_settings(100)
    order = list(range(len(sets)))
    with Sampler(vocab, mode=SamplerMode.BATCHED) as b, Sampler(vocab, mode=SamplerMode.THREADED) as t:
        assert run_jobs(b, sets, 6, vocab, order) == run_jobs(t, sets, 6, vocab, order)
        logits = rand_logits(len(sets), vocab, seed=5)
        reqs_b = [SampleRequest(state(s, vocab=vocab)) for s in sets]
        reqs_t = [SampleRequest(state(s, vocab=vocab)) for s in sets]
        assert torch.equal(b.processed_probs(logits, reqs_b), t.processed_probs(logits, reqs_t))


def test_seeded_job_is_reproducible_alone_and_amid_others() -> None:
    sets = mixed_settings(7)
    n = len(sets)
    with Sampler(V, mode=SamplerMode.BATCHED) as b, Sampler(V, mode=SamplerMode.THREADED) as t:
        together = run_jobs(b, sets, 8, V, list(range(n)))
        assert run_jobs(t, sets, 8, V, list(reversed(range(n)))) == together
        for j in range(n):
            assert run_jobs(b, sets, 8, V, [j])[j] == together[j]
            assert run_jobs(t, sets, 8, V, [j])[j] == together[j]
        assert run_jobs(b, sets, 8, V, [5, 0, 3])[0] == together[0]


def test_different_seeds_differ_and_unseeded_jobs_do_not_share_state(sampler: Sampler) -> None:
    flat = torch.zeros(1, V)
    shared = SamplingSettings(temperature=1.0)  # one settings object, as a careless caller might share

    def draws(s: SamplerState) -> list[int]:
        return [sampler.sample(flat, [SampleRequest(s)])[0].token_id for _ in range(10)]

    assert draws(state(replace(shared, seed=1))) == draws(state(replace(shared, seed=1)))
    assert draws(state(replace(shared, seed=1))) != draws(state(replace(shared, seed=2)))
    a, b = state(shared), state(shared)
    assert a.seed != b.seed
    both = [r.token_id for r in sampler.sample(torch.zeros(2, V), [SampleRequest(a), SampleRequest(b)])]
    assert both[0] != both[1] or draws(a) != draws(b)


def test_processed_probs_are_what_sample_draws_from(sampler: Sampler) -> None:
    sets = mixed_settings(40)
    logits = rand_logits(len(sets), seed=11)
    tokens = [r.token_id for r in sampler.sample(logits, [SampleRequest(state(s)) for s in sets])]
    probs = sampler.processed_probs(logits, [SampleRequest(state(s)) for s in sets])
    assert all(float(probs[i, t]) > 0 for i, t in enumerate(tokens))
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(sets)))


def test_rows_of_one_job_at_distinct_positions_draw_as_they_would_alone(sampler: Sampler) -> None:
    """Speculative verification samples a job's draft positions in one call: each row draws its own
    position's uniform, so the tokens are those of one call per position."""
    settings = SamplingSettings(temperature=0.9, top_p=0.9, seed=5)
    logits = rand_logits(6, seed=4)
    s_ = state(settings)
    together = [r.token_id for r in sampler.sample(logits, [SampleRequest(s_, position=p) for p in range(6)])]
    alone = [
        sampler.sample(logits[p : p + 1], [SampleRequest(state(settings), position=p)])[0].token_id
        for p in range(6)
    ]
    assert together == alone


def test_rejects_bad_input(sampler: Sampler) -> None:
    s_ = state(REALISTIC)
    with pytest.raises(ValueError, match="distinct output positions"):
        sampler.sample(rand_logits(2), [SampleRequest(s_), SampleRequest(s_)])
    with pytest.raises(ValueError, match="distinct output positions"):
        sampler.sample(rand_logits(2), [SampleRequest(s_, position=3), SampleRequest(s_, position=3)])
    with pytest.raises(ValueError, match="logits must be"):
        sampler.sample(rand_logits(1, 10), [SampleRequest(s_)])


def test_logits_are_not_modified(sampler: Sampler) -> None:
    logits = rand_logits(2)
    before = logits.clone()
    reqs = [SampleRequest(state(s, prompt=list(range(50)))) for s in mixed_settings(0)[:2]]
    sampler.sample(logits, reqs)
    sampler.processed_probs(logits, reqs)
    assert torch.equal(logits, before)


def test_threaded_mode_uses_the_pool_only_for_sampled_rows() -> None:
    sets = mixed_settings(3)
    order = list(range(len(sets)))
    with Sampler(V, mode=SamplerMode.THREADED) as pooled, Sampler(V, mode=SamplerMode.BATCHED) as b:
        greedy = [SamplingSettings()] * 3
        assert run_jobs(pooled, greedy, 3, V, [0, 1, 2]) == run_jobs(b, greedy, 3, V, [0, 1, 2])
        assert pooled._pool is None  # greedy rows stay batched: no thread started
        assert run_jobs(pooled, sets, 3, V, order) == run_jobs(b, sets, 3, V, order)
        assert pooled._pool is not None  # went through the pool


def test_the_engine_samples_batched_by_default() -> None:
    with Sampler(V) as s:
        assert s.mode is SamplerMode.BATCHED
        assert s.num_threads == 2


# -- statistics and extremes ---------------------------------------------------------------------------


def test_temperature_one_follows_softmax_chi_square() -> None:
    vocab, rows, calls = 8, 1000, 10
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2]])
    expected = torch.softmax(logits[0], -1) * rows * calls
    counts = torch.zeros(vocab)
    with Sampler(vocab, mode=SamplerMode.BATCHED) as s:
        states = [state(SamplingSettings(temperature=1.0, seed=i), vocab=vocab) for i in range(rows)]
        for _ in range(calls):
            tokens = [
                r.token_id for r in s.sample(logits.expand(rows, vocab), [SampleRequest(x) for x in states])
            ]
            counts += torch.bincount(torch.tensor(tokens), minlength=vocab)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 24.3  # chi-square, 7 degrees of freedom, p = 0.001


@st.composite
def extreme_settings(draw: st.DrawFn, vocab: int) -> SamplingSettings:
    temperature = draw(st.one_of(st.just(0.0), st.floats(1e-45, 1e300), st.sampled_from([1e-30, 1.0, 1e30])))
    ids = st.integers(0, vocab - 1)
    return SamplingSettings(
        temperature=temperature,
        top_k=draw(st.integers(0, vocab + 3)),
        top_p=draw(st.floats(1e-9, 1.0, exclude_min=False)),
        min_p=draw(st.floats(0.0, 0.999999)),
        typical=draw(st.floats(1e-9, 1.0)),
        repetition_penalty=draw(st.floats(1e-30, 1e30)),
        frequency_penalty=draw(st.floats(-1e30, 1e30)),
        presence_penalty=draw(st.floats(-1e30, 1e30)),
        logit_bias=tuple(
            draw(st.lists(st.tuples(ids, st.floats(allow_nan=False, allow_infinity=True)), max_size=4))
        ),
        banned_token_ids=frozenset(draw(st.sets(ids, max_size=vocab - 1))),
        seed=draw(st.integers(-(2**70), 2**70)),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), vocab=st.sampled_from([1, 2, 7, 64, 2048]), mode=st.sampled_from(list(SamplerMode)))
def test_extreme_settings_keep_a_token(data: st.DataObject, vocab: int, mode: SamplerMode) -> None:
    s = data.draw(extreme_settings(vocab))
    extra = frozenset(data.draw(st.sets(st.integers(0, vocab - 1), max_size=vocab)))
    output = data.draw(st.lists(st.integers(0, vocab - 1), max_size=6))
    logits = rand_logits(
        1, vocab, seed=data.draw(st.integers(0, 1000)), scale=data.draw(st.sampled_from([0.0, 1.0, 50.0]))
    )
    a, b = SamplerState(s, [0], vocab), SamplerState(s, [0], vocab)
    for t in output:
        a.accept(t)
        b.accept(t)
    with Sampler(vocab, mode=mode) as sampler:
        probs = sampler.processed_probs(logits, [SampleRequest(a, extra)])[0]
        token = sampler.sample(logits, [SampleRequest(b, extra, want_logprobs=True, top_n=3)])[0]
    assert bool(torch.isfinite(probs).all()) and float(probs.min()) >= 0
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-4)
    assert float(probs[token.token_id]) > 0
    assert token.token_id not in s.banned_token_ids
    # The engine's extra bans give way only when nothing else is left: with moderate penalties and
    # biases (extreme ones can push every other token to -inf) and an allowed token outside them.
    moderate = (
        abs(s.frequency_penalty) < 1e6
        and abs(s.presence_penalty) < 1e6
        and 1e-6 < s.repetition_penalty < 1e6
        and all(abs(b_) < 1e6 for _, b_ in s.logit_bias)
    )
    if moderate and len(s.banned_token_ids | extra) < vocab:
        assert token.token_id not in extra


def test_grammar_masks_in_place_or_on_a_copy_give_the_same_tokens() -> None:
    """overwrite=True writes the masks into the caller's rows instead of copying the batch; the
    tokens and probabilities are the same, and only the masked rows change (to -inf outside)."""
    from engine.grammar.constraints import mask_words

    vocab, rows = 100, 6
    torch.manual_seed(3)
    logits = torch.randn(rows, vocab)
    masks: list[torch.Tensor | None] = []
    for i in range(rows):
        if i % 2:
            masks.append(None)
            continue
        allowed = torch.zeros(mask_words(vocab), dtype=torch.int64)
        for t in torch.randperm(vocab)[: 5 + i].tolist():
            allowed[t // 32] |= 1 << (t % 32)
        masks.append(torch.where(allowed >= 2**31, allowed - 2**32, allowed).to(torch.int32))

    def requests() -> list[SampleRequest]:
        return [
            SampleRequest(SamplerState(SamplingSettings(temperature=0.7, seed=i), [], vocab), allowed=m)
            for i, m in enumerate(masks)
        ]

    with Sampler(vocab) as sampler:
        copy_in = logits.clone()
        on_copy = sampler.sample(copy_in, requests())
        assert torch.equal(copy_in, logits)
        in_place = logits.clone()
        overwritten = sampler.sample(in_place, requests(), overwrite=True)
    assert [r.token_id for r in on_copy] == [r.token_id for r in overwritten]
    for i, m in enumerate(masks):
        if m is None:
            assert torch.equal(in_place[i], logits[i])
            continue
        ok = torch.tensor([bool(int(m[t // 32]) >> (t % 32) & 1) for t in range(vocab)])
        assert torch.equal(in_place[i][ok], logits[i][ok]) and bool((in_place[i][~ok] == -math.inf).all())
        assert ok[on_copy[i].token_id]


def test_mask_overlap_follows_the_spare_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.grammar.constraints import MaskOverlap

    threads = torch.get_num_threads()
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(threads)))
    assert MaskOverlap.AUTO.resolve() is MaskOverlap.BEFORE
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(threads + 1)))
    assert MaskOverlap.AUTO.resolve() is MaskOverlap.BESIDE
    assert MaskOverlap.BEFORE.resolve() is MaskOverlap.BEFORE
