"""Connections killed under the worker's batched read (workers/executor.py ``_begin``)
against real PostgreSQL: a failure that is not a decode error of a row the server
returned proves nothing about the rows, so the batch is requeued, never parked.

The store's connection is really terminated by the server (``pg_terminate_backend`` of
this test database's own backend); the error the client then reports is the one asyncpg
raises when the kill races a statement ("cannot switch to state 12; another operation
(2) is in progress"), which a benchmark harness hit under a storm of kills.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import asyncpg
import pytest

from scheduler import db
from scheduler.store.execution import ExecutionStore
from scheduler.store.rows import JobRef, LockedJob
from tests.fixtures_tasks.jobs import dispatched_job
from workers import JobContext, Registry
from workers.errors import DatabaseUnavailable
from workers.executor import Executor, Outcome

pytestmark = pytest.mark.timeout(60)


class KilledUnderBegin(ExecutionStore):
    """While ``broken``: the server terminates the store's backend, the real ``begin``
    runs on what is left, and the client reports ``client_error``."""

    def __init__(self, pool: asyncpg.Pool, killer: asyncpg.Pool, client_error: Exception) -> None:
        super().__init__(pool)
        self.pool, self.killer, self.client_error = pool, killer, client_error
        self.broken = True
        self.calls = 0

    async def begin(
        self, refs: Sequence[JobRef], epochs: Sequence[int] | None = None
    ) -> list[LockedJob | None]:
        if not self.broken:
            return await super().begin(refs, epochs)
        self.calls += 1
        async with self.pool.acquire() as conn:
            pid = conn.get_server_pid()
        # waits until the backend is gone (PostgreSQL 14+)
        assert await self.killer.fetchval("SELECT pg_terminate_backend($1, 5000)", pid)
        try:
            await super().begin(refs, epochs)
        except Exception as exc:
            raise self.client_error from exc
        raise self.client_error


@pytest.fixture
async def pools(dsn: str) -> AsyncIterator[tuple[asyncpg.Pool, asyncpg.Pool, asyncpg.Pool]]:
    handlers = await db.create_pool(dsn, min_size=1, max_size=2)
    # the guard holds one; sessions kept across checkouts, as the worker's store pool
    store = await db.create_pool(dsn, min_size=1, max_size=2, reset=db.keep_session)
    killer = await db.create_pool(dsn, min_size=1, max_size=1, application_name="test-killer")
    try:
        yield handlers, store, killer
    finally:
        for pool in (handlers, store, killer):
            pool.terminate()


@pytest.mark.parametrize(
    "client_error",
    [
        asyncpg.InternalClientError(
            "cannot switch to state 12; another operation (2) is in progress"
        ),
        asyncpg.ProtocolError("unexpected message while the connection was closing"),
    ],
    ids=["InternalClientError", "ProtocolError"],
)
async def test_a_killed_begin_requeues_the_batch_and_parks_nothing(
    pools: tuple[asyncpg.Pool, asyncpg.Pool, asyncpg.Pool],
    db_pool: asyncpg.Pool,
    unique: str,
    client_error: Exception,
) -> None:
    handlers, store_pool, killer = pools
    ran: list[int] = []
    registry = Registry()

    @registry.task("t.kill")
    async def handler(ctx: JobContext, payload: dict[str, Any]) -> None:
        ran.append(ctx.job_id)

    store = KilledUnderBegin(store_pool, killer, client_error)
    executor = Executor(
        handlers, registry, worker_name="w-kill", heartbeat_interval=5.0, store=store
    )
    queue = f"kill-{unique}"
    jobs = [await dispatched_job(db_pool, "t.kill", {"i": i}, queue=queue) for i in range(8)]
    try:
        results = await asyncio.gather(
            *(executor.execute(job.message(1)) for job in jobs), return_exceptions=True
        )
        assert store.calls >= 1
        # every delivery of the batch is requeued: no outcome was recorded for any
        assert all(isinstance(r, DatabaseUnavailable) for r in results), results
        statuses = await db_pool.fetch(
            "SELECT status, attempt, last_error FROM duetime.jobs WHERE id = ANY($1::bigint[])",
            [j.id for j in jobs],
        )
        assert [(r["status"], r["attempt"], r["last_error"]) for r in statuses] == [
            ("dispatched", 1, None)
        ] * len(jobs)
        assert ran == []
        # the broken connection is gone; the requeued deliveries run normally
        store.broken = False
        again = await asyncio.gather(*(executor.execute(job.message(1)) for job in jobs))
        assert again == [Outcome.SUCCEEDED] * len(jobs)
        assert sorted(ran) == sorted(j.id for j in jobs)
    finally:
        await executor.close()


async def _guard_lock_pids(pool: asyncpg.Pool) -> list[int]:
    """Backends of this database holding a guard lock (two-int4 advisory locks)."""
    return [
        r["pid"]
        for r in await pool.fetch(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
    ]


async def test_the_guard_keeps_the_session_holding_the_locks_it_took(
    pools: tuple[asyncpg.Pool, asyncpg.Pool, asyncpg.Pool], db_pool: asyncpg.Pool, unique: str
) -> None:
    """A begin on a slot that held nothing keeps its connection once it took a lock (it
    used to give it back to the pool first: the lock stayed in a pooled session, the
    release went to another one, and every later copy read the attempt as running)."""
    _, store_pool, killer = pools
    store = ExecutionStore(store_pool)
    job = await dispatched_job(db_pool, "t.guard", queue=f"guard-{unique}")
    ref = JobRef(job.id, job.due_at, 1)
    try:
        [row] = await store.begin([ref], [job.epoch])
        assert row is not None and row.started
        owners = {s.conn.get_server_pid() for s in store.guard._slots if s.conn is not None}
        assert await _guard_lock_pids(killer) == [*owners]
        store.release(ref, job.epoch)
        for _ in range(50):
            if not await _guard_lock_pids(killer):
                break
            await asyncio.sleep(0.05)
        assert await _guard_lock_pids(killer) == []
    finally:
        await store.close()


async def test_a_guard_connection_killed_between_reads_does_not_wedge_its_slot(
    pools: tuple[asyncpg.Pool, asyncpg.Pool, asyncpg.Pool], db_pool: asyncpg.Pool, unique: str
) -> None:
    """The server ends the session of a guard slot holding a lock: asyncpg puts the
    holder back in the pool and detaches the slot's proxy, whose every call then raises
    InterfaceError (is_closed() included). The next read drops it and runs on a fresh
    connection (it used to fail on the detached proxy forever)."""
    _, store_pool, killer = pools
    store = ExecutionStore(store_pool)
    queue = f"guard-kill-{unique}"
    jobs = [await dispatched_job(db_pool, "t.guard", queue=queue) for _ in range(3)]
    try:
        for job in jobs[:2]:  # the slot holds a lock, then reads again on its connection
            [row] = await store.begin([JobRef(job.id, job.due_at, 1)], [job.epoch])
            assert row is not None and row.started
        pids = {s.conn.get_server_pid() for s in store.guard._slots if s.conn is not None}
        pids |= set(await _guard_lock_pids(killer))
        assert pids
        for pid in pids:
            assert await killer.fetchval("SELECT pg_terminate_backend($1, 5000)", pid)
        await asyncio.sleep(0.2)  # the client sees the sockets close
        for job in (jobs[2], *jobs[:2]):  # the lost sessions released the others' locks
            [row] = await store.begin([JobRef(job.id, job.due_at, 1)], [job.epoch])
            assert row is not None and row.started, job
    finally:
        await store.close()
