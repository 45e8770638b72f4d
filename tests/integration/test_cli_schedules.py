"""``duetime schedules add|list|show|pause|resume|remove|trigger`` as users run it: a
real process, real PostgreSQL.

Bad input (cron, time zone, interval, policies, numbers) exits 2 with ONE line
``duetime: error: ...`` and never reaches the database: those cases run with a database
URL nobody listens on, where touching it would exit 1 instead.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from zoneinfo import ZoneInfo

import pytest

from tests.conftest import own_database
from tests.support.cli import run_duetime as duetime
from tests.support.etcd import free_port


@pytest.fixture(scope="module")
async def cli_dsn(server_dsn: str) -> AsyncIterator[str]:
    async with own_database(server_dsn, "cli_sched") as url:
        yield url


@pytest.fixture
def env(test_env: dict[str, str], cli_dsn: str) -> dict[str, str]:
    return {**test_env, "DUETIME_DATABASE_URL": cli_dsn}


@pytest.fixture
def offline_env(test_env: dict[str, str]) -> dict[str, str]:
    """A database URL with nothing behind it: a command that connects exits 1."""
    return {**test_env, "DUETIME_DATABASE_URL": f"postgresql://postgres@127.0.0.1:{free_port()}/x"}


async def add_json(env: dict[str, str], *args: str) -> dict:
    run = await duetime(env, "schedules", "add", *args, "--json")
    assert run.code == 0, run
    value = run.json()
    assert isinstance(value, dict)
    return value


# -- bad input: exit 2, one line, database untouched ----------------------------------------


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--cron", "61 * * * *"], "value 61 is out of range 0-59"),
        (["--cron", "* * * *"], "has 4 fields"),
        (["--cron", "@hourlyy"], "unknown cron alias"),
        (["--cron", "0 3 * * *", "--tz", "Europe/Berln"], "did you mean 'Europe/Berlin'"),
        (["--every", "5"], "add a unit"),
        (["--every", "500ms"], "shorter than 1 second"),
        (["--every", "1 month"], "invalid interval"),
        ([], "give exactly one of --cron EXPR and --every DURATION"),
        (["--cron", "* * * * *", "--every", "5s"], "give exactly one of"),
        (["--cron", "* * * * *", "--misfire", "later"], "unknown misfire policy"),
        (["--cron", "* * * * *", "--overlap", "queue"], "unknown overlap policy"),
        (["--cron", "* * * * *", "--misfire-cap", "0"], "--misfire-cap must be >= 1"),
        (["--cron", "* * * * *", "--max-attempts", "x"], "--max-attempts must be an integer"),
        (["--cron", "* * * * *", "--jitter", "soon"], "--jitter must be seconds"),
        (["--cron", "* * * * *", "--jitter", "-1"], "jitter must be between 0"),
        (["--cron", "* * * * *", "--payload", "[1]"], "--payload must be a JSON object"),
        (["--cron", "* * * * *", "--start-at", "tomorrow"], "invalid time 'tomorrow'"),
    ],
)
async def test_bad_input_exits_2_before_touching_the_database(
    offline_env: dict[str, str], args: list[str], fragment: str
) -> None:
    run = await duetime(offline_env, "schedules", "add", "nightly", "report", *args)
    assert run.code == 2, run
    assert fragment in run.error_line()
    assert run.out == ""


async def test_unreachable_database_exits_1(offline_env: dict[str, str]) -> None:
    run = await duetime(offline_env, "schedules", "add", "n", "t", "--cron", "* * * * *")
    assert run.code == 1
    assert "cannot connect to PostgreSQL" in run.error_line()


# -- happy paths ----------------------------------------------------------------------------


async def test_add_every_option_and_list(env: dict[str, str]) -> None:
    s = await add_json(
        env, "nightly-report", "report", "--cron", "30 2 * * *", "--tz", "Europe/Berlin",
        "--payload", '{"kind": "daily"}', "--queue", "reports", "--max-attempts", "3",
        "--misfire", "fire-all", "--misfire-cap", "3", "--overlap", "skip", "--jitter", "1m",
        "--start-at", "2027-01-01T00:00:00+01:00", "--end-at", "2028-01-01",
    )  # fmt: skip
    assert (s["name"], s["task"], s["cron"], s["timezone"]) == (
        "nightly-report", "report", "30 2 * * *", "Europe/Berlin",
    )  # fmt: skip
    assert (s["payload"], s["queue"], s["max_attempts"]) == ({"kind": "daily"}, "reports", 3)
    assert (s["misfire_policy"], s["misfire_cap"], s["overlap_policy"]) == ("fire_all", 3, "skip")
    assert s["jitter"] == 60.0 and s["interval"] is None
    assert s["start_at"] == "2026-12-31T23:00:00+00:00"
    assert s["end_at"] == "2028-01-01T00:00:00+00:00"
    assert s["next_fire_at"] is None and not s["paused"]  # the planner fills it

    every = await duetime(env, "schedules", "add", "heartbeat", "ping", "--every", "1m30s")
    assert every.code == 0, every
    assert every.out.startswith("created schedule ")
    assert "'heartbeat': every 1m30s; first fire" in every.out

    table = await duetime(env, "schedules", "list")
    assert table.code == 0, table
    header, *lines = table.out.splitlines()
    assert header.split()[:4] == ["ID", "NAME", "TASK", "EVERY"]
    names = {line.split()[1] for line in lines}
    assert {"nightly-report", "heartbeat"} <= names

    listed = await duetime(env, "schedules", "list", "--json", "--active")
    assert listed.code == 0
    assert {item["name"] for item in listed.json()} >= {"nightly-report", "heartbeat"}  # type: ignore[union-attr]

    dup = await duetime(env, "schedules", "add", "heartbeat", "ping", "--every", "5s")
    assert dup.code == 2
    assert dup.error_line() == "a schedule named 'heartbeat' already exists"


async def test_show_prints_next_five_in_local_and_utc_and_recent_runs(
    env: dict[str, str],
) -> None:
    s = await add_json(
        env, "show-me", "report", "--cron", "0 9 * * 1-5", "--tz", "America/New_York"
    )
    trig = await duetime(env, "schedules", "trigger", "show-me", "--json")
    assert trig.code == 0, trig
    job = trig.json()
    assert isinstance(job, dict)
    assert job["schedule_id"] == s["id"] and job["task"] == "report"
    assert job["idempotency_key"].startswith(f"schedule:{s['id']}:trigger:")

    shown = await duetime(env, "schedules", "show", "show-me")
    assert shown.code == 0, shown
    text = shown.out
    assert "next 5 fire times (America/New_York / UTC):" in text
    section = text.split("next 5 fire times", 1)[1].splitlines()[1:6]
    zone = ZoneInfo("America/New_York")
    now = datetime.now(UTC)
    for line in section:
        local_text, utc_text = line[:34].strip(), line[34:].strip()
        utc_time = datetime.strptime(utc_text, "%Y-%m-%d %H:%M:%SZ").replace(tzinfo=UTC)
        assert utc_time > now
        local = utc_time.astimezone(zone)
        assert local.strftime("%H:%M") == "09:00" and local.weekday() < 5
        assert local_text.startswith(local.strftime("%Y-%m-%d 09:00:00 E"))  # EST/EDT
    assert "recent runs (1):" in text
    assert str(job["id"]) in text.split("recent runs (1):", 1)[1]

    as_json = await duetime(env, "schedules", "show", str(s["id"]), "--json")
    data = as_json.json()
    assert isinstance(data, dict)
    assert data["schedule"]["name"] == "show-me"
    assert len(data["upcoming"]) == 5
    first = data["upcoming"][0]
    assert datetime.fromisoformat(first["local"]) == datetime.fromisoformat(
        first["utc"].replace("Z", "+00:00")
    )
    assert [r["id"] for r in data["recent_runs"]] == [job["id"]]


async def test_pause_resume_remove(env: dict[str, str]) -> None:
    await add_json(env, "lifecycle", "t", "--every", "10s")
    paused = await duetime(env, "schedules", "pause", "lifecycle")
    assert paused.code == 0 and paused.out.startswith("paused schedule ")
    shown = await duetime(env, "schedules", "show", "lifecycle", "--json")
    assert shown.json()["schedule"]["paused"] is True  # type: ignore[index]
    only_paused = await duetime(env, "schedules", "list", "--paused", "--json")
    assert "lifecycle" in {s["name"] for s in only_paused.json()}  # type: ignore[union-attr]
    resumed = await duetime(env, "schedules", "resume", "lifecycle", "--json")
    assert resumed.code == 0 and resumed.json()["paused"] is False  # type: ignore[index]
    removed = await duetime(env, "schedules", "remove", "lifecycle")
    assert removed.code == 0 and removed.out.startswith("removed schedule ")
    gone = await duetime(env, "schedules", "show", "lifecycle")
    assert gone.code == 2 and gone.error_line() == "schedule 'lifecycle' not found"
    for action in ("pause", "resume", "remove", "trigger"):
        missing = await duetime(env, "schedules", action, "no-such-schedule")
        assert missing.code == 2 and "not found" in missing.error_line()
