"""Every timing decision in the core asks a ``Clock`` (``scheduler/clock.py``), so a
test can drive it with ``ManualClock`` instead of sleeping.

The core is ``scheduler/``, ``workers/`` and ``duetime/``; ``scheduler/clock.py`` is
where the system clock is read, and the demo (its own package) is not core. Read with
``ast``, not grep: ``time.time()``, ``time.monotonic()`` and ``datetime.now()`` are
found however they are imported (``import time as t``, ``from time import
monotonic``, ``from datetime import datetime``, ``import datetime``), and whether
they are called or passed on (``default_factory=time.monotonic`` reads the system
clock just the same). Comments and strings that name them do not count.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = ("scheduler", "workers", "duetime")
CLOCK = "scheduler/clock.py"

#: Files allowed to read the system clock directly besides ``scheduler/clock.py``: none.
#: An entry whose file no longer reads the clock fails the last test, so the list can
#: only shrink.
ALLOWED: frozenset[str] = frozenset()

#: (module, function) pairs that read the system clock.
FORBIDDEN = {("time", "time"), ("time", "monotonic"), ("datetime.datetime", "now")}


def core_files() -> Iterator[Path]:
    for package in CORE:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.relative_to(ROOT).as_posix() != CLOCK:
                yield path


def clock_reads(source: str, filename: str = "<string>") -> list[tuple[int, str]]:
    """(line, spelling) of every direct use of a forbidden clock function in ``source``."""
    tree = ast.parse(source, filename)
    modules: dict[str, str] = {}  # local name -> module it names ("t" -> "time")
    functions: dict[str, tuple[str, str]] = {}  # local name -> (module, function)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in ("time", "datetime"):
                    modules[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module in ("time", "datetime"):
            for alias in node.names:
                local = alias.asname or alias.name
                if node.module == "datetime" and alias.name == "datetime":
                    modules[local] = "datetime.datetime"
                elif node.module == "time":
                    functions[local] = ("time", alias.name)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and functions.get(node.id) in FORBIDDEN:
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute):
            owner = _module_of(node.value, modules)
            if (owner, node.attr) in FORBIDDEN:
                found.append((node.lineno, f"{ast.unparse(node.value)}.{node.attr}"))
    return sorted(found)


def _module_of(node: ast.expr, modules: dict[str, str]) -> str | None:
    """The module ``node`` names: a local alias, or ``<alias>.datetime``."""
    if isinstance(node, ast.Name):
        return modules.get(node.id)
    if isinstance(node, ast.Attribute) and node.attr == "datetime":
        if isinstance(node.value, ast.Name) and modules.get(node.value.id) == "datetime":
            return "datetime.datetime"
    return None


def offenders() -> dict[str, list[tuple[int, str]]]:
    found = {}
    for path in core_files():
        reads = clock_reads(path.read_text(), str(path))
        if reads:
            found[path.relative_to(ROOT).as_posix()] = reads
    return found


def test_the_checker_sees_every_spelling() -> None:
    source = """
import time
import time as t
import datetime
import datetime as dt
from time import monotonic, sleep
from time import time as now
from datetime import datetime as DT, UTC, timedelta

a = time.time()
b = t.monotonic()
c = datetime.datetime.now(UTC)
d = dt.datetime.now()
e = monotonic()
f = now()
g = DT.now(UTC)
h = field(default_factory=time.monotonic)
# time.time() in a comment, and in a string:
s = "datetime.now()"
ok = (time.perf_counter(), sleep, timedelta(seconds=1), DT.fromisoformat(s), x.now())
"""
    assert [line for line, _ in clock_reads(source)] == [10, 11, 12, 13, 14, 15, 16, 17]


def test_the_core_reads_time_only_through_scheduler_clock() -> None:
    found = {path: reads for path, reads in offenders().items() if path not in ALLOWED}
    assert not found, "read the time through scheduler.clock (a Clock), not directly:\n" + (
        "\n".join(
            f"  {path}:{line}: {spelling}" for path, r in found.items() for line, spelling in r
        )
    )


def test_the_allow_list_names_only_files_that_still_need_it() -> None:
    fixed = sorted(ALLOWED - set(offenders()))
    assert not fixed, f"these no longer read the clock directly; drop them from ALLOWED: {fixed}"
