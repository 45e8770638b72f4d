"""``duetime migrate``: applies the shipped migrations once, is idempotent, is safe from
several processes at once (advisory lock), and refuses a migration changed after it was
applied (issue 2 item 6)."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from scheduler.migrate import MigrationError, migrate
from scheduler.sql import migrations
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
