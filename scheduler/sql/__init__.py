"""Every SQL statement the duetime service runs lives in this folder (the demo, a user
of duetime, keeps its own in ``demo/demo.sql``).

``queries.sql``-style files hold named statements (``-- name: claim_due`` headers,
as procrastinate does); ``migrations/NNNN_name.sql`` hold schema changes. Logic
modules never build SQL strings: store classes load the named statements here, and
compose the few that share a select list from named fragments (``compose``).
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

_HEADER = re.compile(r"^--\s*name:\s*(?P<name>[a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


@cache
def load(group: str) -> dict[str, str]:
    """Return the named statements of ``<group>.sql`` as {name: sql}."""
    text = resources.files(__package__).joinpath(f"{group}.sql").read_text("utf-8")
    return named_statements(text, f"{group}.sql")


def named_statements(text: str, source: str) -> dict[str, str]:
    """The ``-- name:`` statements of ``text`` as {name: sql}; ``source`` names the file
    in errors. Public so a package outside this folder (the demo) reads its own file
    the same way."""
    queries: dict[str, str] = {}
    matches = list(_HEADER.finditer(text))
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        body = text[match.end() : end].strip()
        name = match.group("name")
        if name in queries:
            raise ValueError(f"duplicate query name {name!r} in {source}")
        queries[name] = body
    return queries


def fragment(group: str, name: str) -> str:
    """Named piece ``name`` of ``<group>.sql`` (a select list, a set of predicates) without
    its comment lines, for ``compose``."""
    lines = load(group)[name].splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith("--"))


def compose(group: str, name: str, **parts: str) -> str:
    """Statement ``name`` of ``<group>.sql`` with each ``{part}`` placeholder replaced by
    the text given (often a ``fragment``); comment lines are left as written. Statements
    that differ only in what they select or in one predicate share one text this way;
    each composed text is still one statement, prepared and planned as if written out."""
    lines = load(group)[name].splitlines()
    for part, value in parts.items():
        placeholder = "{" + part + "}"
        lines = [
            line if line.lstrip().startswith("--") else line.replace(placeholder, value)
            for line in lines
        ]
    return "\n".join(lines)


_PLACEHOLDER = re.compile(r"\$(\d+)")


def format_paramstyle(sql: str) -> tuple[str, tuple[int, ...]]:
    """A ``$1``-style statement (asyncpg's, as every file here writes them) for DB-API
    drivers' ``format`` paramstyle (psycopg, Django, SQLAlchemy's ``exec_driver_sql``):
    comment lines dropped (a ``$n`` or ``%`` in a comment would count as a parameter),
    every literal ``%`` doubled, and every ``$n`` made ``%s``. Returns the text and,
    for each ``%s`` in order, the 0-based index of the ``$n`` argument it stands for, so
    the same statement serves both kinds of driver and is written once."""
    lines = [line for line in sql.splitlines() if not line.lstrip().startswith("--")]
    text = "\n".join(lines).replace("%", "%%")
    order = tuple(int(m.group(1)) - 1 for m in _PLACEHOLDER.finditer(text))
    return _PLACEHOLDER.sub("%s", text), order


def migrations() -> list[tuple[int, str, str]]:
    """All shipped migrations as (version, name, sql), ordered by version."""
    folder = resources.files(__package__).joinpath("migrations")
    found: list[tuple[int, str, str]] = []
    for entry in folder.iterdir():
        match = re.fullmatch(r"(\d{4})_([a-z0-9_]+)\.sql", entry.name)
        if match:
            found.append((int(match.group(1)), match.group(2), entry.read_text("utf-8")))
    found.sort()
    versions = [v for v, _, _ in found]
    if len(set(versions)) != len(versions):
        raise ValueError(f"duplicate migration versions: {versions}")
    return found
