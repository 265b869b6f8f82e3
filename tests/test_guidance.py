"""Classifier-free guidance per job (engine/prompt/guidance.py, JobSpec.guidance).

The reference is transformers' own rule (`generate(guidance_scale=s, negative_prompt_ids=...)`)
on the same GGUF in float32: greedy tokens equal, alone and inside a batch of other jobs (on a cold
prefix cache). On a tiny random model: scale 1 is the job alone and scale 0 the negative prompt
alone (exact identities of the mix), and the pair's scheduling (chunks held back until both rows
end in one forward, preemption of both, cancel) changes no token and leaks no page.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import torch

from engine.errors import InvalidRequestError, PromptTooLongError
from engine.generator import DynamicGenerator, GeneratorConfig
from engine.grammar.constraints import ResponseFormat
from engine.jobs import JobFinished, JobId, JobSpec, SamplingSettings, StopReason, TokensGenerated
from engine.model.loader import LoadedModel
from engine.model.tokenizer import ChatMessage
from engine.prompt.guidance import Guidance
from engine.scheduler import SchedulerConfig
from engine.speculation.speculative import DrafterKind, SpeculationConfig
from tests.conftest import Reference
from tests.tiny_generator import all_pages_idle

NEW_TOKENS = 40

# (prompt, negative prompt, scale): chat prompts, answered by the shipped model.
CASES = (
    ("Write a short story about a dragon.", "Write a sad story.", 1.5),
    ("What is the capital of France?", "Answer in French.", 3.0),
    ("Describe the ocean.", "Describe the desert.", 3.0),
    ("Give me three tips for learning to cook.", "Be rude.", 1.5),
)
PLAIN = ("List three fruits that are red.", "Write a haiku about the sea.")


def chat(smollm: LoadedModel, text: str) -> tuple[int, ...]:
    return tuple(smollm.tokenizer.encode_chat([ChatMessage("user", text)]))


def common_head(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many leading tokens two sequences share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def reference_guided(
    ref: Reference, prompt: tuple[int, ...], negative: tuple[int, ...], scale: float
) -> list[int]:
    model: Any = ref.model
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            guidance_scale=scale,
            negative_prompt_ids=torch.tensor([negative]),
            eos_token_id=None,  # all NEW_TOKENS steps
            pad_token_id=2,
        )
    return [int(t) for t in out[0, len(prompt) :]]


@pytest.mark.slow
def test_greedy_tokens_equal_transformers_guidance_alone_and_in_a_batch(
    smollm: LoadedModel, reference: Reference
) -> None:
    gen = DynamicGenerator(smollm.model, smollm.tokenizer, GeneratorConfig(page_size=16, num_pages=256))
    guided = [
        JobSpec(chat(smollm, p), NEW_TOKENS, ignore_eos=True, guidance=Guidance(s, chat(smollm, n)))
        for p, n, s in CASES
    ]
    expected = [
        reference_guided(reference, spec.prompt_ids, spec.guidance.negative_prompt_ids, spec.guidance.scale)
        for spec in guided
        if spec.guidance is not None
    ]
    for spec, want in zip(guided, expected, strict=True):
        (alone,) = gen.generate([spec])
        assert list(alone.token_ids) == want
    plain = [JobSpec(chat(smollm, p), NEW_TOKENS, ignore_eos=True) for p in PLAIN]
    plain_alone = gen.generate(plain)
    gen.close()
    # Guided and plain jobs interleaved in one batch, on a cold prefix cache (each prompt's whole
    # prefill in the batch): each guided job as transformers, each plain job as without the guided ones.
    cold = DynamicGenerator(smollm.model, smollm.tokenizer, GeneratorConfig(page_size=16, num_pages=256))
    jobs = [guided[0], plain[0], guided[1], guided[2], plain[1], guided[3]]
    batch = cold.generate(jobs)
    # A job may find in the cache what it shares with the batch's other sequences (the chat
    # template's head, a first word), computed beside it; nothing more of its own prompt.
    negatives = [s.guidance.negative_prompt_ids for s in guided if s.guidance is not None]
    for c, spec in zip(batch, jobs, strict=True):
        others = [q for q in (*(j.prompt_ids for j in jobs), *negatives) if q != spec.prompt_ids]
        shared = max(common_head(spec.prompt_ids, q) for q in others)
        assert c.finished.cached_tokens <= shared < len(spec.prompt_ids), (c.finished.cached_tokens, shared)
    assert [list(batch[i].token_ids) for i in (0, 2, 3, 5)] == expected
    assert [batch[i].token_ids for i in (1, 4)] == [c.token_ids for c in plain_alone]
    cold.check_invariants()
    cold.close()


@pytest.mark.slow
def test_guided_json_at_temperature_0_8_is_valid_8_of_8(smollm: LoadedModel) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
        },
        "required": ["name", "age", "hobbies"],
        "additionalProperties": False,
    }
    prompt = chat(smollm, "Describe a fictional person as JSON with name, age and hobbies.")
    negative = chat(smollm, "Write a long poem.")
    gen = DynamicGenerator(smollm.model, smollm.tokenizer, GeneratorConfig(page_size=16, num_pages=512))
    specs = [
        JobSpec(
            prompt,
            max_new_tokens=120,
            sampling=SamplingSettings(temperature=0.8, seed=seed),
            response_format=ResponseFormat.json_schema(schema),
            guidance=Guidance(3.0, negative),
        )
        for seed in range(8)
    ]
    results = gen.generate([*specs, JobSpec(chat(smollm, PLAIN[0]), 30)])
    for r in results[:8]:
        assert r.finished.stop_reason is StopReason.GRAMMAR, r.text
        jsonschema.validate(json.loads(r.text), schema)
    gen.close()


def tiny_gen(
    tiny: LoadedModel,
    num_pages: int = 64,
    chunk: int = 64,
    batch: int = 16,
    speculation: DrafterKind = DrafterKind.NONE,
) -> DynamicGenerator:
    config = GeneratorConfig(
        page_size=4,
        num_pages=num_pages,
        scheduler=SchedulerConfig(max_batch_size=batch, max_chunk_size=chunk),
        speculation=SpeculationConfig(speculation, num_draft_tokens=3),
    )
    return DynamicGenerator(tiny.model, tiny.tokenizer, config)


PROMPTS = (tuple(range(3, 30)), (5, 6, 7), tuple(range(40, 12, -1)))
NEGATIVES = ((9, 10, 11), tuple(range(50, 90)), (3, 4, 5, 6, 7))


def guided_specs(scale: float = 2.5, new: int = 24) -> list[JobSpec]:
    return [
        JobSpec(p, new, ignore_eos=True, guidance=Guidance(scale, n))
        for p, n in zip(PROMPTS, NEGATIVES, strict=True)
    ]


def test_scale_one_is_the_job_alone_and_scale_zero_the_negative_prompt_alone(tiny: LoadedModel) -> None:
    gen = tiny_gen(tiny)
    plain = gen.generate([JobSpec(p, 24, ignore_eos=True) for p in PROMPTS])
    negative_alone = gen.generate([JobSpec(n, 24, ignore_eos=True) for n in NEGATIVES])
    assert [c.token_ids for c in gen.generate(guided_specs(1.0))] == [c.token_ids for c in plain]
    assert [c.token_ids for c in gen.generate(guided_specs(0.0))] == [c.token_ids for c in negative_alone]
    gen.check_invariants()
    assert all_pages_idle(gen)


def test_guidance_changes_the_output(tiny: LoadedModel) -> None:
    gen = tiny_gen(tiny)
    plain = gen.generate([JobSpec(p, 24, ignore_eos=True) for p in PROMPTS])
    guided = gen.generate(guided_specs(4.0))
    assert any(g.token_ids != p.token_ids for g, p in zip(guided, plain, strict=True))


def test_small_chunks_preemption_and_speculation_change_no_token(tiny: LoadedModel) -> None:
    """Chunks of 5 tokens (the pair's last tokens held back until both fit), a pool so small that
    pairs are preempted and recomputed, and n-gram speculation beside them: the same tokens."""
    specs = [*guided_specs(), JobSpec(tuple(range(20, 45)), 24, ignore_eos=True)]
    want = [c.token_ids for c in tiny_gen(tiny).generate(specs)]
    small_chunks = tiny_gen(tiny, chunk=5)
    assert [c.token_ids for c in small_chunks.generate(specs)] == want
    crowded = tiny_gen(tiny, num_pages=40)
    tokens, preemptions = run_counting_preemptions(crowded, specs)
    assert preemptions > 0, "the pool was large enough for no preemption: the test would not test it"
    assert tokens == want
    speculating = tiny_gen(tiny, speculation=DrafterKind.NGRAM)
    assert [c.token_ids for c in speculating.generate(specs)] == want
    for gen in (small_chunks, crowded, speculating):
        gen.check_invariants()
        assert all_pages_idle(gen)


def run_counting_preemptions(
    gen: DynamicGenerator, specs: list[JobSpec]
) -> tuple[list[tuple[int, ...]], int]:
    """Each job's tokens, and how many times jobs were preempted (each job's count, read every step
    while it is in the generator)."""
    ids = [gen.enqueue(s) for s in specs]
    tokens: dict[JobId, list[int]] = {i: [] for i in ids}
    preemptions: dict[JobId, int] = dict.fromkeys(ids, 0)
    while gen.has_work():
        for e in gen.iterate():
            if isinstance(e, TokensGenerated):
                tokens[e.job_id].extend(e.token_ids)
        for i, j in gen.jobs.items():
            if i in preemptions:
                preemptions[i] = max(preemptions[i], j.preemptions)
        gen.check_invariants()
    return [tuple(tokens[i]) for i in ids], sum(preemptions.values())


def test_a_preempted_pair_resumes_with_its_output(tiny: LoadedModel) -> None:
    specs = guided_specs(new=40)
    want = [c.token_ids for c in tiny_gen(tiny).generate(specs)]
    crowded = tiny_gen(tiny, num_pages=36)
    tokens, preemptions = run_counting_preemptions(crowded, specs)
    assert preemptions > 0, "the pool was large enough for no preemption: the test would not test it"
    assert tokens == want
    assert all_pages_idle(crowded)


def test_logprobs_are_of_the_guided_distribution(tiny: LoadedModel) -> None:
    gen = tiny_gen(tiny)
    spec = guided_specs(3.0)[0]
    with_logprobs = JobSpec(
        spec.prompt_ids, 8, ignore_eos=True, return_logprobs=True, top_logprobs=3, guidance=spec.guidance
    )
    (r,) = gen.generate([with_logprobs])
    (same,) = gen.generate([JobSpec(spec.prompt_ids, 8, ignore_eos=True, guidance=spec.guidance)])
    assert r.token_ids == same.token_ids
    for token, lp in zip(r.token_ids, r.logprobs, strict=True):
        assert lp.token_id == token and lp.top[0][0] == token  # greedy: the guided argmax
        assert lp.logprob <= 0.0


def test_cancel_frees_both_sequences_pages(tiny: LoadedModel) -> None:
    gen = tiny_gen(tiny)
    job = gen.enqueue(guided_specs(new=30)[1])
    for _ in range(3):
        gen.iterate()
    assert gen.stats().pages_used > 0
    gen.cancel(job)
    finished = [e for e in gen.iterate() if isinstance(e, JobFinished)]
    assert finished and finished[0].stop_reason is StopReason.CANCELLED
    gen.check_invariants()
    assert all_pages_idle(gen)


def test_bad_guidance_is_refused_at_enqueue(tiny: LoadedModel) -> None:
    gen = tiny_gen(tiny, num_pages=16)
    vocab = tiny.model.config.vocab_size
    for guidance, field in (
        (Guidance(float("nan"), (3,)), "guidance.scale"),
        (Guidance(-1.0, (3,)), "guidance.scale"),
        (Guidance(101.0, (3,)), "guidance.scale"),
        (Guidance(2.0, ()), "negative prompt"),
        (Guidance(2.0, (vocab,)), "negative prompt token ids"),
    ):
        with pytest.raises(InvalidRequestError, match=field):
            gen.enqueue(JobSpec((3, 4), 4, guidance=guidance))
    # 16 pages of 4: the prompt fits alone, not with a long negative prompt beside it.
    with pytest.raises(PromptTooLongError, match="negative prompt"):
        gen.enqueue(JobSpec((3, 4), 20, guidance=Guidance(2.0, tuple(range(3, 43)))))
    assert not gen.has_work()


@pytest.mark.slow
def test_banned_and_stop_strings_hold_on_a_guided_job(smollm: LoadedModel) -> None:
    """A banned word of the guided output never appears (the rewind takes the negative sequence back
    too, with its K/V); a stop string cuts the guided text where it starts."""
    prompt, negative, scale = CASES[0]
    guidance = Guidance(scale, chat(smollm, negative))
    gen = DynamicGenerator(smollm.model, smollm.tokenizer, GeneratorConfig(page_size=16, num_pages=256))
    (free,) = gen.generate([JobSpec(chat(smollm, prompt), NEW_TOKENS, ignore_eos=True, guidance=guidance)])
    words = [w.strip(".,;:!?\"'") for w in free.text.split()]
    banned = next(w for w in words[3:] if len(w) >= 4)
    stop = " ".join(free.text.split()[5:7])
    (no_word, stopped) = gen.generate(
        [
            JobSpec(
                chat(smollm, prompt), NEW_TOKENS, ignore_eos=True, guidance=guidance, banned_strings=(banned,)
            ),
            JobSpec(
                chat(smollm, prompt), NEW_TOKENS, ignore_eos=True, guidance=guidance, stop_strings=(stop,)
            ),
        ]
    )
    assert banned in free.text and banned not in no_word.text
    assert no_word.finished.error is None and no_word.finished.new_tokens == NEW_TOKENS
    assert stopped.finished.stop_reason is StopReason.STOP_STRING
    assert stopped.text == free.text[: free.text.index(stop)]
    gen.check_invariants()
    gen.close()
