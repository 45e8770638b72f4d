"""JobSpec: what a producer asks for, validated before it reaches the database, so API
and CLI users read their mistake rather than a constraint name."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from scheduler.errors import InvalidInput
from scheduler.jobspec import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_QUEUE,
    JobSpec,
    parse_rate,
    resolve_due,
    validate_queue,
)

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def test_defaults() -> None:
    spec = JobSpec("send_email")
    assert spec.payload == {}
    assert spec.due_at is None
    assert spec.queue == DEFAULT_QUEUE == "default"
    assert spec.max_attempts == DEFAULT_MAX_ATTEMPTS == 5
    assert spec.idempotency_key is None


def test_full_spec_is_kept_as_given() -> None:
    due = datetime(2026, 5, 1, 9, 30, tzinfo=timezone(timedelta(hours=2)))
    spec = JobSpec(
        "t",
        {"a": [1, 2]},
        due_at=due,
        queue="q.1-x_y",
        max_attempts=1000,
        idempotency_key="k" * 500,
    )
    assert spec.due_at == due and spec.queue == "q.1-x_y" and spec.max_attempts == 1000


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"task": ""}, "task name must be a non-empty string"),
        ({"task": "   "}, "task name must be a non-empty string"),
        ({"task": None}, "task name must be a non-empty string"),
        ({"task": "x" * 201}, "longer than 200"),
        ({"payload": [1]}, "payload must be a JSON object (a dict), not list"),
        ({"payload": "{}"}, "not str"),
        ({"queue": ""}, "invalid queue name"),
        ({"queue": "has space"}, "invalid queue name"),
        ({"queue": "-leading"}, "invalid queue name"),
        ({"queue": "q" * 101}, "invalid queue name"),
        ({"max_attempts": 0}, "between 1 and 1000"),
        ({"max_attempts": 1001}, "between 1 and 1000"),
        ({"max_attempts": True}, "must be an integer"),
        ({"max_attempts": 2.0}, "must be an integer"),
        ({"due_at": "2026-01-01"}, "due_at must be a datetime"),
        ({"due_at": datetime(2026, 1, 1)}, "timezone-aware"),
        ({"due_at": datetime.min.replace(tzinfo=UTC)}, "out of range"),
        ({"due_at": datetime.max.replace(tzinfo=UTC)}, "out of range"),
        ({"due_at": datetime(1969, 12, 31, tzinfo=UTC)}, "out of range"),
        ({"idempotency_key": ""}, "idempotency_key must be 1-500 characters"),
        ({"idempotency_key": "k" * 501}, "idempotency_key must be 1-500 characters"),
        ({"idempotency_key": 7}, "idempotency_key must be 1-500 characters"),
    ],
)
def test_invalid_specs_name_the_mistake(kwargs: dict, message: str) -> None:
    args = {"task": "t", **kwargs}
    with pytest.raises(InvalidInput) as info:
        JobSpec(**args)
    assert message in str(info.value)


def test_validate_queue_returns_the_name() -> None:
    assert validate_queue("emails.high") == "emails.high"
    with pytest.raises(InvalidInput):
        validate_queue(None)  # type: ignore[arg-type]


def test_resolve_due() -> None:
    assert resolve_due(due_at=None, delay=None, now=NOW) is None
    assert resolve_due(due_at=NOW, delay=None, now=NOW - timedelta(days=1)) == NOW
    assert resolve_due(due_at=None, delay=90, now=NOW) == NOW + timedelta(seconds=90)
    assert resolve_due(due_at=None, delay=0.25, now=NOW) == NOW + timedelta(milliseconds=250)
    assert resolve_due(due_at=None, delay=timedelta(hours=2), now=NOW) == NOW + timedelta(hours=2)
    assert resolve_due(due_at=None, delay=0, now=NOW) == NOW


@pytest.mark.parametrize(
    ("due_at", "delay", "message"),
    [
        (NOW, 5, "either due_at or delay, not both"),
        (None, -1, "delay must be a finite number of seconds >= 0"),
        (None, timedelta(seconds=-1), "delay must be a finite number of seconds >= 0"),
        (None, float("nan"), "delay must be a finite number of seconds >= 0"),
        (None, float("inf"), "delay must be a finite number of seconds >= 0"),
        (None, timedelta(days=999_999_999), "too large"),
        (None, 1e15, "too large"),
    ],
)
def test_resolve_due_refuses(due_at: datetime | None, delay: object, message: str) -> None:
    with pytest.raises(InvalidInput) as info:
        resolve_due(due_at=due_at, delay=delay, now=NOW)  # type: ignore[arg-type]
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("100/s", (100, 1)),
        (" 5 / min ", (5, 60)),
        ("5/minute", (5, 60)),
        ("1000/h", (1000, 3600)),
        ("1/Hour", (1, 3600)),
        ("7/sec", (7, 1)),
    ],
)
def test_parse_rate_reads_a_count_per_period(text: str, parsed: tuple[int, int]) -> None:
    assert parse_rate(text) == parsed


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("100", "N/s, N/min or N/h"),
        ("100/day", "N/s, N/min or N/h"),
        ("-1/s", "N/s, N/min or N/h"),
        ("1.5/s", "N/s, N/min or N/h"),
        ("²/s", "N/s, N/min or N/h"),
        ("0/s", "between 1 and"),
        ("1000001/s", "between 1 and"),
    ],
)
def test_parse_rate_refuses_in_one_line(text: str, says: str) -> None:
    with pytest.raises(InvalidInput, match=says):
        parse_rate(text)


def test_tags_become_a_tuple_and_copy_lines_escape_them_twice() -> None:
    """A tag may hold quotes, backslashes and braces: the array literal quotes and
    escapes each element, then COPY's text format escapes the backslashes again.
    A batch without tags or meta keeps the columns it had (no tags, no meta sent)."""
    from datetime import UTC, datetime

    from scheduler.store.jobs import copy_lines

    now = datetime(2026, 12, 3, tzinfo=UTC)
    spec = JobSpec("t", tags=['q"uote', "back\\slash", "{b}"], meta={"k": "v"})
    assert spec.tags == ('q"uote', "back\\slash", "{b}")
    lines, _, tagged = copy_lines([spec], now)
    assert tagged
    fields = lines[0].rstrip("\n").split("\t")
    assert fields[-2:] == ['{"q\\\\"uote","back\\\\\\\\slash","{b}"}', '{"k":"v"}']
    plain, _, tagged = copy_lines([JobSpec("t")], now)
    assert not tagged and len(plain[0].split("\t")) == 7  # BULK_COLUMNS
