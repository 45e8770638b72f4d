"""The pure parsers behind ``duetime jobs``: durations, times, payloads, ids. Each bad
value becomes one ``InvalidInput`` (or argparse) message, never a traceback."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime, timedelta, timezone

import pytest

from scheduler.cli._util import (
    MAX_ID,
    after_id,
    job_id,
    parse_duration,
    parse_payload,
    parse_when,
    positive_int,
    print_table,
)
from scheduler.errors import InvalidInput


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30s", 30),
        ("5m", 300),
        ("1h", 3600),
        ("2d", 172_800),
        ("1w", 604_800),
        ("250ms", 0.25),
        ("1h30m", 5400),
        ("1h 30m 15s", 5415),
        ("1.5h", 5400),
        ("0s", 0),
        (" 10M ", 600),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize(
    "text", ["", "   ", "5", "m", "5x", "-5m", "5m-", "1.5.5h", "h1", "5 minutes", "1e3s"]
)
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(InvalidInput, match="invalid duration"):
        parse_duration(text)


def test_parse_duration_too_large_is_an_input_error() -> None:
    with pytest.raises(InvalidInput, match="too large"):
        parse_duration("99999999999d")


def test_parse_when_iso_forms() -> None:
    assert parse_when("2026-12-01T09:30:00+01:00") == datetime(
        2026, 12, 1, 9, 30, tzinfo=timezone(timedelta(hours=1))
    )
    assert parse_when("2026-12-01T09:30:00Z") == datetime(2026, 12, 1, 9, 30, tzinfo=UTC)
    assert parse_when("2026-12-01 09:30") == datetime(2026, 12, 1, 9, 30, tzinfo=UTC)
    assert parse_when("2026-12-01") == datetime(2026, 12, 1, tzinfo=UTC)
    assert parse_when("2026-12-01T09:30:00.123456") == datetime(
        2026, 12, 1, 9, 30, 0, 123456, tzinfo=UTC
    )


def test_parse_when_now_is_aware_utc() -> None:
    before = datetime.now(UTC)
    value = parse_when(" NOW ")
    assert value.tzinfo is not None and before <= value <= datetime.now(UTC)


@pytest.mark.parametrize("text", ["", "tomorrow", "2026-13-01", "2026-02-30T10:00", "12:61"])
def test_parse_when_refuses(text: str) -> None:
    with pytest.raises(InvalidInput, match=r"invalid time .*ISO 8601"):
        parse_when(text)


def test_parse_payload() -> None:
    assert parse_payload(None) == {}
    assert parse_payload('{"to": "a@example.com", "n": [1, 2.5, null, true]}') == {
        "to": "a@example.com",
        "n": [1, 2.5, None, True],
    }
    assert parse_payload("{}") == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{x", "--payload is not valid JSON: Expecting property name"),
        ("", "--payload is not valid JSON"),
        ("[1]", "--payload must be a JSON object, not list"),
        ('"s"', "--payload must be a JSON object, not str"),
        ("3", "--payload must be a JSON object, not int"),
        ("null", "--payload must be a JSON object, not NoneType"),
        ('{"a": NaN}', "--payload contains nan"),
        ('{"a": [1e999]}', "--payload contains inf"),
        ('{"a": {"b": "x\\u0000y"}}', "\\u0000"),
        ('{"\\u0000": 1}', "\\u0000"),
    ],
)
def test_parse_payload_refuses(text: str, message: str) -> None:
    with pytest.raises(InvalidInput) as info:
        parse_payload(text)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_ids_and_counts() -> None:
    assert job_id("42") == 42
    assert job_id(str(MAX_ID)) == MAX_ID
    assert after_id("0") == 0
    assert after_id("17") == 17
    assert positive_int("3") == 3
    for bad in ("0", "-1", "x", "1.5", str(MAX_ID + 1)):
        with pytest.raises(argparse.ArgumentTypeError):
            job_id(bad)
    for bad in ("-1", "x", str(MAX_ID + 1)):
        with pytest.raises(argparse.ArgumentTypeError):
            after_id(bad)
    for bad in ("0", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_int(bad)


def test_print_table(capsys: pytest.CaptureFixture[str]) -> None:
    print_table(
        [
            {"id": 1, "task": "t", "due_at": datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)},
            {"id": 22, "task": "long_task_name", "due_at": None, "payload": {"k": "v" * 50}},
        ],
        ["id", "task", "due_at", "payload"],
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ID", "TASK", "DUE_AT", "PAYLOAD"]
    assert "2026-01-02 03:04:05.678Z" in lines[1]
    assert lines[1].rstrip().endswith("-")  # None shows as '-'
    assert lines[2].split()[:3] == ["22", "long_task_name", "-"]
    assert lines[2].endswith("...") and len(lines[2].split()[-1]) == 40


def test_a_missing_grant_is_reported_as_permission_denied(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import asyncpg

    import scheduler.cli as cli

    def refused(args: argparse.Namespace) -> None:
        raise asyncpg.InsufficientPrivilegeError("permission denied for table jobs")

    monkeypatch.setattr(cli, "settings_from_args", refused)
    assert cli.main(["jobs", "show", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("duetime: error: permission denied: permission denied for table jobs")
    assert "\n" not in err and "unavailable" not in err


def test_jobs_cancel_and_retry_take_an_id_or_tags() -> None:
    """``jobs cancel|retry``: one job id or ``--tag`` (repeatable), never both, and
    ``--dry-run`` only with tags; a tag no job could hold is refused by the parser."""
    from scheduler.cli._util import job_tag
    from scheduler.cli.jobs import _target

    def args(job: int | None, tags: list[str] | None, dry_run: bool = False) -> argparse.Namespace:
        return argparse.Namespace(job_id=job, tags=tags, dry_run=dry_run)

    assert _target(args(7, None)) is None
    where = _target(args(None, ["a", "b"], dry_run=True))
    assert where is not None and where.tags == ("a", "b")
    for bad in (args(7, ["a"]), args(None, None)):
        with pytest.raises(InvalidInput, match="give a job id or --tag TAG"):
            _target(bad)
    with pytest.raises(InvalidInput, match="--dry-run goes with --tag"):
        _target(args(7, None, dry_run=True))
    assert job_tag("tenant:42") == "tenant:42"
    with pytest.raises(argparse.ArgumentTypeError, match="contains whitespace"):
        job_tag("has space")
