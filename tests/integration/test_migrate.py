"""``duetime migrate``: applies the shipped migrations once, is idempotent, is safe from
several processes at once (advisory lock), and refuses a migration changed after it was
applied."""

from __future__ import annotations

import asyncio
import hashlib

import asyncpg
import pytest

from scheduler import db
from scheduler.migrate import MigrationError, migrate
from scheduler.sql import migrations
from scheduler.store.dispatch import DispatchStore
from scheduler.store.execution import ExecutionStore
from scheduler.store.rows import JobRef
from tests.support.cli import run_duetime

LATEST = max(version for version, _, _ in migrations())
ALL_APPLIED = [f"{version:04d}_{name}" for version, name, _ in migrations()]


async def _schema_facts(dsn: str) -> dict[str, object]:
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        return {
            "schemas": await conn.fetchval(
                "SELECT count(*) FROM pg_namespace WHERE nspname = 'duetime'"
            ),
            "tables": set(
                await conn.fetchval(
                    "SELECT array_agg(c.relname::text) FROM pg_class c "
                    "JOIN pg_namespace n ON n.oid = c.relnamespace "
                    "WHERE n.nspname = 'duetime' AND c.relkind IN ('r', 'p') "
                    "AND NOT c.relispartition"
                )
            ),
            "partitions": await conn.fetchval(
                "SELECT count(*) FROM pg_inherits WHERE inhparent = 'duetime.jobs'::regclass"
            ),
            "versions": [
                tuple(r)
                for r in await conn.fetch(
                    "SELECT version, count(*) FROM duetime.schema_migrations "
                    "GROUP BY version ORDER BY version"
                )
            ],
            "fence_rows": await conn.fetchval("SELECT count(*) FROM duetime.leader_fence"),
        }
    finally:
        await conn.close()


async def test_migrate_empty_database(fresh_dsn: str) -> None:
    result = await migrate(fresh_dsn)
    assert result.applied == ALL_APPLIED
    assert result.current_version == LATEST
    facts = await _schema_facts(fresh_dsn)
    assert facts["schemas"] == 1
    assert {"jobs", "job_ledger", "leader_fence", "schema_migrations"} <= facts["tables"]  # type: ignore[operator]
    # DEFAULT + yesterday and 14 days ahead (the maintainer keeps extending).
    assert facts["partitions"] == 1 + 16
    assert facts["versions"] == [(v, 1) for v, _, _ in migrations()]
    assert facts["fence_rows"] == 1


async def test_migrate_twice_applies_nothing_the_second_time(fresh_dsn: str) -> None:
    first = await migrate(fresh_dsn)
    before = await _schema_facts(fresh_dsn)
    second = await migrate(fresh_dsn)
    assert first.applied == ALL_APPLIED
    assert second.applied == []
    assert second.current_version == LATEST
    assert await _schema_facts(fresh_dsn) == before


async def test_four_concurrent_processes_make_one_schema(
    fresh_dsn: str, test_env: dict[str, str]
) -> None:
    env = {**test_env, "DUETIME_DATABASE_URL": fresh_dsn}
    results = await asyncio.gather(*(run_duetime(env, "migrate", timeout=60) for _ in range(4)))
    for code, out, err in results:
        assert code == 0, (out, err)
        assert "Traceback" not in err
    outputs = sorted(out.strip() for _, out, _ in results)
    applied = [o for o in outputs if o.startswith("applied")]
    assert applied == [f"applied {', '.join(ALL_APPLIED)}; schema at version {LATEST}"]
    assert outputs.count(f"schema up to date at version {LATEST}") == 3
    facts = await _schema_facts(fresh_dsn)
    assert facts["schemas"] == 1
    assert facts["partitions"] == 1 + 16
    assert facts["versions"] == [(v, 1) for v, _, _ in migrations()]
    assert facts["fence_rows"] == 1


async def test_changed_migration_is_refused(fresh_dsn: str, test_env: dict[str, str]) -> None:
    await migrate(fresh_dsn)
    conn = await asyncpg.connect(fresh_dsn, timeout=10)
    try:
        await conn.execute(
            "UPDATE duetime.schema_migrations SET checksum = 'feedfacefeedface' WHERE version = 1"
        )
    finally:
        await conn.close()
    with pytest.raises(MigrationError) as info:
        await migrate(fresh_dsn)
    message = str(info.value)
    assert message.startswith("migration 0001_jobs was changed after it was applied")
    assert "feedfacefeedface" in message and "write a new migration instead" in message

    code, out, err = await run_duetime(
        {**test_env, "DUETIME_DATABASE_URL": fresh_dsn}, "migrate", timeout=60
    )
    assert code == 1
    assert out == ""
    assert err.strip().splitlines() == [f"duetime: error: {message}"]
    # The refusal released the advisory lock: nothing is left waiting or holding it.
    conn = await asyncpg.connect(fresh_dsn, timeout=10)
    try:
        held = await conn.fetchval(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND database = "
            "(SELECT oid FROM pg_database WHERE datname = current_database())"
        )
    finally:
        await conn.close()
    assert held == 0


async def test_unreachable_database_is_one_line(test_env: dict[str, str]) -> None:
    env = {**test_env, "DUETIME_DATABASE_URL": "postgresql://postgres:pw-s3cret@127.0.0.1:1/x"}
    code, _out, err = await run_duetime(env, "migrate", timeout=30)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(
        "duetime: error: cannot connect to PostgreSQL at postgresql://postgres:***@127.0.0.1:1/x"
    )
    assert "pw-s3cret" not in err


async def _migrate_before(conn: asyncpg.Connection, version: int) -> None:
    """Apply the migrations before ``version`` as ``migrate`` would have."""
    await conn.execute(
        "CREATE SCHEMA duetime; CREATE TABLE duetime.schema_migrations ("
        "version integer PRIMARY KEY, name text NOT NULL, checksum text NOT NULL, "
        "applied_at timestamptz NOT NULL DEFAULT now())"
    )
    for number, name, sql in migrations():
        if number < version:
            await conn.execute(sql)
            await conn.execute(
                "INSERT INTO duetime.schema_migrations VALUES ($1, $2, $3)",
                number,
                name,
                hashlib.sha256(sql.encode()).hexdigest()[:16],
            )


async def test_0006_parks_existing_rows_it_would_refuse(fresh_dsn: str) -> None:
    """Rows written before the date bounds existed do not fail the migration: jobs go
    dead, schedules are paused, each with last_error naming the value, and afterwards
    every row can be read by the client and claimed past."""
    conn = await asyncpg.connect(fresh_dsn, timeout=10)
    try:
        await _migrate_before(conn, 6)
        await conn.execute(
            "INSERT INTO duetime.jobs (task, due_at) VALUES ('bc', '0044-03-15 BC'), "
            "('far', '20000-01-01 00:00:00+00'), ('ok', now())"
        )
        await conn.execute(  # a retry pushed past year 9999
            "INSERT INTO duetime.jobs (task, due_at, run_at) "
            "VALUES ('late', now(), '20000-01-01 00:00:00+00')"
        )
        await conn.execute(
            "INSERT INTO duetime.schedules (name, task, cron, start_at) "
            "VALUES ('bc', 't', '* * * * *', '0044-03-15 BC')"
        )
        await conn.execute(
            "INSERT INTO duetime.schedules (name, task, interval) "
            "VALUES ('long', 't', interval '2000000000 days'), ('ok', 't', interval '1 hour')"
        )
    finally:
        await conn.close()

    assert (await migrate(fresh_dsn)).applied == [a for a in ALL_APPLIED if a >= "0006"]

    pool = await db.create_pool(fresh_dsn, max_size=2)  # the client's decoders
    try:
        jobs = {r["task"]: r for r in await pool.fetch("SELECT * FROM duetime.jobs")}
        assert jobs["ok"]["status"] == "pending" and jobs["ok"]["last_error"] is None
        assert jobs["bc"]["status"] == jobs["far"]["status"] == "dead"
        assert (
            "due_at 0044-03-15 00:00:00 BC is outside the supported range"
            in (jobs["bc"]["last_error"])
        )
        assert "due_at 20000-01-01 00:00:00 is outside" in jobs["far"]["last_error"]
        assert jobs["late"]["status"] == "dead" and jobs["late"]["run_at"] is None
        assert jobs["late"]["last_error"].startswith("run_at 20000-01-01 00:00:00 is outside")
        schedules = {r["name"]: r for r in await pool.fetch("SELECT * FROM duetime.schedules")}
        assert not schedules["ok"]["paused"]
        assert schedules["bc"]["paused"] and schedules["bc"]["start_at"] is None
        assert schedules["bc"]["last_error"].startswith("start_at 0044-03-15 00:00:00 BC outside")
        assert schedules["long"]["paused"]
        assert schedules["long"]["last_error"].startswith("interval 2000000000 days outside")
        async with pool.acquire() as conn, conn.transaction():
            claimed = await DispatchStore(pool).claim(conn, 10)
        assert [job.task for job in claimed] == ["ok"]
    finally:
        await pool.close()


async def test_0007_scopes_existing_ledger_keys_and_parks_reserved_ones(fresh_dsn: str) -> None:
    """Upgrading keeps what the ledger knew (a producer's completed key still dedupes its
    duplicate, now under the scoped key) and undoes a plant made before the upgrade: the
    ledger row `job:<victim>` of mallory's job moves to mallory's scope, so the victim
    runs; a reserved key still on a job parks it."""
    conn = await asyncpg.connect(fresh_dsn, timeout=10)
    try:
        await _migrate_before(conn, 7)

        async def job(key: str | None, created_by: str, status: str, schedule: int | None) -> int:
            return int(
                await conn.fetchval(
                    "INSERT INTO duetime.jobs (task, idempotency_key, created_by, status, "
                    "schedule_id) VALUES ('t', $1, $2, $3, $4) RETURNING id",
                    key,
                    created_by,
                    status,
                    schedule,
                )
            )

        async def ledger(key: str, job_id: int) -> None:
            await conn.execute(
                "INSERT INTO duetime.job_ledger (idempotency_key, job_id, attempt, task) "
                "VALUES ($1, $2, 1, 't')",
                key,
                job_id,
            )

        victim = await job(None, "alice", "pending", None)
        planter = await job(f"job:{victim}", "mallory", "succeeded", None)
        await ledger(f"job:{victim}", planter)
        order = await job("order:1", "alice", "succeeded", None)
        await ledger("order:1", order)
        duplicate = await job("order:1", "alice", "pending", None)
        fire = "schedule:5:2031-01-01T00:00:00Z"
        planned = await job(fire, "duetime_s1", "succeeded", 5)
        await ledger(fire, planned)
        planted_fire = await job("schedule:9:2031-01-01T00:00:00Z", "mallory", "pending", None)
    finally:
        await conn.close()

    assert (await migrate(fresh_dsn)).applied == [a for a in ALL_APPLIED if a >= "0007"]

    pool = await db.create_pool(fresh_dsn, max_size=2)
    try:
        keys = {
            r["job_id"]: r["idempotency_key"]
            for r in await pool.fetch("SELECT * FROM duetime.job_ledger")
        }
        assert keys == {
            planter: f"key:7:mallory:job:{victim}",
            order: "key:5:alice:order:1",
            planned: fire,
        }
        rows = await pool.fetch(
            "SELECT id, due_at, status, idempotency_key, last_error FROM duetime.jobs"
        )
        by_id = {r["id"]: r for r in rows}
        parked = by_id[planted_fire]
        assert (parked["status"], parked["idempotency_key"]) == ("dead", None)
        assert parked["last_error"].startswith(
            "idempotency key 'schedule:9:2031-01-01T00:00:00Z' uses a prefix reserved"
        )
        assert by_id[planter]["idempotency_key"] is None  # terminal: only the key cleared
        assert by_id[planter]["status"] == "succeeded"
        await pool.execute(
            "UPDATE duetime.jobs SET status = 'dispatched', dispatched_at = now(), "
            "dispatch_epoch = (SELECT epoch FROM duetime.leader_fence WHERE shard = 0) "
            "WHERE status = 'pending'"
        )
        locked = await ExecutionStore(pool).begin(
            [JobRef(i, by_id[i]["due_at"], 1) for i in (victim, duplicate)]
        )
        assert [(j.key, j.done) for j in locked if j is not None] == [
            (f"job:{victim}", False),  # the plant no longer settles it
            ("key:5:alice:order:1", True),  # the ledger still knows alice's key
        ]
    finally:
        await pool.close()
