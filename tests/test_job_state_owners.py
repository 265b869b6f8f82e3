"""One writer per piece of job state. Every field of JobState (its own, and its rows' SequenceState
fields: a guided job's second row is a SequenceState too) has one module that may change it after
the job is built (or none: set at construction only), and the cache manager's own state is written
by the cache manager alone:

- the scheduler writes a job's progress (as vLLM v1's scheduler alone moves num_computed_tokens);
- the cache manager writes where its K/V live (page table, registrations, prefix-cache state) and
  is the only caller of the page pool's writes;
- token intake writes its tokens and output state; speculation its draft counts; the generator
  the rest it sets up.

Read from the source: any assignment, augmented assignment, item assignment, `del` or mutating
call on these attributes of an object other than `self`, outside the owner, is a failure."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from engine.job_state import JobState

ROOT = Path(__file__).resolve().parent.parent
# The writing module of each JobState field (after construction).
OWNERS: dict[str, set[str]] = {
    "engine/scheduler.py": {
        "computed",
        "stage",
        "order",
        "preemptions",
        "draft_budget",
        "cached_tokens",
        "skips",
    },
    "engine/cache/cache_manager.py": {"pages", "registered", "page_hashes", "inflight", "prefix_copy"},
    "engine/output/token_intake.py": {
        "tokens",
        "held",
        "position_bans",
        "rewinds",
        "healing",
        "first_token_at",
    },
    "engine/speculation/speculation_step.py": {"accepted_drafts", "rejected_drafts"},
    "engine/generator.py": {"started", "scheduled_at"},
}
# Fields no module changes once the job is built.
FIXED = {
    "job_id",
    "spec",
    "sampler",
    "text",
    "enqueued_at",
    "constraint",
    "heal",
    "adapter",
    "negative",
    "embeds",
    "prompt_len",
    "prefix_salt",
}
# The page pool's methods that hand out, take back or re-key pages: the cache manager's alone.
POOL_WRITES = {
    "allocate",
    "release",
    "register_full",
    "unregister",
    "take_prefix",
    "hold",
    "retain",
    "match_prefix",
}
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "update", "setdefault"}
# (file, attribute): state of other classes that only shares a name.
OTHERS = {
    ("tests/reference_generate.py", "computed"),  # its own _Running request, not a JobState
}


def _cache_manager_fields() -> set[str]:
    """The attributes CacheManager's __init__ sets on self."""
    source = (ROOT / "engine" / "cache" / "cache_manager.py").read_text(encoding="utf-8")
    init = next(
        n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "__init__"
    )
    fields = set()
    for node in ast.walk(init):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                fields.add(t.attr)
    return fields


def _writes(tree: ast.AST, watched: set[str]) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []

    def target(node: ast.expr) -> None:
        if isinstance(node, ast.Subscript):
            node = node.value
        if isinstance(node, ast.Tuple | ast.List):
            for item in node.elts:
                target(item)
            return
        on_self = (
            isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
        )
        if isinstance(node, ast.Attribute) and node.attr in watched and not on_self:
            found.append((node.lineno, node.attr))

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                target(t)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            target(node.target)
        elif isinstance(node, ast.Delete):
            for t in node.targets:
                target(t)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if node.func.attr in MUTATORS and isinstance(owner, ast.Attribute) and owner.attr in watched:
                target(owner)
            if node.func.attr in POOL_WRITES and isinstance(owner, ast.Attribute) and owner.attr == "pool":
                found.append((node.lineno, f"pool.{node.func.attr}"))
    return sorted(found)


def test_the_table_names_every_field_once() -> None:
    fields = {f.name for f in dataclasses.fields(JobState)}
    named = [f for owned in OWNERS.values() for f in owned] + sorted(FIXED)
    assert sorted(named) == sorted(fields), "every JobState field needs one owner (or FIXED)"
    assert _cache_manager_fields() >= {"pool", "_holders", "_inflight"}


def test_each_piece_of_job_state_has_one_writing_module() -> None:
    owner_of = {f: module for module, owned in OWNERS.items() for f in owned}
    cache_fields = _cache_manager_fields()
    watched = set(owner_of) | FIXED | cache_fields
    wrong = []
    # The engine only: the service sees jobs through the generator's events, never a JobState.
    for path in sorted((ROOT / "engine").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "engine/cache/pages.py":
            continue
        for line, what in _writes(ast.parse(path.read_text(encoding="utf-8")), watched):
            if (rel, what) in OTHERS:
                continue
            if what.startswith("pool.") or what in cache_fields:
                allowed = "engine/cache/cache_manager.py"
            else:
                allowed = owner_of.get(what, "(set at construction only)")
            if rel != allowed:
                wrong.append(f"{rel}:{line} writes {what} (its writer: {allowed})")
    assert wrong == []


def test_the_check_sees_each_kind_of_write() -> None:
    source = """
job.computed = 3
job.computed += 1
job.pages[0] = p
del job.page_hashes[2:]
job.pages.append(p)
a, job.prefix_copy = b, None
self.pool.release([p])
self.stage = 1
x = job.computed
job.tokens[1:3] = [4, 5]
"""
    watched = {"computed", "pages", "page_hashes", "prefix_copy", "stage", "tokens"}
    assert [what for _, what in _writes(ast.parse(source), watched)] == [
        "computed",
        "computed",
        "pages",
        "page_hashes",
        "pages",
        "prefix_copy",
        "pool.release",
        "tokens",
    ]
