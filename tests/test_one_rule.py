"""A request is decided once, by one rule: the front end builds and checks the JobSpec (its values,
prompt embeddings and fit in the context and the cache, guided pairs included), ships it over the
pipe as it is, and the engine's own check of the same spec never disagrees.

Random specs against random limits: the front end's verdict (service/frontend/limits.check_spec on
the limits the engine's READY gives) and the engine's (DynamicGenerator.enqueue on the spec as it
comes out of the pipe's Submit message) are the same: both accept, or both refuse with the same
error and message. (That the engine process never re-derives a job from the public proto is
tests/test_import_graph.py's.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.errors import DyngenError, QueueFullError
from engine.generator import DynamicGenerator, GeneratorConfig
from engine.jobs import JobId, JobSpec, SamplingSettings
from engine.model.loader import LoadedModel
from engine.prompt.guidance import Guidance
from engine.prompt.prompt_embeddings import PromptEmbedding
from service.frontend.limits import ModelBounds, RequestError, check_spec
from service.ipc import Submit
from tests.tiny_generator import tiny_model

_GENERATORS: dict[tuple[int, int, int], DynamicGenerator] = {}


def _generator(model: LoadedModel, pages: int, page_size: int, context: int) -> DynamicGenerator:
    key = (pages, page_size, context)
    if key not in _GENERATORS:
        config = GeneratorConfig(page_size=page_size, num_pages=pages, max_seq_len=context)
        _GENERATORS[key] = DynamicGenerator(model.model, model.tokenizer, config)
    return _GENERATORS[key]


@st.composite
def cases(draw: st.DrawFn, vocab: int, hidden: int) -> tuple[JobSpec, int, int, int]:
    page_size = draw(st.sampled_from([1, 4, 16]))
    pages = draw(st.integers(1, 40))
    context = draw(st.integers(4, 200))
    n = draw(st.integers(1, 60))
    prompt = tuple(draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n)))
    rare = st.sampled_from([False] * 11 + [True])  # now and then a bad value (hypothesis favours the first)
    if draw(rare):  # an id past the vocabulary
        prompt = (*prompt[:-1], vocab + draw(st.integers(0, 3)))
    guidance = None
    if draw(st.booleans()):
        m = draw(st.integers(0, 40))
        scale = draw(st.sampled_from([1.5, 3.0, 0.0, -1.0]))
        guidance = Guidance(scale, tuple(draw(st.lists(st.integers(0, vocab - 1), min_size=m, max_size=m))))
    embeddings: tuple[PromptEmbedding, ...] = ()
    if draw(st.sampled_from([False, False, True])):
        position = draw(st.integers(-1, n))
        rows = draw(st.integers(1, 3))
        width = draw(st.sampled_from([hidden, hidden, hidden + 1]))
        embeddings = (PromptEmbedding(position, rows, bytes(4 * width * rows)),)
    spec = JobSpec(
        prompt,
        max_new_tokens=0 if draw(rare) else draw(st.integers(1, 160)),
        min_new_tokens=200 if draw(rare) else draw(st.sampled_from([0, 2])),
        sampling=SamplingSettings(
            temperature=-1.0 if draw(rare) else draw(st.sampled_from([0.0, 0.7])),
            top_p=1.5 if draw(rare) else draw(st.sampled_from([1.0, 0.5])),
        ),
        priority=2000 if draw(rare) else draw(st.sampled_from([0, 5, -3])),
        guidance=guidance,
        embeddings=embeddings,
        tenant="t",
    )
    return spec, pages, page_size, context


def _verdict(call: object) -> tuple[str, str] | None:
    assert callable(call)
    try:
        call()
    except (DyngenError, RequestError) as exc:
        return type(exc).__name__, str(exc)
    return None


def test_the_front_end_and_the_engine_agree_on_every_job(tmp_path_factory: pytest.TempPathFactory) -> None:
    model = tiny_model(tmp_path_factory.mktemp("rule"))
    vocab, hidden = model.model.config.vocab_size, model.model.config.hidden_size
    context_cap = model.model.config.max_position_embeddings

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(cases(vocab, hidden))
    def check(case: tuple[JobSpec, int, int, int]) -> None:
        spec, pages, page_size, context = case
        context = min(context, context_cap)
        gen = _generator(model, pages, page_size, context)
        bounds = ModelBounds(vocab, context, pages * page_size, hidden, page_size)
        front = _verdict(lambda: check_spec(spec, bounds))
        shipped = Submit.from_bytes(Submit(JobId("a" * 32), spec).to_bytes()).spec
        assert shipped == spec  # the engine gets the job the front end decided, not a re-derivation
        engine = _verdict(lambda: gen.enqueue(shipped))
        if engine is None:
            (job,) = list(gen.jobs)
            gen.cancel(job)
            while gen.has_work():
                gen.iterate()
        assert engine is None or engine[0] != QueueFullError.__name__
        # The front end names its refusals RequestError (with a field); the message is the rule's.
        assert (front is None) == (engine is None), (front, engine)
        if front is not None and engine is not None:
            assert front[1] == engine[1]

    check()
    for gen in _GENERATORS.values():
        gen.close()
    _GENERATORS.clear()


def test_a_guided_pair_is_fitted_as_a_pair_on_both_sides(tmp_path: Path) -> None:
    """The disagreement the one rule ends: each sequence fits the cache alone, the two together do
    not; the front end used to let it through and the engine refused it."""
    model = tiny_model(tmp_path)
    vocab, hidden = model.model.config.vocab_size, model.model.config.hidden_size
    spec = JobSpec((1,) * 20, 12, guidance=Guidance(1.5, (2,) * 20))  # 32 tokens each: 2 pages of 16
    bounds = ModelBounds(vocab, 100, 48, hidden, 16)  # 3 pages
    front = _verdict(lambda: check_spec(spec, bounds))
    gen = DynamicGenerator(
        model.model, model.tokenizer, GeneratorConfig(page_size=16, num_pages=3, max_seq_len=100)
    )
    engine = _verdict(lambda: gen.enqueue(spec))
    gen.close()
    assert front is not None and engine is not None and front[1] == engine[1]
    assert "need 4 pages" in front[1]
