"""Schedules as code, the pure part: parsing a declaration and diffing it with rows."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from scheduler.errors import InvalidInput
from scheduler.planning import Schedule
from scheduler.planning.declared import ScheduleDeclaration, diff, parse_declaration

NOW = datetime(2026, 12, 3, tzinfo=UTC)


def stored(name: str, *, managed_by: str | None = "ops", **over: object) -> Schedule:
    values: dict[str, object] = dict(
        id=1, name=name, task="tick", payload={}, queue="default", max_attempts=5, cron=None,
        interval=timedelta(seconds=30), timezone="UTC", start_at=None, end_at=None,
        paused=False, misfire_policy="skip", misfire_cap=100, overlap_policy="allow",
        jitter=0.0, next_fire_at=None, buffered_fire_at=None, last_fired_at=None,
        last_job_id=None, fired_count=0, skipped_count=0, missed_count=0, last_error=None,
        created_at=NOW, updated_at=NOW, managed_by=managed_by,
    )  # fmt: skip
    values.update(over)
    return Schedule(**values)  # type: ignore[arg-type]


def parse(text: str) -> ScheduleDeclaration:
    return parse_declaration(text, origin="s.toml", default_source="s.toml")


def test_every_key_is_read_and_the_source_defaults_to_the_file_name() -> None:
    d = parse(
        """
        [schedules.n]
        task = "t"
        cron = "0 3 * * *"
        tz = "Europe/Paris"
        payload = { a = 1 }
        queue = "q"
        max_attempts = 3
        start_at = 2027-01-01T00:00:00Z
        end_at = "2028-01-01"
        misfire = "fire_once"
        misfire_cap = 7
        overlap = "skip"
        jitter = "30s"
        """
    )
    assert d.source == "s.toml"
    (item,) = d.schedules
    spec = item.spec
    assert (spec.name, spec.task, spec.cron, spec.timezone) == (
        "n",
        "t",
        "0 3 * * *",
        "Europe/Paris",
    )
    assert (spec.payload, spec.queue, spec.max_attempts) == ({"a": 1}, "q", 3)
    assert spec.start_at == datetime(2027, 1, 1, tzinfo=UTC)
    assert spec.end_at == datetime(2028, 1, 1, tzinfo=UTC)
    assert (spec.misfire_policy, spec.misfire_cap, spec.overlap_policy) == ("fire_once", 7, "skip")
    assert spec.jitter == 30.0
    assert item.paused is None  # not declared: the stored flag is left alone


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("[schedules.a]\ntask='t'\nevry='1m'\n", "unknown key 'evry' (did you mean 'every'?)"),
        ("[schedules.a]\ncron='* * * * *'\n", "'task' is required"),
        ("[schedules.a]\ntask='t'\nevery='1m'\nmax_attempts='3'\n", "expected an integer"),
        ("[schedules.a]\ntask='t'\nevery='1m'\njitter=true\n", "expected seconds"),
        ("[schedules.a]\ntask='t'\nevery='1m'\ntz='Mars/Base'\n", "schedules.a: "),
        ("source = 'has space'\n", "source must be"),
        ("schedules = 3\n", "'schedules' must be tables"),
    ],
)
def test_bad_declarations_name_the_file_and_the_key(text: str, fragment: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        parse(text)
    assert fragment in str(refused.value)
    assert str(refused.value).startswith("s.toml")


def test_a_cron_spelled_differently_by_plain_sql_is_not_a_change() -> None:
    d = parse("[schedules.a]\ntask='tick'\ncron='0 0 * * *'\n")
    row = stored("a", cron="0  0 * * *", interval=None, managed_by="s.toml")
    (change,) = diff(d, [row])
    assert change.kind == "unchanged", change.fields


def test_diff_kinds() -> None:
    d = parse(
        "source='ops'\n"
        "[schedules.same]\ntask='tick'\nevery='30s'\n"
        "[schedules.changed]\ntask='tick'\nevery='1m'\npaused=true\n"
        "[schedules.new]\ntask='tick'\nevery='30s'\n"
        "[schedules.theirs]\ntask='tick'\nevery='30s'\n"
    )
    rows = [
        stored("same"), stored("changed"), stored("gone"),
        stored("theirs", managed_by="billing"), stored("by-hand", managed_by=None),
    ]  # fmt: skip
    changes = {c.name: c for c in diff(d, rows)}
    assert {n: c.kind for n, c in changes.items()} == {
        "same": "unchanged", "changed": "update", "new": "create", "theirs": "conflict",
        "gone": "undeclared",
    }  # fmt: skip
    assert changes["changed"].fields == {"interval": ("30s", "1m"), "paused": ("False", "True")}
    assert "managed by source 'billing'" in changes["theirs"].reason
    pruned = {c.name: c.kind for c in diff(d, rows, prune=True, adopt=True)}
    assert pruned["gone"] == "remove" and pruned["theirs"] == "update"
    adopted = {c.name: c for c in diff(d, rows, adopt=True)}
    assert adopted["theirs"].kind == "update"
    assert adopted["theirs"].fields == {"managed_by": ("billing", "ops")}
