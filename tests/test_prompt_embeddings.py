"""Prompt embeddings per job (engine/prompt/prompt_embeddings.py, JobSpec.embeddings).

The mechanism proved on the text model: a span of the prompt given as the model's own token
embeddings, by position (over other token ids) or at a placeholder token, gives exactly the plain
prompt's greedy tokens (float32), alone and inside a batch, where those ids alone give others; other vectors at the same positions change the output and
share no page over the span. On a tiny random model: chunking, preemption and prefix hits change
no token, and bad spans are refused naming the field.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.generator import DynamicGenerator, GeneratorConfig
from engine.jobs import JobId, JobSpec, JobStarted, TokensGenerated
from engine.model.loader import LoadedModel
from engine.model.tokenizer import ChatMessage
from engine.prompt.prompt_embeddings import EmbeddingPlacement, PromptEmbedding, place_embeddings
from engine.scheduler import SchedulerConfig
from tests.conftest import PARITY_PROMPTS
from tests.tiny_generator import all_pages_idle

NEW_TOKENS = 32


def own_vectors(loaded: LoadedModel, ids: list[int] | tuple[int, ...]) -> bytes:
    """The model's own embeddings of `ids`, as the wire carries them (float32, little-endian)."""
    table = loaded.model.embed
    return table[torch.tensor(ids)].to(torch.float32).contiguous().numpy().tobytes()


def started(gen: DynamicGenerator, spec: JobSpec) -> tuple[JobStarted, tuple[int, ...]]:
    job = gen.enqueue(spec)
    first: JobStarted | None = None
    tokens: list[int] = []
    while gen.has_work():
        for e in gen.iterate():
            if e.job_id != job:
                continue
            if isinstance(e, JobStarted):
                first = e
            elif isinstance(e, TokensGenerated):
                tokens.extend(e.token_ids)
        gen.check_invariants()
    assert first is not None
    return first, tuple(tokens)


@pytest.mark.slow
def test_the_models_own_embeddings_give_the_plain_prompts_tokens(smollm: LoadedModel) -> None:
    def chat(text: str) -> tuple[int, ...]:
        return tuple(smollm.tokenizer.encode_chat([ChatMessage("user", text)]))

    gen = DynamicGenerator(smollm.model, smollm.tokenizer, GeneratorConfig(page_size=16, num_pages=256))
    prompts = [chat(p) for p in PARITY_PROMPTS[:3]]
    plain = gen.generate([JobSpec(p, NEW_TOKENS, ignore_eos=True) for p in prompts])
    placeholder = 0  # <|endoftext|>: a token chat prompts do not hold
    filler = smollm.tokenizer.encode(" x")[0]  # by position: other ids under the vectors
    embedded = []
    for p in prompts:
        a, b = 4, len(p) - 6  # the user's text, roughly: a span inside the chat template
        by_position = JobSpec(
            (*p[:a], *[filler] * (b - a), *p[b:]),
            NEW_TOKENS,
            ignore_eos=True,
            embeddings=(PromptEmbedding(a, b - a, own_vectors(smollm, p[a:b])),),
        )
        ids, spans = place_embeddings(
            (*p[:a], placeholder, *p[b:]),
            [EmbeddingPlacement(b - a, own_vectors(smollm, p[a:b]), placeholder_token_id=placeholder)],
        )
        assert len(ids) == len(p) and spans[0].position == a
        embedded += [by_position, JobSpec(ids, NEW_TOKENS, ignore_eos=True, embeddings=spans)]
    alone = [gen.generate([s])[0].token_ids for s in embedded]
    together = [c.token_ids for c in gen.generate([*embedded, JobSpec(chat(PARITY_PROMPTS[4]), 20)])][:-1]
    want = [c.token_ids for c in plain for _ in range(2)]
    assert alone == want
    assert together == want
    # The ids under the vectors alone give other tokens: the vectors made the answer.
    ignored = gen.generate([JobSpec(s.prompt_ids, NEW_TOKENS, ignore_eos=True) for s in embedded])
    assert all(c.token_ids != w for c, w in zip(ignored, want, strict=True))
    gen.close()


@pytest.mark.slow
def test_other_vectors_change_the_output_and_share_no_page_over_the_span(smollm: LoadedModel) -> None:
    prompt = tuple(smollm.tokenizer.encode("The secret word is banana. Repeat the secret word:"))
    other = tuple(smollm.tokenizer.encode("The secret word is orange. Repeat the secret word:"))
    assert len(prompt) == len(other)
    gen = DynamicGenerator(smollm.model, smollm.tokenizer, GeneratorConfig(page_size=4, num_pages=256))
    span = (0, len(prompt) - 1)  # all but the last token: pages over it may be shared, or not
    rows = span[1] - span[0]

    def spec(vectors_of: tuple[int, ...]) -> JobSpec:
        vectors = own_vectors(smollm, vectors_of[span[0] : span[1]])
        return JobSpec(prompt, 12, ignore_eos=True, embeddings=(PromptEmbedding(span[0], rows, vectors),))

    first, tokens = started(gen, spec(prompt))
    again, tokens_again = started(gen, spec(prompt))
    changed, tokens_changed = started(gen, spec(other))
    assert tokens_again == tokens and again.cached_tokens >= rows - 4  # equal vectors: shared pages
    differs = next(i for i, (a, b) in enumerate(zip(prompt, other, strict=True)) if a != b)
    assert differs < rows - 4
    # Pages before the first differing vector may be shared; none from there on.
    assert changed.cached_tokens <= differs
    assert tokens_changed != tokens
    (plain_other,) = gen.generate([JobSpec(other, 12, ignore_eos=True)])
    assert tokens_changed == plain_other.token_ids  # the other text's own embeddings: its tokens
    assert first.cached_tokens == 0
    gen.close()


def tiny_gen(tiny: LoadedModel, num_pages: int = 64, chunk: int = 64) -> DynamicGenerator:
    config = GeneratorConfig(
        page_size=4, num_pages=num_pages, scheduler=SchedulerConfig(max_batch_size=16, max_chunk_size=chunk)
    )
    return DynamicGenerator(tiny.model, tiny.tokenizer, config)


def random_vectors(tiny: LoadedModel, rows: int, seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, tiny.model.config.hidden_size, generator=g)
    return values.numpy().tobytes()


def tiny_specs(tiny: LoadedModel) -> list[JobSpec]:
    prompts = (tuple(range(3, 33)), tuple(range(3, 33)), tuple(range(10, 25)))
    spans = (
        (PromptEmbedding(5, 9, random_vectors(tiny, 9, 1)),),
        (
            PromptEmbedding(5, 9, random_vectors(tiny, 9, 2)),
            PromptEmbedding(20, 3, random_vectors(tiny, 3, 3)),
        ),
        (PromptEmbedding(0, 15, random_vectors(tiny, 15, 4)),),
    )
    return [JobSpec(p, 20, ignore_eos=True, embeddings=s) for p, s in zip(prompts, spans, strict=True)]


def test_chunks_preemption_and_prefix_hits_change_no_token(tiny: LoadedModel) -> None:
    specs = tiny_specs(tiny)
    want = [c.token_ids for c in tiny_gen(tiny).generate(specs)]
    plain = tiny_gen(tiny).generate([JobSpec(s.prompt_ids, 20, ignore_eos=True) for s in specs])
    assert all(w != p.token_ids for w, p in zip(want, plain, strict=True))  # the vectors were used
    for gen in (tiny_gen(tiny, chunk=3), tiny_gen(tiny, num_pages=26)):
        ids = [gen.enqueue(s) for s in specs]
        tokens: dict[JobId, list[int]] = {i: [] for i in ids}
        while gen.has_work():
            for e in gen.iterate():
                if isinstance(e, TokensGenerated):
                    tokens[e.job_id].extend(e.token_ids)
            gen.check_invariants()
        assert [tuple(tokens[i]) for i in ids] == want
        again = gen.generate(specs)  # prefix hits over the same vectors
        assert [c.token_ids for c in again] == want
        assert all_pages_idle(gen)


def test_bad_spans_are_refused_naming_the_field(tiny: LoadedModel) -> None:
    gen = tiny_gen(tiny)
    hidden = tiny.model.config.hidden_size
    good = random_vectors(tiny, 2, 0)
    for spans, field in (
        ((PromptEmbedding(0, 2, good[: -4 * hidden]),), r"embeddings\[0\]\.data"),
        ((PromptEmbedding(0, 2, good + good[: 4 * hidden]),), r"embeddings\[0\]\.data"),  # 3 rows of data
        ((PromptEmbedding(9, 2, good),), "outside the prompt"),
        ((PromptEmbedding(0, 2, good), PromptEmbedding(1, 2, good)), "overlaps"),
        ((PromptEmbedding(0, 0, b""),), r"rows must be >= 1"),
    ):
        with pytest.raises(InvalidRequestError, match=field):
            gen.enqueue(JobSpec(tuple(range(3, 13)), 4, embeddings=spans))
    wide = random_vectors(tiny, 1, 0) + b"\x00" * 4 * 1
    with pytest.raises(InvalidRequestError, match="hidden size"):
        gen.enqueue(JobSpec(tuple(range(3, 13)), 4, embeddings=(PromptEmbedding(0, 1, wide),)))
    nan = struct.pack("<f", math.nan) * hidden + good[4 * hidden :]
    with pytest.raises(
        InvalidRequestError, match=r"embeddings\[0\]\.data: holds values that are not finite"
    ) as bad:
        gen.enqueue(JobSpec(tuple(range(3, 13)), 4, embeddings=(PromptEmbedding(0, 2, nan),)))
    assert bad.value.field == "embeddings[0].data"  # the caller's BadRequest names it
    with pytest.raises(InvalidRequestError, match="token_healing"):
        gen.enqueue(
            JobSpec(tuple(range(3, 13)), 4, token_healing=True, embeddings=(PromptEmbedding(0, 2, good),))
        )
    assert not gen.has_work()


def test_placeholders_expand_in_order() -> None:
    a, b = b"\x00" * 8, b"\x01" * 12
    ids, spans = place_embeddings(
        (1, 7, 2, 9, 7, 3),
        [
            EmbeddingPlacement(2, a, placeholder_token_id=7),
            EmbeddingPlacement(3, b, placeholder_token_id=9),
            EmbeddingPlacement(1, a, placeholder_token_id=7),
        ],
    )
    assert ids == (1, 7, 7, 2, 9, 9, 9, 7, 3)
    assert [(s.position, s.rows) for s in spans] == [(1, 2), (4, 3), (7, 1)]
    with pytest.raises(InvalidRequestError, match=r"embeddings\[1\]\.placeholder_token_id"):
        place_embeddings((1, 7), [EmbeddingPlacement(1, a, placeholder_token_id=7)] * 2)
    with pytest.raises(InvalidRequestError, match="not both"):
        place_embeddings(
            (1, 7), [EmbeddingPlacement(1, a, position=0), EmbeddingPlacement(1, a, placeholder_token_id=7)]
        )
