"""Every wait for a pooled PostgreSQL connection has a bound: ``Settings.db_timeout``.

The pool is exhausted on purpose (its only connection held by the test), as it is when
statements pile up behind a lock or a slow disk. Each store call must then fail with
``TimeoutError`` within the configured bound instead of queueing for ever; the guard
(``GUARD`` seconds) only tells "bounded" from "still waiting".

The stores are taken from where the services build them (dispatcher, reconciler,
planner, maintainer, replica fence, ``duetime jobs``/``schedules``/``status``), so the
test also proves each of them is handed ``db_timeout``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import asyncpg
import pytest

from scheduler import db
from scheduler.cli._util import opened
from scheduler.config import Settings
from scheduler.duties.context import DutyContext
from scheduler.duties.dispatcher import Dispatcher
from scheduler.duties.maintainer import Maintainer
from scheduler.duties.planner import Planner
from scheduler.duties.reconciler import Reconciler
from scheduler.leadership.replica import Replica
from scheduler.store import DispatchStore, JobStore, ScheduleStore
from scheduler.store.fence import FenceStore
from scheduler.store.status import StatusStore

pytestmark = pytest.mark.timeout(60)

BOUND = 0.3  # db_timeout of this test
GUARD = 3.0  # far longer than BOUND: not done by then means "waits without a bound"
NOW = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.fixture
def tight(settings: Settings) -> Settings:
    return dataclasses.replace(settings, db_timeout=BOUND)


@pytest.fixture
async def one_conn_pool(dsn: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await db.create_pool(dsn, min_size=1, max_size=1)
    try:
        yield pool
    finally:
        pool.terminate()


async def assert_bounded(call: Callable[[], Awaitable[Any]], pool: asyncpg.Pool) -> float:
    """Hold ``pool``'s only connection, run ``call``: it must raise TimeoutError in time."""
    async with pool.acquire():
        started = time.monotonic()
        task = asyncio.ensure_future(call())
        done, _ = await asyncio.wait({task}, timeout=GUARD)
        elapsed = time.monotonic() - started
        if not done:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            pytest.fail(f"still waiting for a connection after {GUARD}s (no bound)")
    assert isinstance(task.exception(), TimeoutError), task.exception()
    assert BOUND * 0.9 <= elapsed < BOUND + 1.0, elapsed
    return elapsed


def dispatch_calls(store: DispatchStore) -> list[Callable[[], Awaitable[Any]]]:
    return [store.next_run_in, store.backlog]


def fence_calls(fence: FenceStore) -> list[Callable[[], Awaitable[Any]]]:
    return [lambda: fence.advance(1, "n"), lambda: fence.heartbeat(1), fence.read]


def schedule_calls(store: ScheduleStore) -> list[Callable[[], Awaitable[Any]]]:
    return [
        store.list, lambda: store.get("x"), lambda: store.pause("x"),
        lambda: store.resume("x"), lambda: store.remove("x"), lambda: store.trigger("x"),
        lambda: store.recent_runs(1), store.next_plan_at,
    ]  # fmt: skip


def job_calls(store: JobStore) -> list[Callable[[], Awaitable[Any]]]:
    return [
        lambda: store.enqueue("t"), lambda: store.get(1), store.list,
        lambda: store.cancel(1), lambda: store.retry(1), store.counts_by_status,
    ]  # fmt: skip


async def test_leader_duties_stores_wait_at_most_db_timeout(
    tight: Settings, one_conn_pool: asyncpg.Pool
) -> None:
    dispatcher = Dispatcher(DutyContext.standalone(tight, one_conn_pool))
    reconciler = Reconciler(DutyContext.standalone(tight, one_conn_pool))
    planner = Planner(DutyContext.standalone(tight, one_conn_pool))
    maintainer = Maintainer(DutyContext.standalone(tight, one_conn_pool))
    maintenance = maintainer.store
    calls = [
        *dispatch_calls(dispatcher.store),
        *dispatch_calls(reconciler.store),
        *schedule_calls(planner.store),
        lambda: maintenance.missing_days(1),
        lambda: maintenance.expired_buckets(1.0),
        maintenance.detached_leftovers,
    ]
    for call in calls:
        await assert_bounded(call, one_conn_pool)


async def test_replica_fence_waits_at_most_db_timeout(tight: Settings) -> None:
    contexts: list[DutyContext] = []

    def duties(ctx: DutyContext) -> list[Any]:
        contexts.append(ctx)
        return []

    replica = Replica(tight, duties, pool_size=1)
    await replica._open()
    try:
        (ctx,) = contexts
        for call in fence_calls(ctx.fence):
            await assert_bounded(call, ctx.pool)
    finally:
        await replica._close()


async def test_cli_stores_wait_at_most_db_timeout(tight: Settings) -> None:
    cases: list[tuple[Any, Any]] = [(JobStore, job_calls), (ScheduleStore, schedule_calls)]
    for make, calls in cases:
        async with opened(tight, make) as store:
            pool = store._db.pool
            async with pool.acquire():  # the CLI's pools have two connections: hold one
                for call in calls(store):
                    await assert_bounded(call, pool)


async def test_status_store_waits_at_most_its_bound(one_conn_pool: asyncpg.Pool) -> None:
    store = StatusStore(one_conn_pool, acquire_timeout=BOUND)
    for call in (store.ping, store.snapshot):
        await assert_bounded(call, one_conn_pool)


@pytest.mark.parametrize("cls", [DispatchStore, FenceStore, ScheduleStore, JobStore, StatusStore])
def test_acquire_timeout_must_be_positive(cls: type, one_conn_pool: asyncpg.Pool) -> None:
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="acquire_timeout must be > 0"):
            cls(one_conn_pool, acquire_timeout=bad)
