"""``duetime.testing.drain`` (workers/drain.py): a test enqueues as the application does
and runs the due jobs inline through the worker's code path, against a migrated
PostgreSQL database of its own per test (a drain runs every due job of its database).
No broker, no scheduler."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import psycopg
import pytest

import duetime
from duetime.testing import drain, drain_async
from scheduler import db
from scheduler.store.jobs import JobStore
from workers import JobContext, Registry, SyncJobContext

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def pool(migrated_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await db.create_pool(migrated_dsn, min_size=1, max_size=3)
    try:
        yield pool
    finally:
        await pool.close()


def test_a_view_enqueues_in_its_transaction_and_the_job_writes_the_receipt(
    migrated_dsn: str,
) -> None:
    """A synchronous test, as a Django or Flask view test is: the view writes its order
    and enqueues the receipt in one psycopg transaction; ``drain`` runs the plain ``def``
    handler, whose ``ctx.db`` write commits with its ledger row and status."""
    registry = Registry()

    @registry.task("shop.send_receipt")
    def send_receipt(ctx: SyncJobContext, payload: dict[str, Any]) -> str:
        ctx.db.execute("INSERT INTO receipts (order_id) VALUES ($1)", payload["order_id"])
        return "sent"

    with psycopg.connect(migrated_dsn) as conn:
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY)")
        conn.execute("CREATE TABLE receipts (order_id int NOT NULL)")
        conn.commit()

        def checkout(order_id: int) -> None:  # the view
            with conn.transaction():
                conn.execute("INSERT INTO orders (id) VALUES (%s)", (order_id,))
                duetime.enqueue(conn, "shop.send_receipt", {"order_id": order_id})

        checkout(7)
        report = drain(migrated_dsn, registry=registry)
        assert (report.runs, report["succeeded"]) == (1, 1)
        assert conn.execute("SELECT order_id FROM receipts").fetchall() == [(7,)]
        row = conn.execute(
            "SELECT j.status, j.attempt, j.result, l.worker FROM duetime.jobs j "
            "JOIN duetime.job_ledger l ON l.job_id = j.id"
        ).fetchone()
        assert row == ("succeeded", 1, "sent", "duetime-drain")
        assert drain(migrated_dsn, registry=registry).runs == 0  # nothing left


async def test_a_failing_handler_is_retried_with_its_work_rolled_back_then_dies(
    pool: asyncpg.Pool,
) -> None:
    """Each failed attempt's ``ctx.db`` work is rolled back; the retries run in the same
    drain (back-off collapsed); the budget ends in ``dead``; with the back-off honoured
    the retry waits."""
    await pool.execute("CREATE TABLE effects (job_id bigint, attempt int)")
    registry = Registry()

    @registry.task("t.flaky")
    async def flaky(ctx: JobContext, payload: dict[str, Any]) -> None:
        await ctx.db.execute("INSERT INTO effects VALUES ($1, $2)", ctx.job_id, ctx.attempt)
        if ctx.attempt < payload["succeed_at"]:
            raise RuntimeError(f"attempt {ctx.attempt} fails")

    store = JobStore(pool)
    recovers = await store.enqueue("t.flaky", {"succeed_at": 3})
    dies = await store.enqueue("t.flaky", {"succeed_at": 99}, max_attempts=2)
    report = await drain_async(pool, registry=registry)
    assert dict(report.outcomes) == {"retried": 3, "succeeded": 1, "dead": 1}
    assert sorted(report.ran) == sorted([recovers.id] * 3 + [dies.id] * 2)
    assert [tuple(r) for r in await pool.fetch("SELECT * FROM effects")] == [(recovers.id, 3)]
    assert (await store.get(recovers.id)).status == "succeeded"
    dead = await store.get(dies.id)
    assert (dead.status, dead.attempt) == ("dead", 2)
    assert "attempt 2 fails" in (dead.last_error or "")

    @registry.task("t.budgeted", max_attempts=2)  # the task's budget beats the row's 5
    async def budgeted(ctx: JobContext, payload: dict[str, Any]) -> None:
        raise RuntimeError("never")

    spent = await store.enqueue("t.budgeted", {})
    assert (await drain_async(pool, registry=registry)).outcomes == {"retried": 1, "dead": 1}
    written = await store.get(spent.id)
    assert (written.status, written.attempt, written.max_attempts) == ("dead", 2, 2)

    waits = await store.enqueue("t.flaky", {"succeed_at": 2})
    honoured = await drain_async(pool, registry=registry, collapse_retries=False)
    assert (honoured.runs, honoured["retried"]) == (1, 1)
    again = await store.get(waits.id)
    assert (again.status, again.attempt) == ("pending", 2)
    assert again.next_run_at > (await pool.fetchval("SELECT now()"))


async def test_a_rolled_back_enqueue_leaves_nothing_to_drain(pool: asyncpg.Pool) -> None:
    registry = Registry()
    ran: list[int] = []

    @registry.task("t.noted")
    async def noted(ctx: JobContext, payload: dict[str, Any]) -> None:
        ran.append(ctx.job_id)

    async with pool.acquire() as conn:
        tx = conn.transaction()
        await tx.start()
        await duetime.enqueue_async(conn, "t.noted", {})
        await tx.rollback()
    report = await drain_async(pool, registry=registry)
    assert (report.runs, ran) == (0, [])
    assert await pool.fetchval("SELECT count(*) FROM duetime.jobs") == 0


async def test_undeclared_queues_are_held_as_the_dispatcher_holds_them(
    pool: asyncpg.Pool,
) -> None:
    registry = Registry()

    @registry.task("t.held")
    async def held(ctx: JobContext, payload: dict[str, Any]) -> None:
        raise AssertionError("a job of an undeclared queue must not run")

    await JobStore(pool).enqueue("t.held", {}, queue="nobody-declared-this")
    report = await drain_async(pool, registry=registry)
    assert (report.runs, report.held) == (0, {"nobody-declared-this": 1})
