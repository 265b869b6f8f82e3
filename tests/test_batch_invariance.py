"""Prompts run together (chunked prefill beside decode, shuffled pages) give the tokens they give alone."""

from __future__ import annotations

import random

import pytest

from engine.ids import PageId
from engine.model.loader import LoadedModel
from engine.model.tokenizer import ChatMessage
from tests.conftest import PARITY_PROMPTS
from tests.reference_generate import Completion, GenerationSettings, generate_batch

pytestmark = pytest.mark.slow

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def prompts(smollm: LoadedModel) -> list[list[int]]:
    return [smollm.tokenizer.encode_chat([ChatMessage("user", t)]) for t in PARITY_PROMPTS]


@pytest.fixture(scope="module")
def alone(smollm: LoadedModel, prompts: list[list[int]]) -> list[Completion]:
    settings = GenerationSettings(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    out = []
    for p in prompts:
        cache = smollm.model.new_cache(num_pages=1, page_size=256)
        out.extend(generate_batch(smollm.model, cache, [p], settings))
    return out


def shuffled_tables(lengths: list[int], page_size: int, seed: int) -> tuple[int, list[list[PageId]]]:
    """Page tables over a pool with spare pages, each table's pages scattered and out of order."""
    needs = [-(-n // page_size) for n in lengths]
    pool = [PageId(i) for i in range(sum(needs) + 7)]
    random.Random(seed).shuffle(pool)
    tables, at = [], 0
    for n in needs:
        tables.append(pool[at : at + n])
        at += n
    return len(pool), tables


@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize("chunk_tokens", [2048, 24])
def test_batch_gives_same_tokens_as_alone(
    smollm: LoadedModel, prompts: list[list[int]], alone: list[Completion], page_size: int, chunk_tokens: int
) -> None:
    # A 24-token budget splits every prompt into chunks that run beside other prompts' decode steps.
    settings = GenerationSettings(max_new_tokens=NEW_TOKENS, ignore_eos=True, max_chunk_tokens=chunk_tokens)
    num_pages, tables = shuffled_tables([len(p) + NEW_TOKENS for p in prompts], page_size, seed=page_size)
    flat = [p for t in tables for p in t]
    assert flat != sorted(flat), "pages should be scattered across the pool"
    cache = smollm.model.new_cache(num_pages=num_pages, page_size=page_size)
    together = generate_batch(smollm.model, cache, prompts, settings, page_tables=tables)
    for single, batched in zip(alone, together, strict=True):
        assert batched.token_ids == single.token_ids
