"""No import cycles between the modules of ``scheduler/`` and ``workers/``, and no
import that runs up the floors of ``FLOORS``.

The graph is read from the source with ``ast``, not by importing it: every ``import``
and ``from ... import`` counts wherever it stands — at the top, under
``if TYPE_CHECKING:``, or inside a function (a lazy import hides a cycle, it does not
remove it). ``from package import name`` is an edge to ``package.name`` when that is a
module, else to the package. A package's ``__init__`` is the module named after the
package. Any cycle is reported with its path, e.g. ``a -> b -> a``.

Every module stands on one floor (the longest prefix in ``FLOORS`` that names it) and
may import only from its own floor or below; a module on no floor fails too, so a new
one has to be placed. The floors, from the ground up: leaves that know nothing of
duetime's services; configuration, messages and the database (the store and its SQL);
the broker and the publisher; the leader's duties; leadership (the elector and the
replica that runs the duties); and the applications that assemble them.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("scheduler", "workers", "demo")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(packages: Iterable[str]) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[module_name(path)] = path
    return found


def imported(path: Path, name: str, known: dict[str, Path]) -> Iterator[str]:
    """The known modules ``path`` (module ``name``) imports, anywhere in its body."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from _known(alias.name, known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                target = f"{base}.{alias.name}"
                yield from _known(target if target in known else base, known)


def _known(target: str, known: dict[str, Path]) -> Iterator[str]:
    """``target`` or its nearest enclosing module that is in the graph."""
    while target:
        if target in known:
            yield target
            return
        target = target.rpartition(".")[0]


def import_graph(packages: Iterable[str] = PACKAGES) -> dict[str, set[str]]:
    known = modules(packages)
    return {
        name: {t for t in imported(path, name, known) if t != name} for name, path in known.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component that has one (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: set[str] = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(_path_through(component, graph))
    return found


def _path_through(component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle from the component's first member back to itself."""
    start = min(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("leaves", (
        "scheduler.backoff", "scheduler.clock", "scheduler.cron", "scheduler.errors",
        "scheduler.jobspec", "scheduler.log", "scheduler.loopmon", "scheduler.metrics",
        "scheduler.planning", "scheduler.secrets", "scheduler.tracing", "scheduler.workflow",
    )),
    ("config, messages, db, sql, store", (
        "scheduler.config", "scheduler.db", "scheduler.messages", "scheduler.migrate",
        "scheduler.sql", "scheduler.startup", "scheduler.store",
    )),
    ("broker, publisher", (
        "scheduler.broker", "scheduler.broker_gate", "scheduler.broker_view",
        "scheduler.publisher", "scheduler.shards.router",
    )),
    ("duties", ("scheduler.duties",)),
    ("leadership", ("scheduler.leadership",)),
    ("apps", (
        "scheduler", "scheduler.cli", "scheduler.dashboard", "demo",
        "scheduler.health", "scheduler.observability", "scheduler.roles", "scheduler.service",
        "scheduler.shards", "scheduler.status", "workers",
    )),
)  # fmt: skip


def floor_of(module: str, floors: tuple[tuple[str, tuple[str, ...]], ...] = FLOORS) -> int | None:
    """The index of the floor whose longest matching prefix names ``module``."""
    best: tuple[int, int] | None = None
    for index, (_, prefixes) in enumerate(floors):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    return None if best is None else best[0]


def upward(
    graph: dict[str, set[str]], floors: tuple[tuple[str, tuple[str, ...]], ...] = FLOORS
) -> list[str]:
    """Every import of a module from a higher floor, as ``a [floor] -> b [floor]``."""
    found = []
    for name in sorted(graph):
        here = floor_of(name, floors)
        for target in sorted(graph[name]):
            there = floor_of(target, floors)
            if here is not None and there is not None and there > here:
                found.append(f"{name} [{floors[here][0]}] -> {target} [{floors[there][0]}]")
    return found


def test_the_checker_finds_an_upward_import() -> None:
    floors = (("low", ("p.low",)), ("high", ("p.high", "p")))
    graph = {"p": {"p.low"}, "p.low": {"p.high.x"}, "p.high.x": {"p.low"}}
    assert [floor_of(m, floors) for m in ("p", "p.low", "p.high.x", "q")] == [1, 0, 1, None]
    assert upward(graph, floors) == ["p.low [low] -> p.high.x [high]"]


def test_every_module_is_on_a_floor() -> None:
    lost = sorted(name for name in import_graph() if floor_of(name) is None)
    assert not lost, f"modules on no floor of FLOORS: {lost}"


def test_no_import_runs_up_the_floors() -> None:
    found = upward(import_graph())
    assert not found, "upward imports:\n" + "\n".join(found)


def test_the_checker_finds_a_cycle_and_its_path() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles(package: str) -> None:
    graph = import_graph()
    inside = {name for name in graph if name.split(".")[0] == package}
    found = [c for c in cycles(graph) if inside & set(c)]
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)
