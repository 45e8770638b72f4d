"""Staging ahead (DESIGN §14; scheduler.duties.dispatcher, workers.staging, migration
0028): the leader hands a job due within ``stage_ahead`` to a worker early, the worker
starts it from its own timer at its run time, and the row stays authoritative at start.

Real PostgreSQL (a database per test: the dispatcher claims every job in it), RabbitMQ
(the session vhost; each test's queue and its staged twin deleted after), an in-process
dispatcher loop and worker. Start times are compared with the run times on the same
host's clock, which PostgreSQL here shares.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import aio_pika
import asyncpg
import pytest
from prometheus_client import REGISTRY

from scheduler import broker, db
from scheduler.config import Settings
from scheduler.duties.base import LeaderTerm
from scheduler.duties.context import DutyContext
from scheduler.duties.dispatcher import Dispatcher, DispatcherConfig
from scheduler.store.dispatch import DispatchStore
from scheduler.store.execution_guard import AttemptGuard
from scheduler.store.fence import FenceStore
from scheduler.store.jobs import JobStore
from scheduler.store.limits import LimitStore
from scheduler.store.queues import QueueStore
from tests.support.helpers import declare_queues
from tests.support.wait import wait_for
from workers import JobContext, Registry, Worker

pytestmark = pytest.mark.timeout(90)

#: Seconds a test's jobs are due ahead of their insert (within the dispatcher's horizon).
AHEAD = 3.0


@pytest.fixture
async def pool(migrated_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    pool = await db.create_pool(migrated_dsn, max_size=8)
    try:
        assert await FenceStore(pool).advance(1, "test-node")
        yield pool
    finally:
        await pool.close()


@pytest.fixture
async def queue(unique: str, amqp_url: str, pool: asyncpg.Pool) -> AsyncIterator[str]:
    name = f"stage-{unique}"
    await declare_queues(pool, name)
    yield name
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        for broker_name in broker.job_queue_names(name):
            channel = await connection.channel()
            with contextlib.suppress(Exception):
                await channel.queue_delete(broker_name)


@pytest.fixture
def staged_settings(settings: Settings, migrated_dsn: str) -> Settings:
    return dataclasses.replace(settings, database_url=migrated_dsn, stage_ahead=AHEAD + 2)


class Starts:
    """``t.stage``: records when each job's handler started (wall clock, seconds)."""

    def __init__(self) -> None:
        self.at: dict[int, list[float]] = {}
        self.registry = Registry()

        @self.registry.task("t.stage")
        async def stage(ctx: JobContext, payload: dict[str, Any]) -> None:
            self.at.setdefault(ctx.job_id, []).append(time.time())


@contextlib.asynccontextmanager
async def dispatching(settings: Settings, pool: asyncpg.Pool) -> AsyncIterator[Dispatcher]:
    dispatcher = Dispatcher(
        DutyContext.standalone(settings, pool),
        config=DispatcherConfig(stage_ahead=settings.stage_ahead, probe_interval=0.02),
    )
    dispatcher.loop.start(LeaderTerm(epoch=1, node_id="test-1"))
    try:
        yield dispatcher
    finally:
        await dispatcher.loop.stop()


@contextlib.asynccontextmanager
async def working(
    settings: Settings, queue: str, starts: Starts, *, name: str = "w", concurrency: int = 16
) -> AsyncIterator[Worker]:
    worker = Worker(
        dataclasses.replace(settings, node_id=f"{settings.node_id}-{name}"),
        queues=[queue],
        registry=starts.registry,
        concurrency=concurrency,
        grace_period=5,
    )
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop()


async def insert_due(pool: asyncpg.Pool, queue: str, count: int, seconds: float) -> datetime:
    """``count`` jobs of ``t.stage`` due ``seconds`` from now (database time); their due
    time."""
    due = await pool.fetchval("SELECT now() + make_interval(secs => $1::float8)", seconds)
    await pool.execute(
        "INSERT INTO duetime.jobs (task, queue, due_at)"
        " SELECT 't.stage', $1, $2 FROM generate_series(1, $3)",
        queue,
        due,
        count,
    )
    return due


async def status_counts(pool: asyncpg.Pool) -> dict[str, int]:
    rows = await pool.fetch("SELECT status, count(*) AS n FROM duetime.jobs GROUP BY status")
    return {r["status"]: r["n"] for r in rows}


async def staged_count(pool: asyncpg.Pool) -> int:
    """Rows staged and not started: dispatched, heartbeat_at (their run time) ahead."""
    return int(
        await pool.fetchval(
            "SELECT count(*) FROM duetime.jobs WHERE status = 'dispatched' AND heartbeat_at > now()"
        )
    )


async def until(fn: Any, value: Any, timeout: float, what: str = "") -> None:
    """Wait until ``fn()`` (sync or async) equals ``value``."""

    async def check() -> bool:
        got = fn()
        if asyncio.iscoroutine(got):
            got = await got
        return bool(got == value)

    await wait_for(check, timeout=timeout, interval=0.02, message=what or f"== {value!r}")


def counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_jobs_due_soon_are_staged_and_start_at_their_run_time_once(
    pool: asyncpg.Pool, staged_settings: Settings, queue: str
) -> None:
    """Staged seconds ahead (rows dispatched with heartbeat_at = run time, held by the
    worker outside its slots), then each started once, not before its run time."""
    starts = Starts()
    before = counter("duetime_jobs_staged_total", shard="main", queue=queue)
    async with dispatching(staged_settings, pool), working(staged_settings, queue, starts) as w:
        due = await insert_due(pool, queue, 50, AHEAD)
        await until(lambda: staged_count(pool), 50, AHEAD - 0.5, "50 rows staged")
        consumer = w.consumer
        assert consumer is not None
        await until(lambda: consumer.staged, 50, AHEAD - 0.5, "50 held by the worker")
        assert not starts.at  # nothing started early
        await until(lambda: status_counts(pool), {"succeeded": 50}, AHEAD + 20)
    assert counter("duetime_jobs_staged_total", shard="main", queue=queue) - before == 50
    assert sorted(len(v) for v in starts.at.values()) == [1] * 50
    earliest = min(t for v in starts.at.values() for t in v)
    assert earliest >= due.timestamp() - 0.002, earliest - due.timestamp()


async def test_staged_jobs_cancelled_before_their_run_time_never_start(
    pool: asyncpg.Pool, staged_settings: Settings, queue: str
) -> None:
    """1,000 staged, half cancelled before their run time: none of those runs, each of
    the others runs once. Due 10 s out (the horizon 12 s), so that staging them and 500
    cancels fit before the run time on a slow machine; the test says so if they did not."""
    starts = Starts()
    lead = 10.0
    settings = dataclasses.replace(staged_settings, stage_ahead=lead + 2)
    async with dispatching(settings, pool), working(settings, queue, starts):
        due = await insert_due(pool, queue, 1000, lead)
        await until(lambda: staged_count(pool), 1000, lead - 2, "1,000 rows staged")
        ids = [r["id"] for r in await pool.fetch("SELECT id FROM duetime.jobs ORDER BY id")]
        cancelled = ids[::2]
        jobs = JobStore(pool)
        await asyncio.gather(*(jobs.cancel(job_id) for job_id in cancelled))
        left = due.timestamp() - time.time()
        assert left > 0.5, f"the cancels ended {-left:.1f}s after the run time, not before"
        assert await staged_count(pool) == 500
        await until(lambda: status_counts(pool), {"succeeded": 500, "cancelled": 500}, AHEAD + 30)
        await asyncio.sleep(0.5)  # a late start of a cancelled one would show now
    assert not set(cancelled) & set(starts.at)
    assert sorted(starts.at) == ids[1::2]
    assert all(len(v) == 1 for v in starts.at.values())


async def test_pausing_the_queue_gives_its_staged_jobs_back_and_none_starts(
    pool: asyncpg.Pool, staged_settings: Settings, queue: str
) -> None:
    """The pause's own transaction makes the staged rows pending again (migration 0028):
    at their run time the worker's begin finds them not dispatched and acks without a
    run. Resumed, they are dispatched and run once."""
    starts = Starts()
    queues = QueueStore(pool)
    async with dispatching(staged_settings, pool), working(staged_settings, queue, starts) as w:
        due = await insert_due(pool, queue, 20, AHEAD)
        await until(lambda: staged_count(pool), 20, AHEAD - 0.5, "20 rows staged")
        consumer = w.consumer
        assert consumer is not None
        await until(lambda: consumer.staged, 20, AHEAD - 0.5, "20 held by the worker")
        assert await queues.set_paused(queue, True)
        assert await status_counts(pool) == {"pending": 20}
        # past the run time: the worker released its deliveries, none ran
        await until(lambda: consumer.staged, 0, AHEAD + 5, "the held deliveries released")
        await asyncio.sleep(max(0.0, due.timestamp() - time.time()) + 0.5)
        assert not starts.at
        assert await status_counts(pool) == {"pending": 20}
        assert await queues.set_paused(queue, False)
        await until(lambda: status_counts(pool), {"succeeded": 20}, 20)
    assert sorted(len(v) for v in starts.at.values()) == [1] * 20


async def test_a_staged_job_moved_later_starts_at_its_new_run_time(
    pool: asyncpg.Pool, staged_settings: Settings, queue: str
) -> None:
    """run_at written by plain SQL while the job is staged: at the old time the worker
    finds the row's run time later, gives it back to pending (worker_unstage), and the
    job is staged again and starts at the new time, once."""
    starts = Starts()
    async with dispatching(staged_settings, pool), working(staged_settings, queue, starts):
        due = await insert_due(pool, queue, 1, AHEAD)
        await until(lambda: staged_count(pool), 1, AHEAD - 0.2, "the row staged")
        moved = await pool.fetchval(
            "UPDATE duetime.jobs SET run_at = due_at + interval '2 seconds' RETURNING run_at"
        )
        await until(lambda: status_counts(pool), {"succeeded": 1}, 20)
    [[started]] = starts.at.values()
    assert started >= moved.timestamp() - 0.002, (started, due, moved)
    assert counter("duetime_staged_released_total", outcome="moved") >= 1


async def test_the_reconciler_leaves_a_staged_job_alone_until_run_time_plus_visibility(
    pool: asyncpg.Pool, staged_settings: Settings, queue: str
) -> None:
    """A staged job is dispatched long before any worker shows a sign of life for it:
    its silence counts from its run time (heartbeat_at), so a visibility timeout
    shorter than the wait does not make it stalled. A job already due (its retry
    back-off ahead) is the case lock_stalled's due_at bound does not cover."""
    store = DispatchStore(pool)
    async with dispatching(staged_settings, pool):
        await pool.execute(
            "INSERT INTO duetime.jobs (task, queue, due_at, run_at)"
            " VALUES ('t.stage', $1, now(), now() + interval '4 seconds')",
            queue,
        )
        await until(lambda: staged_count(pool), 1, 3, "the row staged")
    await asyncio.sleep(1.2)  # longer than the visibility timeout below
    async with pool.acquire() as conn, conn.transaction():
        assert await store.lock_stalled(conn, 1.0, 10) == []
    await pool.execute("UPDATE duetime.jobs SET heartbeat_at = now() - interval '2 seconds'")
    async with pool.acquire() as conn, conn.transaction():
        assert len(await store.lock_stalled(conn, 1.0, 10)) == 1  # the same row, silent


async def test_jobs_under_a_limit_are_not_staged(
    pool: asyncpg.Pool, staged_settings: Settings, queue: str
) -> None:
    """A limit is decided when its job starts: a limited task's job stays pending until
    it is due; another task's job in the same queue is staged."""
    await LimitStore(pool).set("task:t.stage", 5)
    async with dispatching(staged_settings, pool):
        await insert_due(pool, queue, 3, AHEAD)
        await pool.execute(
            "INSERT INTO duetime.jobs (task, queue, due_at)"
            " VALUES ('t.other', $1, now() + interval '3 seconds')",
            queue,
        )
        await until(lambda: staged_count(pool), 1, AHEAD - 0.5, "the unlimited job staged")
        rows = await pool.fetch("SELECT task, status FROM duetime.jobs ORDER BY id")
    assert [(r["task"], r["status"]) for r in rows] == [
        ("t.stage", "pending"),
        ("t.stage", "pending"),
        ("t.stage", "pending"),
        ("t.other", "dispatched"),
    ]


async def test_a_limit_set_a_moment_ago_keeps_its_jobs_from_being_staged(
    pool: asyncpg.Pool, staged_settings: Settings, queue: str
) -> None:
    """The dispatcher refreshes its copy of the limits every second; a limit set while
    it runs, and jobs inserted right after it, must not be staged in between: the
    staging claim reads the limits itself (docs/api.md's limits example found this)."""
    async with dispatching(staged_settings, pool):
        await asyncio.sleep(0.3)  # the dispatcher runs and has read the (empty) limits
        for target in ("task:t.stage", f"queue:{queue}"):
            await LimitStore(pool).set(target, 5)
            await insert_due(pool, queue, 3, AHEAD - 0.5)
            await asyncio.sleep(1.5)  # staging looks at least every probe_interval
            assert await status_counts(pool) == {"pending": 3}, target
            await LimitStore(pool).remove(target)
            await pool.execute("DELETE FROM duetime.jobs")


async def test_a_stopping_worker_gives_staged_jobs_back_and_another_starts_them_on_time(
    pool: asyncpg.Pool, staged_settings: Settings, queue: str
) -> None:
    """SIGTERM's drain nacks the staged deliveries at once (the kill -9 case, where the
    broker requeues them with the connection, is the chaos suite's); a second worker
    receives them, holds them and starts each at its run time, once. A new leader
    (epoch 2) meanwhile stages nothing again: the rows are no longer pending."""
    first, second = Starts(), Starts()
    async with dispatching(staged_settings, pool):
        async with working(staged_settings, queue, first, name="a") as w:
            # a run time twice as far: worker a stops, a second term starts and worker b
            # starts (connects, declares, consumes) before it, on a busy machine too
            due = await insert_due(pool, queue, 30, 2 * AHEAD)
            consumer = w.consumer
            assert consumer is not None
            await until(lambda: consumer.staged, 30, AHEAD, "30 held by worker a")
    assert await FenceStore(pool).advance(2, "test-node-2")
    leader = Dispatcher(
        DutyContext.standalone(staged_settings, pool),
        config=DispatcherConfig(stage_ahead=staged_settings.stage_ahead, probe_interval=0.02),
    )
    leader.loop.start(LeaderTerm(epoch=2, node_id="test-2"))
    try:
        async with working(staged_settings, queue, second, name="b") as w:
            consumer = w.consumer
            assert consumer is not None
            before_due = max(0.0, due.timestamp() - time.time() - 0.2)
            await until(lambda: consumer.staged, 30, before_due, "30 held by worker b")
            await until(lambda: status_counts(pool), {"succeeded": 30}, 2 * AHEAD + 20)
    finally:
        await leader.loop.stop()
    assert not first.at
    assert sorted(len(v) for v in second.at.values()) == [1] * 30
    assert min(t for v in second.at.values() for t in v) >= due.timestamp() - 0.002
    epochs = await pool.fetch("SELECT DISTINCT dispatch_epoch FROM duetime.jobs")
    assert [r["dispatch_epoch"] for r in epochs] == [1]  # staged once, by the first term


async def test_a_queue_whose_staged_queue_has_no_consumer_is_not_staged_again(
    pool: asyncpg.Pool, staged_settings: Settings, queue: str
) -> None:
    """Workers that take no staged job (``worker_stage_limit`` 0, or a version without
    staging): after the first staged batch, the next sample counts no consumer on the
    staged queue, and the queue's jobs are dispatched when due instead, and run."""
    starts = Starts()
    no_staging = dataclasses.replace(staged_settings, worker_stage_limit=0)
    async with dispatching(staged_settings, pool), working(no_staging, queue, starts) as w:
        assert w.consumer is not None and w.consumer.stage_limit == 0
        await insert_due(pool, queue, 1, AHEAD)
        await until(lambda: staged_count(pool), 1, AHEAD - 0.5, "the first job staged")
        await asyncio.sleep(0.5)  # the staged queue's next samples: no consumer
        due = await insert_due(pool, queue, 1, 1.5)
        await asyncio.sleep(1.0)
        assert await staged_count(pool) == 1  # the second one was not staged
        await until(lambda: len(starts.at), 1, 20, "the second job started")
        [[started]] = starts.at.values()
        assert started >= due.timestamp() - 0.002
        # its start is recorded before its outcome commits: wait for the commit
        expected = {"dispatched": 1, "succeeded": 1}
        await until(lambda: status_counts(pool), expected, 10, "the second job settled")
        assert await status_counts(pool) == expected


async def test_a_job_with_a_unique_key_is_not_staged(
    pool: asyncpg.Pool, staged_settings: Settings, queue: str
) -> None:
    """A debounce (on_conflict="replace") moves a pending holder to the newest run time
    and payload and leaves a dispatched one alone: staged seconds early, a holder would
    stop taking the last edit. Such jobs are dispatched when due; the others staged."""
    jobs = JobStore(pool)
    async with dispatching(staged_settings, pool):
        plain = await jobs.enqueue("t.stage", {}, queue=queue, delay=AHEAD)
        unique = await jobs.enqueue(
            "t.stage", {"v": 1}, queue=queue, delay=AHEAD, unique_key="doc:7",
            on_conflict="replace",
        )  # fmt: skip
        await until(lambda: staged_count(pool), 1, AHEAD - 0.5, "the plain job staged")
        await asyncio.sleep(0.3)
        replaced = await jobs.enqueue(
            "t.stage", {"v": 2}, queue=queue, delay=AHEAD, unique_key="doc:7",
            on_conflict="replace",
        )  # fmt: skip
        rows = {r["id"]: r for r in await pool.fetch("SELECT * FROM duetime.jobs")}
    assert rows[plain.id]["status"] == "dispatched"
    assert rows[unique.id]["status"] == "pending" and rows[unique.id]["payload"] == {"v": 2}
    assert replaced.id == unique.id and len(rows) == 2


async def test_staged_jobs_due_at_once_are_begun_no_more_than_prefetch_at_a_time(
    pool: asyncpg.Pool, staged_settings: Settings, queue: str
) -> None:
    """240 staged jobs come due at the same instant on a worker of 2 handlers and
    prefetch 20. Each delivery being begun holds its attempt's guard lock (a PostgreSQL
    advisory lock) until its outcome commits; all 240 begun at once would hold 240 (a
    storm of 20,000 held 9,000 on one worker, and PostgreSQL's lock table, shared by the
    whole server, holds 6,400 by default). They wait for room instead, in memory
    (``duetime_staged_due_waiting``), and all start once, none early."""
    settings = dataclasses.replace(staged_settings, worker_prefetch=20)
    starts = Starts()

    @starts.registry.task("t.slow")
    async def slow(ctx: JobContext, payload: dict[str, Any]) -> None:
        starts.at.setdefault(ctx.job_id, []).append(time.time())
        await asyncio.sleep(0.01)

    peak_locks = peak_waiting = peak_held = 0

    async def watch(guard: AttemptGuard) -> None:
        nonlocal peak_locks, peak_waiting, peak_held
        while True:
            peak_held = max(peak_held, guard.held)
            locks = await pool.fetchval(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND database = "
                "(SELECT oid FROM pg_database WHERE datname = current_database())"
            )
            peak_locks = max(peak_locks, locks)
            waiting = REGISTRY.get_sample_value("duetime_staged_due_waiting") or 0.0
            peak_waiting = max(peak_waiting, int(waiting))
            await asyncio.sleep(0.01)

    async with (
        dispatching(settings, pool),
        working(settings, queue, starts, name="room", concurrency=2) as worker,
    ):
        executor = worker.executor
        assert executor is not None
        watcher = asyncio.create_task(watch(executor._store.guard))
        try:
            due = await pool.fetchval("SELECT now() + make_interval(secs => $1::float8)", AHEAD)
            await pool.execute(
                "INSERT INTO duetime.jobs (task, queue, due_at)"
                " SELECT 't.slow', $1, $2 FROM generate_series(1, 240)",
                queue,
                due,
            )
            consumer = worker.consumer
            assert consumer is not None
            await until(lambda: consumer.staged, 240, AHEAD - 0.5, "240 held by the worker")
            await until(lambda: status_counts(pool), {"succeeded": 240}, AHEAD + 40)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
    assert sorted(len(v) for v in starts.at.values()) == [1] * 240
    assert min(t for v in starts.at.values() for t in v) >= due.timestamp() - 0.002
    # the guards held by the worker: at most the room (20), begun, running or settling
    assert 2 <= peak_held <= 20, peak_held
    # in PostgreSQL, also the settled attempts' guards whose batched release rides on the
    # next begin read or goes after RELEASE_DELAY: what 2 handlers of 10 ms settle in
    # that window (a few; more when a busy machine delays the event loop), far from 240
    assert peak_locks <= 2 * 20, peak_locks
    assert peak_waiting >= 100, peak_waiting  # the rest waited, holding nothing
    assert (REGISTRY.get_sample_value("duetime_staged_due_waiting") or 0.0) == 0
