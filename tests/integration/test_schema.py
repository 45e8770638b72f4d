"""The jobs table as producers and the dispatcher see it (DESIGN §3):
plain-SQL inserts with defaults, CHECK constraints that name the mistake, the DEFAULT
partition and buckets created later, the claim pattern, and the NOTIFY trigger.

This module runs in a database of its own: it moves partitions and leaves due jobs
behind, which must not reach other tests' dispatchers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from scheduler import db
from scheduler.jobspec import JobSpec
from scheduler.store import JobStore
from tests.conftest import own_database
from tests.support.wait import wait_for

CHANNEL = "duetime_jobs"

# The dispatcher's claim pattern (DESIGN §5); its real query lives with the dispatcher.
CLAIM = """
SELECT id FROM duetime.jobs
 WHERE status = 'pending' AND coalesce(run_at, due_at) <= {now} AND due_at <= {now}
 ORDER BY coalesce(run_at, due_at)
 LIMIT $1
 FOR UPDATE SKIP LOCKED
"""
CLAIM_NOW = CLAIM.format(now="now()")
CLAIM_AT = CLAIM.format(now="$2::timestamptz")


@pytest.fixture(scope="module")
async def schema_dsn(server_dsn: str) -> AsyncIterator[str]:
    async with own_database(server_dsn, "schema") as url:
        yield url


@pytest.fixture
async def conn(schema_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    connection = await db.connect(schema_dsn)
    try:
        yield connection
    finally:
        await connection.close()


async def test_producer_insert_with_only_task_payload_due_at(conn: asyncpg.Connection) -> None:
    row = await conn.fetchrow(
        """INSERT INTO duetime.jobs (task, payload, due_at)
           VALUES ('send_email', '{"to": "a@example.com"}', now() + interval '10 minutes')
           RETURNING *, now() AS tx_now"""
    )
    assert row["id"] > 0
    assert row["task"] == "send_email"
    assert row["payload"] == {"to": "a@example.com"}
    assert row["due_at"] == row["tx_now"] + timedelta(minutes=10)
    assert row["status"] == "pending"
    assert row["attempt"] == 1
    assert row["queue"] == "default"
    assert row["max_attempts"] == 5
    assert row["created_at"] == row["tx_now"]
    for column in (
        "run_at",
        "idempotency_key",
        "dispatched_at",
        "heartbeat_at",
        "finished_at",
        "dispatch_epoch",
        "last_error",
        "schedule_id",
    ):
        assert row[column] is None, column


async def test_producer_insert_with_task_only(conn: asyncpg.Connection) -> None:
    row = await conn.fetchrow(
        "INSERT INTO duetime.jobs (task) VALUES ('t') RETURNING payload, due_at, now() AS n"
    )
    assert row["payload"] == {}
    assert row["due_at"] == row["n"]


@pytest.mark.parametrize(
    ("constraint", "sql"),
    [
        ("jobs_task_not_empty", "INSERT INTO duetime.jobs (task) VALUES ('')"),
        ("jobs_task_not_empty", "INSERT INTO duetime.jobs (task) VALUES ('   ')"),
        ("jobs_task_too_long", "INSERT INTO duetime.jobs (task) VALUES (repeat('x', 201))"),
        (
            "jobs_max_attempts_out_of_range",
            "INSERT INTO duetime.jobs (task, max_attempts) VALUES ('t', 0)",
        ),
        (
            "jobs_max_attempts_out_of_range",
            "INSERT INTO duetime.jobs (task, max_attempts) VALUES ('t', 1001)",
        ),
        ("jobs_payload_not_object", "INSERT INTO duetime.jobs (task, payload) VALUES ('t', '[1]')"),
        ("jobs_payload_not_object", "INSERT INTO duetime.jobs (task, payload) VALUES ('t', '3')"),
        (
            "jobs_payload_not_object",
            "INSERT INTO duetime.jobs (task, payload) VALUES ('t', 'null')",
        ),
        ("jobs_status_invalid", "INSERT INTO duetime.jobs (task, status) VALUES ('t', 'running')"),
        (
            "jobs_queue_name_invalid",
            "INSERT INTO duetime.jobs (task, queue) VALUES ('t', 'bad queue')",
        ),
        ("jobs_queue_name_invalid", "INSERT INTO duetime.jobs (task, queue) VALUES ('t', '')"),
        (
            "jobs_due_at_not_finite",
            "INSERT INTO duetime.jobs (task, due_at) VALUES ('t', 'infinity')",
        ),
        (
            "jobs_due_at_not_finite",
            "INSERT INTO duetime.jobs (task, due_at) VALUES ('t', '-infinity')",
        ),
        (
            "jobs_run_at_before_due_at",
            "INSERT INTO duetime.jobs (task, due_at, run_at) "
            "VALUES ('t', now(), now() - interval '1 second')",
        ),
        ("jobs_attempt_out_of_range", "INSERT INTO duetime.jobs (task, attempt) VALUES ('t', 0)"),
        (
            "jobs_idempotency_key_invalid",
            "INSERT INTO duetime.jobs (task, idempotency_key) VALUES ('t', '')",
        ),
    ],
)
async def test_check_constraints_refuse_bad_rows(
    conn: asyncpg.Connection, constraint: str, sql: str
) -> None:
    with pytest.raises(asyncpg.CheckViolationError) as info:
        await conn.execute(sql)
    assert info.value.constraint_name == constraint
    assert f'violates check constraint "{constraint}"' in str(info.value)


async def test_missing_task_and_null_payload_are_refused(conn: asyncpg.Connection) -> None:
    with pytest.raises(asyncpg.NotNullViolationError) as info:
        await conn.execute("INSERT INTO duetime.jobs (payload) VALUES ('{}')")
    assert info.value.column_name == "task"
    with pytest.raises(asyncpg.NotNullViolationError):
        await conn.execute("INSERT INTO duetime.jobs (task, payload) VALUES ('t', NULL)")


async def test_updates_are_checked_too(conn: asyncpg.Connection) -> None:
    job_id = await conn.fetchval("INSERT INTO duetime.jobs (task) VALUES ('t') RETURNING id")
    with pytest.raises(asyncpg.CheckViolationError) as info:
        await conn.execute("UPDATE duetime.jobs SET status = 'done' WHERE id = $1", job_id)
    assert info.value.constraint_name == "jobs_status_invalid"
    with pytest.raises(asyncpg.CheckViolationError) as info:
        await conn.execute(
            "UPDATE duetime.jobs SET run_at = due_at - interval '1 ms' WHERE id = $1", job_id
        )
    assert info.value.constraint_name == "jobs_run_at_before_due_at"


async def test_indexes_and_autovacuum_settings(conn: asyncpg.Connection) -> None:
    defs = dict(
        await conn.fetch(
            "SELECT indexname, indexdef FROM pg_indexes "
            "WHERE schemaname = 'duetime' AND tablename = 'jobs'"
        )
    )
    assert "WHERE (status = 'pending'::text)" in defs["jobs_pending_run_idx"]
    assert "COALESCE(run_at, due_at)" in defs["jobs_pending_run_idx"]
    assert "WHERE (status = 'dispatched'::text)" in defs["jobs_dispatched_idx"]
    # Every partition carries the partial claim index.
    partitions = await conn.fetchval(
        "SELECT count(*) FROM pg_inherits WHERE inhparent = 'duetime.jobs'::regclass"
    )
    with_index = await conn.fetchval(
        "SELECT count(*) FROM pg_inherits "
        "WHERE inhparent = 'duetime.jobs_pending_run_idx'::regclass"
    )
    assert with_index == partitions >= 2
    today = datetime.now(UTC).strftime("%Y%m%d")
    for table in ("jobs_default", f"jobs_p{today}"):
        options = await conn.fetchval(
            "SELECT reloptions FROM pg_class WHERE oid = $1::regclass", f"duetime.{table}"
        )
        assert "autovacuum_vacuum_scale_factor=0.01" in options, (table, options)


async def test_far_future_job_waits_in_default_then_moves_to_its_bucket(
    conn: asyncpg.Connection,
) -> None:
    now = await conn.fetchval("SELECT now()")
    due = now + timedelta(days=3 * 365)
    row = await conn.fetchrow(
        "INSERT INTO duetime.jobs (task, payload, due_at) VALUES ('far', '{}', $1) "
        "RETURNING id, tableoid::regclass::text AS part",
        due,
    )
    job_id = row["id"]
    assert row["part"] == "duetime.jobs_default"

    # Not claimable now, claimable once due (the claim evaluated at its due time).
    assert job_id not in {r["id"] for r in await conn.fetch(CLAIM_NOW, 1000)}
    async with conn.transaction():
        assert job_id in {r["id"] for r in await conn.fetch(CLAIM_AT, 10_000, due)}

    day = due.astimezone(UTC).date()
    assert await conn.fetchval("SELECT duetime.ensure_partition($1)", day) is True
    moved = await conn.fetchrow(
        "SELECT tableoid::regclass::text AS part, status, due_at FROM duetime.jobs WHERE id = $1",
        job_id,
    )
    assert moved["part"] == f"duetime.jobs_p{day:%Y%m%d}"
    assert (moved["status"], moved["due_at"]) == ("pending", due)
    assert (
        await conn.fetchval("SELECT count(*) FROM duetime.jobs_default WHERE id = $1", job_id) == 0
    )
    assert await conn.fetchval("SELECT duetime.ensure_partition($1)", day) is False

    # Still claimable when due, now from its own bucket; one second early it is not.
    async with conn.transaction():
        assert job_id in {r["id"] for r in await conn.fetch(CLAIM_AT, 10_000, due)}
    async with conn.transaction():
        early = due - timedelta(seconds=1)
        assert job_id not in {r["id"] for r in await conn.fetch(CLAIM_AT, 10_000, early)}


async def test_overdue_job_before_first_bucket_is_claimed_first(
    conn: asyncpg.Connection, schema_dsn: str
) -> None:
    row = await conn.fetchrow(
        "INSERT INTO duetime.jobs (task, due_at) VALUES ('overdue', now() - interval '10 days') "
        "RETURNING id, tableoid::regclass::text AS part"
    )
    assert row["part"] == "duetime.jobs_default"
    other = await db.connect(schema_dsn)
    try:
        async with conn.transaction():
            claimed = [r["id"] for r in await conn.fetch(CLAIM_NOW, 10)]
            assert claimed[0] == row["id"]
            # A second claimer skips the locked row instead of waiting for it.
            async with other.transaction():
                await other.execute("SET LOCAL lock_timeout = '2s'")
                theirs = [r["id"] for r in await other.fetch(CLAIM_NOW, 10)]
            assert row["id"] not in theirs
            assert not set(theirs) & set(claimed)
    finally:
        await other.close()


async def test_claim_prunes_future_partitions(conn: asyncpg.Connection) -> None:
    """The redundant ``due_at <= now()`` lets PostgreSQL skip buckets not yet due."""
    plan = "\n".join(r[0] for r in await conn.fetch("EXPLAIN " + CLAIM_NOW.replace("$1", "500")))
    assert "Subplans Removed" in plan, plan


class _Listener:
    """Collects notifications on the duetime channel; a marker payload acts as a barrier."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn
        self.payloads: list[str] = []

    def _on(self, _c: object, _pid: int, _channel: str, payload: str) -> None:
        self.payloads.append(payload)

    async def start(self) -> None:
        await self.conn.add_listener(CHANNEL, self._on)

    async def count_until(self, sender: asyncpg.Connection, marker: str) -> int:
        """Send ``marker`` after the statements under test; notifications from one session
        arrive in commit order, so when the marker is here every earlier one is too."""
        await sender.execute("SELECT pg_notify($1, $2)", CHANNEL, marker)
        await wait_for(lambda: marker in self.payloads, timeout=5, message=f"marker {marker}")
        index = self.payloads.index(marker)
        seen, self.payloads = self.payloads[:index], self.payloads[index + 1 :]
        return len(seen)


async def test_wakeups_cost_producers_nothing_and_api_notifies_due_soon(
    conn: asyncpg.Connection, schema_dsn: str
) -> None:
    """Plain-SQL inserts send no NOTIFY (no insert trigger: a NOTIFY in every producer's
    commit serialises concurrent producers; the dispatcher probes instead). The client
    API sends exactly one NOTIFY for a job or a COPY due within a second, none for
    later jobs (found ahead of time by the probe)."""
    triggers = await conn.fetch(
        "SELECT tgname, tgqual IS NOT NULL AS conditional FROM pg_trigger "
        "WHERE tgrelid = 'duetime.jobs'::regclass AND NOT tgisinternal ORDER BY tgname"
    )
    # only the fence's commit-time checks, and only for rows inserted as dispatched, and
    # the unique-key triggers (migration 0014), only for rows with a unique_key; and the
    # finished-job trigger (migration 0019), only on updates to a finished status; the
    # workflow triggers (migration 0025), only for rows with depends_on, rows inserted
    # waiting, and outcomes of rows somebody waits for; none fires on a plain insert
    assert [(t["tgname"], t["conditional"]) for t in triggers] == [
        ("jobs_add_dependencies", True),
        ("jobs_check_dependencies", True),
        ("jobs_dispatch_fenced", True),
        ("jobs_dispatch_fenced_insert", True),
        ("jobs_notify_finished", True),
        ("jobs_release_dependents", True),
        ("jobs_unique_claim", True),
        ("jobs_unique_key_fixed", True),
        ("jobs_unique_release", True),
        ("jobs_unique_revive", True),
    ]

    listen_conn = await db.connect(schema_dsn)
    pool = await db.create_pool(schema_dsn, min_size=1, max_size=1)
    try:
        listener = _Listener(listen_conn)
        await listener.start()
        store = JobStore(pool)

        await conn.execute("INSERT INTO duetime.jobs (task) VALUES ('n1'), ('n1')")
        assert await listener.count_until(conn, "m1") == 0

        await store.enqueue("n2", {})
        assert await listener.count_until(conn, "m2") == 1

        await store.enqueue("n3", {}, delay=3600)
        assert await listener.count_until(conn, "m3") == 0

        copied = await store.bulk_enqueue([JobSpec("n4", {"i": i}) for i in range(2000)])
        assert copied == 2000
        assert await listener.count_until(conn, "m4") == 1

        later = datetime.now(UTC) + timedelta(hours=1)
        await store.bulk_enqueue([JobSpec("n5", due_at=later) for _ in range(10)])
        assert await listener.count_until(conn, "m5") == 0
    finally:
        await pool.close()
        await listen_conn.close()
