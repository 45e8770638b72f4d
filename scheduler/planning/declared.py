"""Schedules as code: a file declares schedules, and applying it makes the database agree.

Pure: parsing a declaration (TOML, :func:`parse_declaration`) and comparing it with the
schedules stored (:func:`diff`) do no I/O; ``ScheduleStore.apply`` reads, diffs and
writes in one transaction, and ``duetime schedules apply`` prints the diff.

**Who owns a schedule.** A schedule created by a declaration carries its *source* (the
file's ``source = "..."``, by default the file's name) in ``schedules.managed_by``.
``--prune`` removes only schedules of that source that the file no longer declares: a
schedule created by hand (``managed_by`` NULL) or by another file is never removed, and
declaring a name that one of those already uses is a conflict unless the apply is told
to adopt it. Two services can each apply their own file with ``--prune`` without
touching each other's schedules.

**Paused is the operator's unless declared.** A declaration that omits ``paused``
leaves the stored flag alone, so a schedule an operator paused during an incident stays
paused across deploys; one that sets it makes it so.

**A changed schedule is planned again from now.** Jobs it planned ahead under the old
definition and not yet due are cancelled (as a pause does), so no job runs with the old
task, payload or timing after the apply commits.

A file looks like::

    source = "billing"            # optional; default: the file's name

    [schedules.nightly-report]
    task = "reports.nightly"
    cron = "30 2 * * *"
    tz = "Europe/Paris"
    payload = { kind = "full" }

    [schedules.heartbeat]
    task = "ping"
    every = "30s"
    overlap = "skip"
"""

from __future__ import annotations

import difflib
import json
import math
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any, Literal, Self

from scheduler.errors import InvalidInput
from scheduler.planning.interval import format_duration, parse_interval
from scheduler.planning.schedule import Schedule, ScheduleSpec
from scheduler.planning.timing import cached_cron

__all__ = [
    "SOURCE_PATTERN",
    "Change",
    "DeclaredSchedule",
    "ScheduleDeclaration",
    "diff",
    "parse_declaration",
]

#: What a source may be (the CHECK ``schedules_managed_by_invalid`` says the same).
SOURCE_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,199}")

#: The keys of a ``[schedules.NAME]`` table and the ``ScheduleSpec`` field each sets.
KEYS = {
    "task": "task",
    "cron": "cron",
    "every": "interval",
    "tz": "timezone",
    "payload": "payload",
    "queue": "queue",
    "max_attempts": "max_attempts",
    "start_at": "start_at",
    "end_at": "end_at",
    "paused": "paused",
    "misfire": "misfire_policy",
    "misfire_cap": "misfire_cap",
    "overlap": "overlap_policy",
    "jitter": "jitter",
}
#: The definition a declaration owns, compared field by field (``paused`` only when set).
COMPARED = (
    "task", "payload", "queue", "max_attempts", "cron", "interval", "timezone", "start_at",
    "end_at", "misfire_policy", "misfire_cap", "overlap_policy", "jitter",
)  # fmt: skip


@dataclass(frozen=True)
class DeclaredSchedule:
    """One schedule of a declaration; ``paused`` None: leave the stored flag alone."""

    spec: ScheduleSpec
    paused: bool | None = None


@dataclass(frozen=True)
class ScheduleDeclaration:
    source: str
    schedules: tuple[DeclaredSchedule, ...]

    @property
    def names(self) -> frozenset[str]:
        return frozenset(d.spec.name for d in self.schedules)

    @classmethod
    def of(cls, source: str, specs: Iterable[ScheduleSpec | DeclaredSchedule]) -> Self:
        """A declaration built in Python (``ScheduleSpec``: ``paused`` left alone)."""
        if not isinstance(source, str) or SOURCE_PATTERN.fullmatch(source) is None:
            raise InvalidInput(f"source must be 1-200 characters [A-Za-z0-9_.:/-] (got {source!r})")
        items = tuple(s if isinstance(s, DeclaredSchedule) else DeclaredSchedule(s) for s in specs)
        names = [d.spec.name for d in items]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise InvalidInput(f"schedules declared twice: {', '.join(twice)}")
        return cls(source, items)

    @classmethod
    def from_toml(cls, text: str, *, origin: str, default_source: str) -> Self:
        """``parse_declaration``."""
        return cls(*_parsed(text, origin=origin, default_source=default_source))


ChangeKind = Literal["create", "update", "unchanged", "remove", "undeclared", "conflict"]


@dataclass(frozen=True)
class Change:
    """What applying does to one schedule. ``fields`` maps each changed field to
    (stored, declared) as a user reads them; ``reason`` explains a conflict."""

    kind: ChangeKind
    name: str
    declared: DeclaredSchedule | None = None
    stored: Schedule | None = None
    fields: dict[str, tuple[str, str]] = field(default_factory=dict)
    reason: str = ""

    @property
    def writes(self) -> bool:
        return self.kind in ("create", "update", "remove")

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "name": self.name,
            "id": self.stored.id if self.stored is not None else None,
            "fields": {k: {"from": a, "to": b} for k, a, b in _items(self.fields)},
            "reason": self.reason or None,
        }


def _items(fields: Mapping[str, tuple[str, str]]) -> Iterable[tuple[str, str, str]]:
    for key, (old, new) in fields.items():
        yield key, old, new


# -- parsing ------------------------------------------------------------------------------


def _suggest(key: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _when(value: Any, where: str) -> datetime:
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    if isinstance(value, date):
        return datetime(value.year, value.month, value.day, tzinfo=UTC)
    if isinstance(value, str):
        try:
            parsed = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        except ValueError:
            raise InvalidInput(f"{where}: {value!r} is not an ISO 8601 time") from None
        return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
    raise InvalidInput(f"{where}: expected a time, got {type(value).__name__}")


def _seconds(value: Any, where: str) -> float:
    if isinstance(value, bool):
        raise InvalidInput(f"{where}: expected seconds or a duration like '30s'")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return parse_interval(value).total_seconds()
        except InvalidInput:
            pass
    raise InvalidInput(f"{where}: expected seconds or a duration like '30s', got {value!r}")


def _schedule(name: str, table: Any, where: str) -> DeclaredSchedule:
    if not isinstance(table, dict):
        raise InvalidInput(f"{where}: expected a table of settings")
    unknown = [k for k in table if k not in KEYS]
    if unknown:
        key = unknown[0]
        raise InvalidInput(f"{where}: unknown key {key!r}{_suggest(key, KEYS)}")
    kwargs: dict[str, Any] = {"name": name}
    for key, value in table.items():
        at = f"{where}.{key}"
        if key in ("start_at", "end_at"):
            value = _when(value, at)
        elif key == "jitter":
            value = _seconds(value, at)
        elif key == "paused":
            if not isinstance(value, bool):
                raise InvalidInput(f"{at}: expected true or false")
            continue
        elif key in ("task", "cron", "every", "tz", "queue", "misfire", "overlap"):
            if not isinstance(value, str):
                raise InvalidInput(f"{at}: expected a string, got {type(value).__name__}")
        elif key in ("max_attempts", "misfire_cap"):
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidInput(f"{at}: expected an integer")
        elif key == "payload" and not isinstance(value, dict):
            raise InvalidInput(f"{at}: expected a table (a JSON object)")
        kwargs[KEYS[key]] = value
    if "task" not in table:
        raise InvalidInput(f"{where}: 'task' is required")
    if ("cron" in table) == ("every" in table):
        raise InvalidInput(f"{where}: give exactly one of 'cron' and 'every'")
    try:
        spec = ScheduleSpec(**kwargs)
    except InvalidInput as exc:
        raise InvalidInput(f"{where}: {exc}") from None
    paused = table.get("paused")
    return DeclaredSchedule(spec, paused if isinstance(paused, bool) else None)


def parse_declaration(text: str, *, origin: str, default_source: str) -> ScheduleDeclaration:
    """The schedules ``text`` (TOML) declares; every error names ``origin`` and the key.

    Raises ``InvalidInput`` with one line for the first problem found."""
    return ScheduleDeclaration(*_parsed(text, origin=origin, default_source=default_source))


def _parsed(
    text: str, *, origin: str, default_source: str
) -> tuple[str, tuple[DeclaredSchedule, ...]]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InvalidInput(f"{origin}: not valid TOML: {exc}") from None
    unknown = [k for k in data if k not in ("source", "schedules")]
    if unknown:
        key = unknown[0]
        raise InvalidInput(
            f"{origin}: unknown top-level key {key!r}{_suggest(key, ('source', 'schedules'))}"
        )
    source = data.get("source", default_source)
    if not isinstance(source, str) or SOURCE_PATTERN.fullmatch(source) is None:
        raise InvalidInput(
            f"{origin}: source must be 1-200 characters [A-Za-z0-9_.:/-] starting with a "
            f"letter or digit (got {source!r})"
        )
    tables = data.get("schedules", {})
    if not isinstance(tables, dict):
        raise InvalidInput(f"{origin}: 'schedules' must be tables, e.g. [schedules.NAME]")
    declared = tuple(
        _schedule(name, table, f"{origin}: schedules.{name}") for name, table in tables.items()
    )
    return source, declared


# -- comparing ----------------------------------------------------------------------------


def _shown(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, timedelta):
        return format_duration(value)
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat().replace("+00:00", "Z")
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return str(value)


def _normal_cron(schedule: Schedule) -> str | None:
    """The stored cron as the spec normalizes it (a row written by plain SQL may be
    spelled differently); unparseable: as stored, so it compares as changed."""
    if schedule.cron is None:
        return None
    try:
        return cached_cron(schedule.cron, schedule.timezone).expr
    except Exception:
        return schedule.cron


def _same(key: str, stored: Any, declared: Any) -> bool:
    if key == "jitter":
        return math.isclose(float(stored), float(declared), abs_tol=1e-9)
    return bool(stored == declared)


def _changed(stored: Schedule, declared: DeclaredSchedule) -> dict[str, tuple[str, str]]:
    out: dict[str, tuple[str, str]] = {}
    spec = declared.spec
    for key in COMPARED:
        old = _normal_cron(stored) if key == "cron" else getattr(stored, key)
        new = getattr(spec, key)
        if not _same(key, old, new):
            out[key] = (_shown(old), _shown(new))
    if declared.paused is not None and declared.paused != stored.paused:
        out["paused"] = (_shown(stored.paused), _shown(declared.paused))
    return out


def diff(
    declaration: ScheduleDeclaration,
    stored: Sequence[Schedule],
    *,
    prune: bool = False,
    adopt: bool = False,
) -> list[Change]:
    """What applying ``declaration`` does, given the stored schedules that share a name
    with it or belong to its source; in the declaration's order, then the rest by name."""
    by_name = {s.name: s for s in stored}
    source = declaration.source
    changes: list[Change] = []
    for declared in declaration.schedules:
        name = declared.spec.name
        current = by_name.get(name)
        if current is None:
            changes.append(Change("create", name, declared))
            continue
        owner = current.managed_by
        if owner != source and not adopt:
            who = "made by hand" if owner is None else f"managed by source {owner!r}"
            reason = f"exists, {who}; adopt it to manage it from here"
            changes.append(Change("conflict", name, declared, current, reason=reason))
            continue
        fields = _changed(current, declared)
        if owner != source:
            fields["managed_by"] = (_shown(owner), source)
        kind: ChangeKind = "update" if fields else "unchanged"
        changes.append(Change(kind, name, declared, current, fields))
    for current in sorted(stored, key=lambda s: s.name):
        if current.managed_by == source and current.name not in declaration.names:
            changes.append(Change("remove" if prune else "undeclared", current.name,
                                  stored=current))  # fmt: skip
    return changes
