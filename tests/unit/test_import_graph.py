"""No import cycles between the modules of ``scheduler/`` and ``workers/``.

The graph is read from the source with ``ast``, not by importing it: every ``import``
and ``from ... import`` counts wherever it stands — at the top, under
``if TYPE_CHECKING:``, or inside a function (a lazy import hides a cycle, it does not
remove it). ``from package import name`` is an edge to ``package.name`` when that is a
module, else to the package. A package's ``__init__`` is the module named after the
package. Any cycle is reported with its path, e.g. ``a -> b -> a``.
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


def test_the_checker_finds_a_cycle_and_its_path() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles(package: str) -> None:
    graph = import_graph()
    inside = {name for name in graph if name.split(".")[0] == package}
    found = [c for c in cycles(graph) if inside & set(c)]
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)
