"""The import graph of dyngen's own modules: data flows one way, with no cycles.

Read from the source (every import statement, function-level ones included, since a cycle
held together by a function-level import is still a cycle), not by importing anything."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kernels", "engine", "service", "clients", "benchmarks")
# Lower layers never import higher ones: kernels know no model, the engine knows no service.
LAYERS = {"kernels": 0, "engine": 1, "service": 2}


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "node_modules" in path.parts or "proto" in path.parts:
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def _imported(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from pkg import mod` imports pkg.mod when it is a module; otherwise pkg itself.
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def _graph() -> dict[str, set[str]]:
    modules = _modules()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = {owner(i) for i in _imported(ast.parse(path.read_text(encoding="utf-8")))}
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start, targets in graph.items():
        if start in index:
            continue
        work = [(start, iter(sorted(targets)))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def test_the_checker_sees_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_lower_layers_import_no_higher_ones() -> None:
    wrong = [
        f"{name} imports {target}"
        for name, targets in _graph().items()
        for target in targets
        if (top := name.split(".")[0]) in LAYERS
        and (up := target.split(".")[0]) in LAYERS
        and LAYERS[up] > LAYERS[top]
    ]
    assert wrong == []


def test_clients_import_no_server_code() -> None:
    """clients/ holds the client packages only: nothing in it imports the engine, kernels or service."""
    wrong = []
    for path in sorted((ROOT / "clients").rglob("*.py")):
        if "node_modules" in path.parts:
            continue
        for name in _imported(ast.parse(path.read_text(encoding="utf-8"))):
            if name.split(".")[0] in ("engine", "kernels", "service", "benchmarks"):
                wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert wrong == []


def test_the_two_processes_sides_import_each_other_only_at_the_spawn_target() -> None:
    """service/frontend (the gRPC process) and service/engine (the engine process) meet through
    service/ipc only; the front end imports the engine side's entry point alone, to spawn it."""

    def inside(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    wrong = []
    for name, targets in _graph().items():
        for target in targets:
            spawn = target == "service.engine.process"
            if inside(name, "service.frontend") and inside(target, "service.engine") and not spawn:
                wrong.append(f"{name} imports {target}")
            if inside(name, "service.engine") and inside(target, "service.frontend"):
                wrong.append(f"{name} imports {target}")
    assert wrong == []


def _reach(graph: dict[str, set[str]], roots: list[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(graph.get(name, ()))
    return seen


def _public_proto_imports(path: Path) -> list[str]:
    return [
        n for n in _imported(ast.parse(path.read_text(encoding="utf-8"))) if n.startswith("dyngen_client")
    ]


def test_the_engine_process_never_sees_the_public_contract() -> None:
    """Internal messages cross the pipe both ways; the front end alone translates to and from
    dyngen.v1. Everything the engine process runs (the engine, service/engine, and what they import
    of ours) imports nothing of the client package, the generated stubs included."""
    graph = _graph()
    modules = _modules()
    engine_side = _reach(graph, [n for n in modules if n.startswith(("engine", "service.engine"))])
    wrong = [
        f"{name} imports {i}" for name in sorted(engine_side) for i in _public_proto_imports(modules[name])
    ]
    assert wrong == []
    assert "service.ipc" in engine_side  # the pipe's messages are the engine's types
