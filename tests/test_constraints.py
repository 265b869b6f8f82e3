"""Constrained decoding on the shipped model: JSON schemas, regexes and a Lark grammar.

Outputs are checked by libraries that had no part in producing them: `jsonschema` for the
schemas, `re` for the regexes, `lark` for the grammar.
"""

from __future__ import annotations

import json
import re

import jsonschema
import lark
import pytest

from engine.errors import InvalidRequestError
from engine.generator import DynamicGenerator, GeneratorConfig
from engine.grammar.constraints import GrammarKind, ResponseFormat
from engine.jobs import JobFinished, JobSpec, SamplingSettings, StopReason, TokensGenerated
from engine.model.loader import LoadedModel
from engine.model.tokenizer import ChatMessage
from engine.scheduler import SchedulerConfig

pytestmark = pytest.mark.slow

_TEXT = {"type": "string", "maxLength": 24}

SCHEMAS: dict[str, dict[str, object]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": _TEXT,
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": _TEXT,
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "address": {
        "type": "object",
        "properties": {
            "street": _TEXT,
            "city": _TEXT,
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "country": {"enum": ["US", "CA", "MX"]},
        },
        "required": ["street", "city", "zip", "country"],
        "additionalProperties": False,
    },
    "product": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1},
            "title": _TEXT,
            "price": {"type": "number", "minimum": 0, "maximum": 10000},
            "tags": {"type": "array", "items": _TEXT, "maxItems": 3},
            "in_stock": {"type": "boolean"},
        },
        "required": ["id", "title", "price", "in_stock"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "maxLength": 12},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 8},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 10},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            },
            "status": {"enum": ["pending", "shipped", "delivered"]},
        },
        "required": ["order_id", "items", "status"],
        "additionalProperties": False,
    },
    "event": {
        "type": "object",
        "properties": {
            "name": _TEXT,
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "attendees": {"type": "integer", "minimum": 0, "maximum": 500},
            "location": {
                "type": "object",
                "properties": {"city": _TEXT, "online": {"type": "boolean"}},
                "required": ["online"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "date", "location"],
        "additionalProperties": False,
    },
    "weather": {
        "type": "object",
        "properties": {
            "city": _TEXT,
            "temperature_c": {"type": "number", "minimum": -50, "maximum": 60},
            "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]},
            "forecast": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
        },
        "required": ["city", "temperature_c", "conditions"],
        "additionalProperties": False,
    },
    "review": {
        "type": "object",
        "properties": {
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            "title": {"type": "string", "maxLength": 30},
            "pros": {"type": "array", "items": _TEXT, "maxItems": 2},
            "recommend": {"type": "boolean"},
        },
        "required": ["rating", "recommend"],
        "additionalProperties": False,
    },
    "config": {
        "type": "object",
        "properties": {
            "debug": {"type": "boolean"},
            "level": {"enum": ["low", "medium", "high"]},
            "retries": {"type": "integer", "minimum": 0, "maximum": 5},
            "timeout": {"type": "number", "minimum": 0},
        },
        "required": ["debug", "level", "retries"],
        "additionalProperties": False,
    },
}

REGEXES = [
    r"[0-9]{3}-[0-9]{4}",
    r"(yes|no), because [a-z ]{1,30}\.",
    r"#[0-9a-f]{6}",
    r"[A-Z][a-z]{1,12} [A-Z][a-z]{1,12}",
]

# One grammar in the dialect both llguidance and the lark package read.
ARITHMETIC = r"""
start: expr
expr: term (OP term)*
term: NUMBER | "(" expr ")"
OP: "+" | "-" | "*"
NUMBER: /[0-9]{1,3}/
"""


def _prompt(smollm: LoadedModel, text: str) -> tuple[int, ...]:
    return tuple(smollm.tokenizer.encode_chat([ChatMessage("user", text)]))


def _generator(smollm: LoadedModel, pages: int = 320) -> DynamicGenerator:
    sched = SchedulerConfig(max_batch_size=64)
    return DynamicGenerator(smollm.model, smollm.tokenizer, GeneratorConfig(64, pages, scheduler=sched))


def test_64_concurrent_jobs_each_with_its_schema_all_validate(smollm: LoadedModel) -> None:
    gen = _generator(smollm)
    names = list(SCHEMAS)
    specs = []
    for i in range(64):
        name = names[i % len(names)]
        specs.append(
            JobSpec(
                _prompt(smollm, f"Give an example {name} record as JSON."),
                max_new_tokens=200,
                response_format=ResponseFormat.json_schema(SCHEMAS[name]),
                sampling=SamplingSettings(temperature=0.8, seed=i),
            )
        )
    results = gen.generate(specs)
    complete = 0
    for i, (spec, r) in enumerate(zip(specs, results, strict=True)):
        if r.finished.stop_reason is StopReason.GRAMMAR:
            jsonschema.validate(json.loads(r.text), SCHEMAS[names[i % len(names)]])
            complete += 1
            continue
        # Sampling may run a number on for ever (digits are always allowed): cut by max_new_tokens,
        # its output is still a prefix the schema's grammar accepts, token by token.
        assert r.finished.stop_reason is StopReason.MAX_NEW_TOKENS, (i, r.text)
        assert spec.response_format is not None
        matcher = gen.grammars.compile(spec.response_format)
        assert all(matcher.try_accept(t) for t in r.token_ids), (i, r.text)
    assert complete >= 60, complete
    gen.close()


def test_regexes_and_a_lark_grammar_hold_beside_free_jobs(smollm: LoadedModel) -> None:
    gen = _generator(smollm, pages=64)
    free = JobSpec(_prompt(smollm, "Say hello."), max_new_tokens=12, ignore_eos=True)
    alone = gen.generate([free])[0]
    specs = [
        JobSpec(
            _prompt(smollm, "Answer in the requested format."),
            max_new_tokens=60,
            response_format=ResponseFormat(GrammarKind.REGEX, rx),
            sampling=SamplingSettings(temperature=0.8, seed=i),
        )
        for i, rx in enumerate(REGEXES * 2)
    ]
    specs += [
        JobSpec(
            _prompt(smollm, "Write an arithmetic expression."),
            max_new_tokens=60,
            response_format=ResponseFormat(GrammarKind.LARK, ARITHMETIC),
            sampling=SamplingSettings(temperature=0.8, seed=100 + i),
        )
        for i in range(4)
    ]
    results = gen.generate([free, *specs])
    # The unconstrained job beside them is untouched by their masks.
    assert results[0].token_ids == alone.token_ids
    parser = lark.Lark(ARITHMETIC)
    for spec, r in zip(specs, results[1:], strict=True):
        fmt = spec.response_format
        assert fmt is not None
        if fmt.kind is GrammarKind.LARK and r.finished.stop_reason is StopReason.MAX_NEW_TOKENS:
            # A sampled expression may go on past max_new_tokens (the grammar never has to end it):
            # what it wrote is still a prefix the grammar accepts, token by token.
            matcher = gen.grammars.compile(fmt)
            assert all(matcher.try_accept(t) for t in r.token_ids), r.text
            continue
        assert r.finished.stop_reason in (StopReason.GRAMMAR, StopReason.EOS), r.text
        if fmt.kind is GrammarKind.REGEX:
            assert re.fullmatch(fmt.source, r.text), (fmt.source, r.text)
        else:
            parser.parse(r.text)
    gen.close()


def test_bad_formats_are_refused_at_enqueue_with_the_compilers_message(smollm: LoadedModel) -> None:
    gen = _generator(smollm, pages=16)
    prompt = _prompt(smollm, "Hi")
    bad = [
        (ResponseFormat(GrammarKind.JSON_SCHEMA, '{"type": "objectx"}'), "objectx"),
        (ResponseFormat(GrammarKind.JSON_SCHEMA, "{not json"), "json_schema"),
        (ResponseFormat(GrammarKind.REGEX, "[a-"), "unclosed"),
        (ResponseFormat(GrammarKind.LARK, "start: undefined_rule"), "undefined_rule"),
        (ResponseFormat(GrammarKind.REGEX, ""), "empty"),
        (ResponseFormat(GrammarKind.GBNF, "root ::= item"), "Rule 'item' not found"),
        (ResponseFormat(GrammarKind.GBNF, 'start ::= "a"'), "root"),
        (ResponseFormat(GrammarKind.JSON_SCHEMA, "false"), "admits no value"),
        (ResponseFormat(GrammarKind.JSON_SCHEMA, "5"), "object or a boolean"),
    ]
    for fmt, words in bad:
        with pytest.raises(InvalidRequestError, match=words) as refused:
            gen.enqueue(JobSpec(prompt, response_format=fmt))
        assert refused.value.field == "response_format"
    assert not gen.jobs and not gen.has_work()  # nothing was queued
    gen.close()


def test_the_schema_true_admits_any_json_value(smollm: LoadedModel) -> None:
    gen = _generator(smollm, pages=16)
    spec = JobSpec(
        _prompt(smollm, "Give me a JSON list of three colours."),
        max_new_tokens=48,
        response_format=ResponseFormat(GrammarKind.JSON_SCHEMA, "true"),
    )
    result = gen.generate([spec])[0]
    assert result.finished.stop_reason is StopReason.GRAMMAR
    json.loads(result.text)  # any value, but a value
    gen.close()


def test_compiled_grammars_are_cached_by_content(smollm: LoadedModel) -> None:
    gen = _generator(smollm, pages=16)
    fmt = ResponseFormat.json_schema(SCHEMAS["person"])
    first = gen.grammars.compile(fmt)
    again = gen.grammars.compile(ResponseFormat.json_schema(json.dumps(SCHEMAS["person"])))
    assert first is not again  # each job gets its own matcher state...
    assert gen.grammars.cached == 1  # ...copied from one compiled grammar
    gen.close()


def test_a_constrained_job_survives_preemption(smollm: LoadedModel) -> None:
    # A pool too small for both jobs' outputs: the newer one is preempted and resumes.
    gen = DynamicGenerator(smollm.model, smollm.tokenizer, GeneratorConfig(8, 12))
    schema = {**SCHEMAS["review"], "required": ["rating", "title", "pros", "recommend"]}
    specs = [
        JobSpec(
            _prompt(smollm, "Review a movie as JSON."),
            max_new_tokens=60,
            response_format=ResponseFormat.json_schema(schema),
            sampling=SamplingSettings(temperature=0.8, seed=s),
        )
        for s in (1, 2)
    ]
    ids = [gen.enqueue(s) for s in specs]
    texts = {i: "" for i in ids}
    reasons: dict[str, StopReason] = {}
    preempted = 0
    while gen.has_work():
        for e in gen.iterate():
            if isinstance(e, TokensGenerated):
                texts[e.job_id] += e.text
            elif isinstance(e, JobFinished):
                texts[e.job_id] += e.text
                reasons[e.job_id] = e.stop_reason
        preempted = max([preempted, *(j.preemptions for j in gen.jobs.values())])
    assert preempted > 0
    for i in ids:
        assert reasons[i] is StopReason.GRAMMAR
        jsonschema.validate(json.loads(texts[i]), schema)
    gen.close()


def test_constrained_jobs_speculate_with_drafts_checked_against_the_grammar(smollm: LoadedModel) -> None:
    """N-gram drafts for schema-held jobs: drafts the grammar refuses are cut before verification,
    the matcher is rolled back after walking them, and the outputs are the ones without speculation
    (greedy), or valid (sampled)."""
    from engine.speculation.speculative import DrafterKind, SpeculationConfig

    names = ["person", "order", "event", "product"]
    specs = [
        JobSpec(
            _prompt(smollm, f"Give an example {name} record as JSON."),
            max_new_tokens=160,
            response_format=ResponseFormat.json_schema(SCHEMAS[name]),
            sampling=SamplingSettings(temperature=0.0 if i < 2 else 0.8, seed=i),
        )
        for i, name in enumerate(names)
    ]
    plain = _generator(smollm).generate(specs)
    spec = SpeculationConfig(DrafterKind.NGRAM, num_draft_tokens=4, max_batch_size=4)
    gen = DynamicGenerator(
        smollm.model,
        smollm.tokenizer,
        GeneratorConfig(64, 320, scheduler=SchedulerConfig(max_batch_size=64), speculation=spec),
    )
    fast = gen.generate(specs)
    for i, (a, b) in enumerate(zip(plain, fast, strict=True)):
        assert b.finished.stop_reason is StopReason.GRAMMAR, b.text
        jsonschema.validate(json.loads(b.text), SCHEMAS[names[i]])
        if i < 2:
            assert a.text == b.text
    assert sum(r.finished.accepted_draft_tokens for r in fast) > 0
    assert sum(r.finished.rejected_draft_tokens for r in fast) > 0
    gen.close()
