"""A job's tokens do not depend on how its tokens were split into steps, under the server's defaults
(the shipped model; --quant auto: quantized linears; --kv-cache auto: float16, bfloat16 where it
times faster, or int8 where the attention runs on AMX tiles): n-gram speculation (drafts verified
as chunks) gives the tokens of plain greedy decoding, and a job resumed from part of its output
(prompt and output prefilled again) the tokens of the uninterrupted run. Before chunk steps attended each token as a decode row,
speculation changed 6 of these 7 greedy outputs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.inprocess.lora_throughput import write_adapter
from engine.generator import DynamicGenerator
from engine.jobs import JobSpec
from engine.model.tokenizer import ChatMessage
from service.engine.build import build_engine
from service.engine_config import EngineSettings, SpeculationFlags
from service.speculation_flags import options_from_flags
from tests.conftest import PARITY_PROMPTS
from tests.job_events import run_jobs

pytestmark = pytest.mark.slow

N = 64
PROMPTS = (*PARITY_PROMPTS, "Repeat after me five times: the cat sat on the mat.")


def _generator(speculate: str) -> DynamicGenerator:
    """The generator `dyngen serve` builds with its defaults, and `speculate` as the drafter. Not
    warmed up, its drafts have the fixed length (num_draft_tokens) for every job."""
    options = options_from_flags(SpeculationFlags(speculate=speculate, speculate_max_batch=len(PROMPTS)))
    _, gen = build_engine(EngineSettings(model=None), options, False)
    return gen


def _prompts(gen: DynamicGenerator) -> list[tuple[int, ...]]:
    return [tuple(gen.tokenizer.encode_chat([ChatMessage("user", p)])) for p in PROMPTS]


@pytest.fixture(scope="module")
def plain() -> Iterator[DynamicGenerator]:
    gen = _generator("none")
    yield gen
    gen.close()


@pytest.fixture(scope="module")
def greedy(plain: DynamicGenerator) -> list[list[int]]:
    runs = run_jobs(
        plain, [JobSpec(prompt_ids=p, max_new_tokens=N, ignore_eos=True) for p in _prompts(plain)]
    )
    return [[t for e in deltas for t in e.token_ids] for deltas, _ in runs]


def test_speculation_gives_the_greedy_tokens(greedy: list[list[int]]) -> None:
    gen = _generator("ngram")
    try:
        runs = run_jobs(
            gen, [JobSpec(prompt_ids=p, max_new_tokens=N, ignore_eos=True) for p in _prompts(gen)]
        )
    finally:
        gen.close()
    assert sum(f.accepted_draft_tokens for _, f in runs) > 0  # drafts were verified and taken
    assert [[t for e in deltas for t in e.token_ids] for deltas, _ in runs] == greedy


def test_adaptive_speculation_gives_the_greedy_tokens(greedy: list[list[int]]) -> None:
    """Warmed up as the server does, draft lengths follow each job's acceptance and the measured
    step cost; one job at a time, where drafts pay most."""
    gen = _generator("ngram")
    try:
        gen.warmup()
        assert gen.speculation.policy is not None
        outputs, kept = [], 0
        for p in _prompts(gen):
            ((deltas, finished),) = run_jobs(gen, [JobSpec(prompt_ids=p, max_new_tokens=N, ignore_eos=True)])
            outputs.append([t for e in deltas for t in e.token_ids])
            kept += finished.accepted_draft_tokens
    finally:
        gen.close()
    assert kept > 0
    assert outputs == greedy


@pytest.mark.parametrize("cut", [1, 17, 40])
def test_a_resumed_job_gives_the_uninterrupted_tokens(
    plain: DynamicGenerator, greedy: list[list[int]], cut: int
) -> None:
    specs = [
        JobSpec(prompt_ids=p, max_new_tokens=N, ignore_eos=True, resume_output=tuple(out[:cut]))
        for p, out in zip(_prompts(plain), greedy, strict=True)
    ]
    runs = run_jobs(plain, specs)
    assert [
        out[:cut] + [t for e in deltas for t in e.token_ids]
        for out, (deltas, _) in zip(greedy, runs, strict=True)
    ] == greedy


def test_an_adapter_job_gives_the_same_tokens_alone_together_and_resumed(
    plain: DynamicGenerator, tmp_path: Path
) -> None:
    """A LoRA job's deltas are made a row at a time: the matrix library rounds one row apart from
    several, which made an adapter job's tokens depend on its run's size and on prefill vs decode."""
    config = plain.model.config
    write_adapter(
        tmp_path / "a", config, 8, ["q_proj", "o_proj", "down_proj"], range(config.num_layers), 4, 0.3
    )
    plain.load_adapter("a", tmp_path / "a")
    prompts = _prompts(plain)
    alone = [
        [
            t
            for e in run_jobs(plain, [JobSpec(prompt_ids=p, max_new_tokens=N, ignore_eos=True, adapter="a")])[
                0
            ][0]
            for t in e.token_ids
        ]
        for p in prompts[:3]
    ]
    together = run_jobs(
        plain, [JobSpec(prompt_ids=p, max_new_tokens=N, ignore_eos=True, adapter="a") for p in prompts[:3]]
    )
    assert [[t for e in deltas for t in e.token_ids] for deltas, _ in together] == alone
    resumed = run_jobs(
        plain,
        [
            JobSpec(
                prompt_ids=p, max_new_tokens=N, ignore_eos=True, adapter="a", resume_output=tuple(out[:17])
            )
            for p, out in zip(prompts[:3], alone, strict=True)
        ],
    )
    assert [
        out[:17] + [t for e in deltas for t in e.token_ids]
        for out, (deltas, _) in zip(alone, resumed, strict=True)
    ] == alone


def test_auto_drafts_only_where_it_changes_no_token() -> None:
    """`--speculate auto` (the default): n-gram drafts over the server's block linears, none over
    float linears, where BLAS rounds a token's logits apart by the step's row count."""
    auto = options_from_flags(SpeculationFlags())
    _, blocks = build_engine(EngineSettings(model=None), auto, False)
    _, floats = build_engine(EngineSettings(model=None, quant="none"), auto, False)
    try:
        assert blocks.drafter is not None and floats.drafter is None
    finally:
        blocks.close()
        floats.close()


def test_a_bfloat16_cache_keeps_drafts_and_resumes_exact() -> None:
    """`--kv-cache bfloat16` (bfloat16 pair products in the attention where the CPU has them): drafts
    verified as chunks, and a job resumed from part of its output, give plain decoding's tokens."""
    runs: dict[str, list[list[int]]] = {}
    for speculate in ("none", "ngram"):
        options = options_from_flags(SpeculationFlags(speculate=speculate, speculate_max_batch=len(PROMPTS)))
        _, gen = build_engine(EngineSettings(model=None, kv_cache="bfloat16"), options, False)
        try:
            assert "bfloat16" in gen.cache.describe()
            prompts = _prompts(gen)
            done = run_jobs(gen, [JobSpec(prompt_ids=p, max_new_tokens=N, ignore_eos=True) for p in prompts])
            runs[speculate] = [[t for e in deltas for t in e.token_ids] for deltas, _ in done]
            if speculate == "ngram":
                assert sum(f.accepted_draft_tokens for _, f in done) > 0
                continue
            resumed = run_jobs(
                gen,
                [
                    JobSpec(prompt_ids=p, max_new_tokens=N, ignore_eos=True, resume_output=tuple(out[:17]))
                    for p, out in zip(prompts, runs["none"], strict=True)
                ],
            )
            assert [
                out[:17] + [t for e in deltas for t in e.token_ids]
                for out, (deltas, _) in zip(runs["none"], resumed, strict=True)
            ] == runs["none"]
        finally:
            gen.close()
    assert runs["ngram"] == runs["none"]
