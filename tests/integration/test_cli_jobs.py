"""``duetime jobs add|list|show|cancel|retry`` as users run it: a real process, real
PostgreSQL. Bad input exits 2 with ONE line ``duetime: error: ...`` on
stderr and no traceback; an unreachable service exits 1, also with one line.

Runs against a database of its own: the jobs it adds are due and must not reach other
tests' dispatchers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import pytest

from scheduler import db
from tests.conftest import own_database
from tests.fixtures_tasks.jobs import FENCE_EPOCH
from tests.support.cli import run_duetime as duetime

UNKNOWN_ID = 987_654_321


@pytest.fixture(scope="module")
async def cli_dsn(server_dsn: str) -> AsyncIterator[str]:
    async with own_database(server_dsn, "cli") as url:
        yield url


@pytest.fixture(scope="module")
async def pool(cli_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    p = await db.create_pool(cli_dsn, min_size=1, max_size=2)
    yield p
    await p.close()


@pytest.fixture
def env(test_env: dict[str, str], cli_dsn: str) -> dict[str, str]:
    return {**test_env, "DUETIME_DATABASE_URL": cli_dsn}


async def add(env: dict[str, str], *args: str) -> dict:
    run = await duetime(env, "jobs", "add", *args, "--json")
    assert run.code == 0, run
    job = run.json()
    assert isinstance(job, dict)
    return job


# -- happy paths ----------------------------------------------------------------------------


async def test_add_with_every_option(env: dict[str, str]) -> None:
    before = datetime.now(UTC)
    job = await add(
        env,
        "send_email",
        "--in",
        "5m",
        "--payload",
        '{"to": "a@example.com", "n": [1, 2]}',
        "--queue",
        "emails",
        "--max-attempts",
        "3",
        "--key",
        "welcome:42",
    )
    after = datetime.now(UTC)
    assert job["task"] == "send_email"
    assert job["payload"] == {"to": "a@example.com", "n": [1, 2]}
    assert (job["queue"], job["max_attempts"], job["idempotency_key"]) == (
        "emails",
        3,
        "welcome:42",
    )
    assert (job["status"], job["attempt"], job["run_at"]) == ("pending", 1, None)
    due = datetime.fromisoformat(job["due_at"])
    assert before + timedelta(minutes=5) <= due <= after + timedelta(minutes=5)


async def test_add_at_and_plain_output(env: dict[str, str]) -> None:
    run = await duetime(env, "jobs", "add", "report", "--at", "2031-01-02T03:04:05+02:00")
    assert run.code == 0, run
    assert run.err == ""
    words = run.out.split()
    assert words[:2] == ["enqueued", "job"] and words[2].isdigit()
    assert run.out.strip().endswith("(report) due 2031-01-02T01:04:05+00:00 on default")
    naive = await add(env, "report", "--at", "2031-01-02 03:04:05")  # no offset: UTC
    assert naive["due_at"] == "2031-01-02T03:04:05+00:00"
    now_job = await add(env, "report", "--at", "now")
    assert datetime.fromisoformat(now_job["due_at"]) <= datetime.now(UTC)


async def test_show(env: dict[str, str]) -> None:
    job = await add(env, "shown", "--payload", '{"k": "v"}', "--in", "1h")
    as_json = await duetime(env, "jobs", "show", str(job["id"]), "--json")
    assert as_json.code == 0 and as_json.json() == job
    plain = await duetime(env, "jobs", "show", str(job["id"]))
    assert plain.code == 0
    fields = {line.split(None, 1)[0]: line.split(None, 1)[1] for line in plain.out.splitlines()}
    assert fields["id"] == str(job["id"])
    assert fields["task"] == "shown"
    assert fields["payload"] == '{"k": "v"}'
    assert fields["status"] == "pending"
    assert fields["run_at"] == "-"
    assert fields["priority"] == "0" and fields["unique_key"] == "-"
    assert fields["limit_key"] == "-"


async def test_add_limit_key(env: dict[str, str], pool: asyncpg.Pool) -> None:
    job = await add(env, "call_api", "--limit-key", "api.example.com", "--in", "1h")
    assert job["limit_key"] == "api.example.com"
    stored = await pool.fetchval("SELECT limit_key FROM duetime.jobs WHERE id = $1", job["id"])
    assert stored == "api.example.com"
    plain = await duetime(env, "jobs", "show", str(job["id"]))
    fields = {line.split(None, 1)[0]: line.split(None, 1)[1] for line in plain.out.splitlines()}
    assert fields["limit_key"] == "api.example.com"


async def test_add_unique_key_policies_and_priority(
    env: dict[str, str], pool: asyncpg.Pool, unique: str
) -> None:
    """Each line names the job holding the key afterwards, and what the policy did."""
    key = ["--unique-key", f"doc:{unique}"]
    first = await add(env, "reindex", *key, "--in", "1h", "--priority", "-7")
    assert (first["unique_key"], first["priority"], first["unique_outcome"]) == (
        f"doc:{unique}",
        -7,
        "inserted",
    )

    skipped = await duetime(env, "jobs", "add", "reindex", *key, "--payload", '{"rev": 2}')
    assert skipped.code == 0, skipped
    assert skipped.out.startswith(f"skipped: held by job {first['id']} (reindex) due "), skipped

    replaced = await add(
        env,
        "reindex",
        *key,
        "--on-conflict",
        "replace",
        "--payload",
        '{"rev": 3}',
        "--in",
        "2h",
        "--priority",
        "9",
    )
    assert (replaced["id"], replaced["unique_outcome"]) == (first["id"], "replaced")
    assert (replaced["payload"], replaced["priority"]) == ({"rev": 3}, 9)
    plain = await duetime(env, "jobs", "add", "reindex", *key, "--on-conflict", "replace")
    assert plain.out.startswith("enqueued job ") and f"job {first['id']}" not in plain.out
    # the holder was due later than "now": cancelled, the new job holds the key
    holder = int(plain.out.split()[2])
    await pool.execute(
        f"UPDATE duetime.jobs SET status = 'dispatched', dispatch_epoch = {FENCE_EPOCH}"
        " WHERE id = $1",
        holder,
    )
    kept = await duetime(env, "jobs", "add", "reindex", *key, "--on-conflict", "replace")
    assert kept.out.startswith(f"kept: held by job {holder}, dispatched, "), kept

    refused = await duetime(env, "jobs", "add", "reindex", *key, "--on-conflict", "error")
    assert (refused.code, refused.out) == (2, ""), refused
    assert refused.error_line() == (
        f"unique key 'doc:{unique}' of queue 'default' is held by job {holder}"
    )

    window = ["--unique-key", f"digest:{unique}"]
    digest = await add(env, "digest", *window, "--unique-for", "1h", "--in", "1h")
    await duetime(env, "jobs", "cancel", str(digest["id"]))
    held = await duetime(env, "jobs", "add", "digest", *window)
    assert held.out.startswith(f"skipped: held by job {digest['id']} (digest)"), held
    shown = await duetime(env, "jobs", "show", str(digest["id"]))
    fields = {line.split(None, 1)[0]: line.split(None, 1)[1] for line in shown.out.splitlines()}
    assert (fields["unique_key"], fields["priority"]) == (f"digest:{unique}", "0")


async def test_list_table_json_filters_and_paging(env: dict[str, str], unique: str) -> None:
    queue = f"list-{unique}"
    a = await add(env, "alpha", "--queue", queue, "--at", "2030-01-01T00:00:00Z")
    b = await add(env, "beta", "--queue", queue, "--at", "2030-01-02T00:00:00Z")
    c = await add(env, "alpha", "--queue", queue, "--at", "2030-01-03T00:00:00Z")
    cancelled = await duetime(env, "jobs", "cancel", str(b["id"]))
    assert cancelled.code == 0

    table = await duetime(env, "jobs", "list", "--queue", queue)
    assert table.code == 0, table
    lines = table.out.splitlines()
    assert lines[0].split() == [
        "ID",
        "TASK",
        "QUEUE",
        "STATUS",
        "ATTEMPT",
        "PROGRESS",
        "DUE_AT",
        "RUN_AT",
        "TAGS",
        "LAST_ERROR",
    ]
    rows = [line.split() for line in lines[1:]]
    assert [r[0] for r in rows] == [str(a["id"]), str(b["id"]), str(c["id"])]
    assert rows[0][1:5] == ["alpha", queue, "pending", "1/5"]
    assert rows[1][3] == "cancelled"
    assert rows[0][5:8] == ["-", "2030-01-01", "00:00:00.000Z"]  # no progress reported

    async def ids(*args: str) -> list[int]:
        run = await duetime(env, "jobs", "list", "--queue", queue, "--json", *args)
        assert run.code == 0, run
        return [j["id"] for j in run.json()]  # type: ignore[union-attr]

    assert await ids() == [a["id"], b["id"], c["id"]]
    assert await ids("--status", "pending") == [a["id"], c["id"]]
    assert await ids("--task", "alpha") == [a["id"], c["id"]]
    assert await ids("--after", str(a["id"])) == [b["id"], c["id"]]
    assert await ids("--due-from", "2030-01-02", "--due-to", "2030-01-03") == [b["id"]]
    assert await ids("--after", "0", "--limit", "1") == [a["id"]]

    paged = await duetime(env, "jobs", "list", "--queue", queue, "--limit", "2")
    assert paged.code == 0
    assert paged.out.splitlines()[-1] == f"... more: duetime jobs list --after {b['id']}"

    empty = await duetime(env, "jobs", "list", "--queue", f"none-{unique}", "--json")
    assert empty.code == 0 and empty.json() == []


async def test_cancel_then_cancel_again(env: dict[str, str]) -> None:
    job = await add(env, "to-cancel", "--in", "1h")
    first = await duetime(env, "jobs", "cancel", str(job["id"]))
    assert (first.code, first.out.strip(), first.err) == (
        0,
        f"job {job['id']} is now cancelled",
        "",
    )
    shown = await duetime(env, "jobs", "show", str(job["id"]), "--json")
    assert shown.json()["status"] == "cancelled"  # type: ignore[index]
    assert shown.json()["cancelled_by"].startswith("cli")  # type: ignore[index]
    again = await duetime(env, "jobs", "cancel", str(job["id"]))
    assert again.code == 2
    assert again.out == ""
    assert again.error_line() == (
        f"job {job['id']} is cancelled; only pending or running (dispatched) jobs can be cancelled"
    )


async def test_retry_dead_then_retry_pending(env: dict[str, str], pool: asyncpg.Pool) -> None:
    job = await add(env, "to-retry", "--max-attempts", "2")
    await pool.execute(
        "UPDATE duetime.jobs SET status = 'dead', attempt = 2, last_error = 'boom', "
        "finished_at = now() WHERE id = $1",
        job["id"],
    )
    retried = await duetime(env, "jobs", "retry", str(job["id"]), "--json")
    assert retried.code == 0, retried
    body = retried.json()
    assert isinstance(body, dict)
    assert (body["status"], body["attempt"], body["finished_at"]) == ("pending", 1, None)
    assert body["run_at"] is not None

    again = await duetime(env, "jobs", "retry", str(job["id"]))
    assert again.code == 2
    assert again.error_line() == f"job {job['id']} is pending; only dead jobs can be retried"

    plain_job = await add(env, "to-retry")
    await pool.execute("UPDATE duetime.jobs SET status = 'dead' WHERE id = $1", plain_job["id"])
    plain = await duetime(env, "jobs", "retry", str(plain_job["id"]))
    assert (plain.code, plain.out.strip()) == (0, f"job {plain_job['id']} is now pending")


# -- bad input: exit 2, one line, no traceback -----------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["add", "t", "--at", "tomorrow"], "invalid time 'tomorrow': use ISO 8601"),
        (["add", "t", "--at", "2026-02-30T10:00"], "invalid time '2026-02-30T10:00'"),
        (["add", "t", "--at", "0001-01-01"], "is out of range (years 1970 to 9998)"),
        (["add", "t", "--payload", "{x"], "--payload is not valid JSON: Expecting property name"),
        (["add", "t", "--payload", "[1]"], "--payload must be a JSON object, not list"),
        (["add", "t", "--payload", '"text"'], "--payload must be a JSON object, not str"),
        (["add", "t", "--payload", '{"a": NaN}'], "--payload contains nan"),
        (["add", "t", "--in", "5x"], "invalid duration '5x': use e.g. 30s, 5m, 1h30m, 2d"),
        (["add", "t", "--in", "99999999999d"], "invalid duration '99999999999d': too large"),
        (["add", "t", "--in", "3000000d"], "too large"),
        (["add", "t", "--queue", "bad queue"], "invalid queue name 'bad queue'"),
        (["add", " "], "task name must be a non-empty string"),
        (["add", "t", "--max-attempts", "1001"], "max_attempts must be between 1 and 1000"),
        (["add", "t", "--key", ""], "idempotency_key must be 1-500 characters"),
        (["add", "t", "--unique-key", ""], "unique_key must be 1-200 characters"),
        (["add", "t", "--unique-key", "a\tb"], "unique_key must not contain control characters"),
        (["add", "t", "--limit-key", ""], "limit_key must be 1-200 characters"),
        (["add", "t", "--limit-key", "a\tb"], "limit_key must not contain control characters"),
        (
            ["add", "t", "--on-conflict", "error"],
            "--on-conflict and --unique-for need --unique-key",
        ),
        (["add", "t", "--unique-for", "1h"], "--on-conflict and --unique-for need --unique-key"),
        (["add", "t", "--unique-key", "k", "--unique-for", "soon"], "invalid duration 'soon'"),
        (["add", "t", "--unique-key", "k", "--unique-for", "400d"], "unique_for must be a"),
        (["show", str(UNKNOWN_ID)], f"job {UNKNOWN_ID} not found"),
        (["cancel", str(UNKNOWN_ID)], f"job {UNKNOWN_ID} not found"),
        (["retry", str(UNKNOWN_ID)], f"job {UNKNOWN_ID} not found"),
        (["list", "--due-from", "soon"], "invalid time 'soon'"),
        (
            ["list", "--due-from", "2030-02-01", "--due-to", "2030-01-01"],
            "--due-from must be earlier than --due-to",
        ),
    ],
)
async def test_bad_input(
    env: dict[str, str], pool: asyncpg.Pool, args: list[str], message: str
) -> None:
    before = await pool.fetchval("SELECT count(*) FROM duetime.jobs")
    run = await duetime(env, "jobs", *args)
    assert run.code == 2, run
    assert run.out == ""
    assert message in run.error_line()
    assert await pool.fetchval("SELECT count(*) FROM duetime.jobs") == before


async def test_cancel_takes_dispatched_and_refuses_finished_jobs(
    env: dict[str, str], pool: asyncpg.Pool
) -> None:
    """A dispatched job is cancelled (its worker is told: tests/integration/
    test_job_control.py); a finished one is refused in one line."""
    for status in ("dispatched", "succeeded", "dead"):
        job = await add(env, "busy")
        await pool.execute(
            f"UPDATE duetime.jobs SET status = $2, dispatch_epoch = {FENCE_EPOCH} WHERE id = $1",
            job["id"],
            status,
        )
        run = await duetime(env, "jobs", "cancel", str(job["id"]))
        if status == "dispatched":
            assert (run.code, run.out.strip()) == (0, f"job {job['id']} is now cancelled")
            continue
        assert run.code == 2
        assert run.error_line() == (
            f"job {job['id']} is {status}; only pending or running (dispatched) jobs can be "
            "cancelled"
        )


async def test_show_prints_the_result_as_json(env: dict[str, str], pool: asyncpg.Pool) -> None:
    job = await add(env, "answered")
    await pool.execute(
        "UPDATE duetime.jobs SET status = 'succeeded', finished_at = now(), "
        """result = '{"rows": [1, 2]}' WHERE id = $1""",
        job["id"],
    )
    shown = await duetime(env, "jobs", "show", str(job["id"]))
    assert shown.code == 0
    assert 'result           {"rows": [1, 2]}' in shown.out.splitlines()


@pytest.mark.parametrize(
    ("extra_env", "flags", "message"),
    [
        (
            {"DUETIME_LEASE_TTL": "-1"},
            [],
            "invalid configuration: DUETIME_LEASE_TTL=-1: lease_ttl must be >= 1.0 (got '-1')",
        ),
        (
            {},
            ["--lease-ttl", "-1"],
            "invalid configuration: --lease-ttl=-1: lease_ttl must be >= 1.0 (got '-1')",
        ),
        (
            {"DUETIME_DATABASE_URL": "mysql://app:pw-s3cret@db/x"},
            [],
            "invalid configuration: DUETIME_DATABASE_URL=mysql://app:***@db/x: database_url "
            "scheme must be one of postgresql, postgres (got 'mysql')",
        ),
        (
            {"DUETIME_LEASE_TL": "3"},
            [],
            "invalid configuration: unknown environment variable DUETIME_LEASE_TL; "
            "did you mean DUETIME_LEASE_TTL?",
        ),
    ],
)
async def test_bad_config_value(
    env: dict[str, str], extra_env: dict[str, str], flags: list[str], message: str
) -> None:
    run = await duetime({**env, **extra_env}, "jobs", "list", *flags)
    assert run.code == 2
    assert run.out == ""
    assert run.error_line() == message
    assert "pw-s3cret" not in run.err


async def test_unknown_key_in_config_file(env: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "duetime.toml"
    path.write_text("lease_tl = 5\n")
    run = await duetime(env, "jobs", "list", "--config", str(path))
    assert run.code == 2
    assert run.error_line() == (
        f"invalid configuration: unknown key 'lease_tl' in {path}; did you mean 'lease_ttl'?"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["show", "abc"], "job id must be an integer, not 'abc'"),
        (["show", "99999999999999999999"], "job id must be between 1 and"),
        (["list", "--after", "-3"], "job id must be between 1 and"),
        (["add", "t", "--max-attempts", "0"], "'0' must be >= 1"),
        (["add", "t", "--priority", "101"], "priority must be between -100 and 100, not 101"),
        (["add", "t", "--priority", "high"], "priority must be an integer, not 'high'"),
        (["add", "t", "--on-conflict", "merge"], "invalid choice: 'merge'"),
        (["add", "t", "--in", "5m", "--at", "now"], "not allowed with argument"),
        (["list", "--status", "running"], "invalid choice: 'running'"),
    ],
)
async def test_argument_errors_exit_2_without_traceback(
    env: dict[str, str], args: list[str], message: str
) -> None:
    """argparse's own errors (usage + one 'error:' line) also exit 2, never a traceback."""
    run = await duetime(env, "jobs", *args)
    assert run.code == 2
    assert "Traceback" not in run.err
    last = run.err.strip().splitlines()[-1]
    assert "error: " in last and message in last, run.err


async def test_unreachable_database_exits_1_with_one_line(env: dict[str, str]) -> None:
    down = {**env, "DUETIME_DATABASE_URL": "postgresql://postgres:pw-s3cret@127.0.0.1:1/x"}
    run = await duetime(down, "jobs", "list")
    assert run.code == 1
    assert run.error_line().startswith(
        "cannot connect to PostgreSQL at postgresql://postgres:***@127.0.0.1:1/x"
    )
    assert "pw-s3cret" not in run.err


# -- hostile rows (security issue, items 2 and 3) -----------------------------------------

ESCAPES = "\x1b]0;title\x07\x1b[2J"
#: 24 KB of JSON nested 3,000 deep: valid jsonb, deeper than Python's parser goes.
DEEP = '{"key":' * 3000 + "1" + "}" * 3000


async def test_terminal_escapes_in_rows_are_printed_escaped(
    env: dict[str, str], pool: asyncpg.Pool
) -> None:
    """A task name, an error and a schedule name carrying OSC (window title) and CSI
    (clear screen) sequences print as visible escapes in every listing."""
    job_id = await pool.fetchval(
        "INSERT INTO duetime.jobs (task, payload, due_at, status, last_error) "
        "VALUES ($1, $2, now() + interval '1 day', 'dead', $3) RETURNING id",
        f"evil{ESCAPES}",
        {"note": f"p{ESCAPES}"},
        f"boom{ESCAPES}\u202etxt.exe",
    )
    await pool.execute(
        "INSERT INTO duetime.schedules (name, task, cron, paused) "
        "VALUES ($1, $2, '0 0 1 1 *', true)",
        f"sched{ESCAPES}",
        f"stask{ESCAPES}",
    )
    shown = "\\x1b]0;title\\x07\\x1b[2J"
    runs = {
        "jobs list": await duetime(env, "jobs", "list", "--status", "dead"),
        "jobs show": await duetime(env, "jobs", "show", str(job_id)),
        "schedules list": await duetime(env, "schedules", "list"),
        "schedules show": await duetime(env, "schedules", "show", f"sched{ESCAPES}"),
    }
    for name, run in runs.items():
        assert run.code == 0, (name, run)
        assert "\x1b" not in run.out and "\x07" not in run.out, (name, run.out)
        assert "\u202e" not in run.out, (name, run.out)
    assert f"evil{shown}" in runs["jobs list"].out
    assert f"evil{shown}" in runs["jobs show"].out
    assert f"boom{shown}\\u202etxt.exe" in runs["jobs show"].out
    assert f"sched{shown}" in runs["schedules list"].out
    assert f"stask{shown}" in runs["schedules show"].out
    # --json stays JSON (its own escapes), the same text once decoded
    run = await duetime(env, "jobs", "show", str(job_id), "--json")
    assert run.code == 0 and "\x1b" not in run.out
    assert run.json()["task"] == f"evil{ESCAPES}"  # type: ignore[index]


async def test_a_payload_nested_3000_deep_is_shown_bounded(
    env: dict[str, str], pool: asyncpg.Pool
) -> None:
    """Every view of a row survives any row the database accepts: the payload is shown
    as a bounded note, never a traceback."""
    job_id = await pool.fetchval(
        "INSERT INTO duetime.jobs (task, payload, due_at, status) "
        "VALUES ('deep', $1::text::jsonb, now() + interval '1 day', 'dead') RETURNING id",
        DEEP,
    )
    await pool.execute(
        "INSERT INTO duetime.schedules (name, task, cron, paused, payload) "
        "VALUES ('deep-schedule', 'deep', '0 0 1 1 *', true, $1::text::jsonb)",
        DEEP,
    )
    for args in (
        ("jobs", "show", str(job_id)),
        ("jobs", "show", str(job_id), "--json"),
        ("jobs", "list", "--status", "dead"),
        ("jobs", "list", "--status", "dead", "--json"),
        ("schedules", "list"),
        ("schedules", "show", "deep-schedule"),
        ("schedules", "show", "deep-schedule", "--json"),
    ):
        run = await duetime(env, *args)
        assert run.code == 0, (args, run)
        assert "Traceback" not in run.err and "RecursionError" not in run.err, (args, run.err)
    run = await duetime(env, "jobs", "show", str(job_id))
    assert "(duetime: not shown)" in run.out
    assert "JSON the client cannot decode (RecursionError); " in run.out
    assert "characters of JSON, the first 2000: {" in run.out
    assert len(run.out) < 5000
