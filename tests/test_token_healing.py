"""Token healing on the shipped model: a prompt cut mid-word continues as the whole word would.

The reference for each case is the model itself on the unbroken prompt: prompt + healed
output must read exactly as the unbroken prompt + its output (greedy), whatever the
tokenizer made of the cut. Without healing, some of the same prompts go astray, so the
check can fail.
"""

from __future__ import annotations

import pytest

from engine.errors import InvalidRequestError
from engine.generator import DynamicGenerator, GeneratorConfig
from engine.grammar.constraints import GrammarKind, ResponseFormat, allowed_tokens
from engine.jobs import JobSpec, SamplingSettings
from engine.model.loader import LoadedModel

pytestmark = pytest.mark.slow

# (prompt cut mid-word, the rest of the word). The cuts fall inside a token (" la" of " lazy")
# or across several (" Py" + "t" of " Python", " W" + "ashing" of " Washington").
CASES = (
    ("The quick brown fox jumps over the la", "zy"),
    ("The Eiffel Tow", "er"),
    ("My favourite programming language is Pyt", "hon"),
    ("The capital of the United States is Washing", "ton"),
    ("def fibonacci(n):\n    if n <= 1:\n        retu", "rn"),
)
NEW = 12


@pytest.fixture(scope="module")
def gen(smollm: LoadedModel) -> DynamicGenerator:
    return DynamicGenerator(smollm.model, smollm.tokenizer, GeneratorConfig(64, 64))


def _encode(model: LoadedModel, text: str) -> tuple[int, ...]:
    return tuple(model.tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize(("cut", "rest"), CASES)
def test_a_prompt_cut_mid_word_reads_as_the_whole_word(
    smollm: LoadedModel, gen: DynamicGenerator, cut: str, rest: str
) -> None:
    whole, healed = gen.generate(
        [
            JobSpec(_encode(smollm, cut + rest), max_new_tokens=NEW),
            # One more token: the healed job also writes the word's own token.
            JobSpec(_encode(smollm, cut), max_new_tokens=NEW + 1, token_healing=True),
        ]
    )
    assert healed.text.startswith(rest)
    assert cut + healed.text == cut + rest + whole.text
    # Reported counts: the taken-back tokens are not in the prompt; the word's tokens are output.
    assert healed.finished.prompt_tokens < len(_encode(smollm, cut))


def test_without_healing_the_cut_prompts_go_astray(smollm: LoadedModel, gen: DynamicGenerator) -> None:
    """The check above can fail: plain runs of the same cuts do not all continue the word."""
    plain = gen.generate([JobSpec(_encode(smollm, cut), max_new_tokens=NEW) for cut, _ in CASES])
    assert sum(not c.text.startswith(rest) for c, (_, rest) in zip(plain, CASES, strict=True)) >= 2


def test_healing_with_sampling_and_logprobs_spells_the_cut(
    smollm: LoadedModel, gen: DynamicGenerator
) -> None:
    cut = "My favourite programming language is Pyt"
    specs = [
        JobSpec(
            _encode(smollm, cut),
            max_new_tokens=8,
            token_healing=True,
            return_logprobs=True,
            sampling=SamplingSettings(temperature=1.0, seed=seed),
        )
        for seed in range(6)
    ]
    for c in gen.generate(specs):
        # Every output re-spells " Pyt" first: the text continues the cut word's letters.
        full = smollm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert full.startswith(" Pyt") and full[len(" Pyt") :] == c.text
        assert [lp.token_id for lp in c.logprobs] == list(c.token_ids)


def test_allowed_tokens_of_a_cut(smollm: LoadedModel, gen: DynamicGenerator) -> None:
    tok = smollm.tokenizer
    plan = gen.healer.plan(_encode(smollm, "over the la"))
    assert plan is not None and plan.removed == b" la" and plan.removed_text == " la"
    ids = (
        allowed_tokens(gen.healer.mask(plan.removed), smollm.model.config.vocab_size)
        .nonzero()
        .flatten()
        .tolist()
    )
    texts = {tok.decode([t]) for t in ids}
    assert {" lazy", " la", " l", " large"} <= texts
    assert all(t.startswith(" la") or " la".startswith(t) for t in texts)
    # Across tokens: " Py" + "t" is taken back whole.
    plan = gen.healer.plan(_encode(smollm, "language is Pyt"))
    assert plan is not None and plan.removed == b" Pyt"
    # Nothing to heal: a one-token prompt, or a special last token.
    assert gen.healer.plan(_encode(smollm, "Hi")) is None
    assert gen.healer.plan((*_encode(smollm, "Hi there"), 0)) is None


def test_healing_and_a_response_format_are_refused_together(gen: DynamicGenerator) -> None:
    with pytest.raises(InvalidRequestError, match="token_healing"):
        gen.enqueue(
            JobSpec((1, 2), token_healing=True, response_format=ResponseFormat(GrammarKind.REGEX, "a"))
        )
