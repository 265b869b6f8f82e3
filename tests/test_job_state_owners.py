"""One writer per piece of job state: a job's progress and pages are written by the scheduler
alone (as vLLM v1's scheduler alone moves num_computed_tokens), and only the scheduler asks the
page pool for pages or gives them back. The generator reports what a forward did
(`Scheduler.advance`, `truncate`, `begin_chunk`) and reads the rest.

Read from the source: any assignment, augmented assignment, item assignment, `del` or mutating
call on these attributes of an object other than `self`, outside the owner, is a failure."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OWNER = "engine/scheduler.py"
# JobState fields that say how far a job got and where its K/V live.
PROGRESS = {
    "computed",
    "pages",
    "registered",
    "stage",
    "prefix_copy",
    "draft_budget",
    "cached_tokens",
    "inflight",
    "page_hashes",
    "order",
    "preemptions",
}
# The page pool's methods that hand out, take back or re-key pages.
POOL_WRITES = {"allocate", "release", "register_full", "unregister", "take_prefix", "hold"}
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear"}
# (file, attribute): state of other classes that only shares a name.
OTHERS = {("tests/reference_generate.py", "computed")}  # its own _Running request, not a JobState


def _writes(tree: ast.AST) -> list[tuple[int, str]]:
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
        if isinstance(node, ast.Attribute) and node.attr in PROGRESS and not on_self:
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
            if node.func.attr in MUTATORS and isinstance(owner, ast.Attribute) and owner.attr in PROGRESS:
                target(owner)
            if node.func.attr in POOL_WRITES and isinstance(owner, ast.Attribute) and owner.attr == "pool":
                found.append((node.lineno, f"pool.{node.func.attr}"))
    return sorted(found)


def test_only_the_scheduler_writes_job_progress_and_pages() -> None:
    wrong = []
    # The engine only: the service sees jobs through the generator's events, never a JobState.
    for path in sorted((ROOT / "engine").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in (OWNER, "engine/pages.py"):
            continue
        for line, what in _writes(ast.parse(path.read_text(encoding="utf-8"))):
            if (rel, what) not in OTHERS:
                wrong.append(f"{rel}:{line} writes {what}")
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
"""
    assert [what for _, what in _writes(ast.parse(source))] == [
        "computed",
        "computed",
        "pages",
        "page_hashes",
        "pages",
        "prefix_copy",
        "pool.release",
    ]
