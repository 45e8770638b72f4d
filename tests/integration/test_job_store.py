"""JobStore, the producer-facing API: enqueue, bulk enqueue (COPY), get,
keyset pagination that stays complete under concurrent inserts, filters, and the cancel
and retry transitions with the errors users see.

Runs in a database of its own: it leaves 100k due jobs behind, which must not reach
other tests' dispatchers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from scheduler import db
from scheduler.errors import InvalidInput, InvalidTransition, JobNotFound
from scheduler.jobspec import JobSpec
from scheduler.store import JobStore
from scheduler.store.jobs import MAX_PAGE
from scheduler.store.rows import Job
from tests.conftest import own_database
from tests.fixtures_tasks.jobs import FENCE_EPOCH
from tests.support.wait import wait_for

UNKNOWN_ID = 2**62


@pytest.fixture(scope="module")
async def store_dsn(server_dsn: str) -> AsyncIterator[str]:
    async with own_database(server_dsn, "jobstore") as url:
        yield url


@pytest.fixture(scope="module")
async def pool(store_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    p = await db.create_pool(store_dsn, min_size=1, max_size=6)
    yield p
    await p.close()


@pytest.fixture
def store(pool: asyncpg.Pool) -> JobStore:
    return JobStore(pool)


async def _set(pool: asyncpg.Pool, job_id: int, status: str, **extra: object) -> None:
    """Put a job in a state the client API cannot reach (the dispatcher/worker's job)."""
    sets = ", ".join(f"{k} = ${i}" for i, k in enumerate(extra, start=3))
    if status == "dispatched" and "dispatch_epoch" not in extra:
        sets = ", ".join(filter(None, [sets, f"dispatch_epoch = {FENCE_EPOCH}"]))
    await pool.execute(
        f"UPDATE duetime.jobs SET status = $2{', ' + sets if sets else ''} WHERE id = $1",
        job_id,
        status,
        *extra.values(),
    )


# -- enqueue ----------------------------------------------------------------------------


async def test_enqueue_defaults_and_values(store: JobStore, pool: asyncpg.Pool) -> None:
    db_now = await pool.fetchval("SELECT now()")
    job = await store.enqueue("send_email", {"to": "a@example.com"})
    assert isinstance(job, Job)
    assert (job.task, job.payload, job.queue, job.status) == (
        "send_email",
        {"to": "a@example.com"},
        "default",
        "pending",
    )
    assert (job.attempt, job.max_attempts, job.idempotency_key, job.run_at) == (1, 5, None, None)
    assert job.due_at >= db_now  # neither due_at nor delay: due now, in database time
    assert job.effective_key == f"job:{job.id}"
    assert job.next_run_at == job.due_at

    due = datetime(2031, 7, 1, 12, 30, tzinfo=UTC)
    full = await store.enqueue(
        "report",
        {"n": [1, 2]},
        due_at=due,
        queue="reports.eu",
        max_attempts=9,
        idempotency_key="report:2031-07-01",
    )
    assert (full.due_at, full.queue, full.max_attempts, full.idempotency_key) == (
        due,
        "reports.eu",
        9,
        "report:2031-07-01",
    )
    # the ledger key: the producer's key scoped by the role that inserted it
    owner = full.created_by or ""
    assert full.effective_key == f"key:{len(owner)}:{owner}:report:2031-07-01"
    assert await store.get(full.id) == full


async def test_enqueue_with_delay(store: JobStore) -> None:
    before = datetime.now(UTC)
    job = await store.enqueue("t", delay=timedelta(minutes=5))
    assert before + timedelta(minutes=5) <= job.due_at <= datetime.now(UTC) + timedelta(minutes=5)
    job = await store.enqueue("t", delay=1.5)
    assert job.due_at >= before + timedelta(seconds=1.5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"task": ""}, "task name"),
        ({"task": "t", "payload": [1]}, "payload must be a JSON object"),
        ({"task": "t", "queue": "no spaces"}, "invalid queue name"),
        ({"task": "t", "max_attempts": 0}, "max_attempts"),
        ({"task": "t", "due_at": datetime(2030, 1, 1)}, "timezone-aware"),
        ({"task": "t", "due_at": datetime.now(UTC), "delay": 5}, "not both"),
        ({"task": "t", "delay": -5}, "delay"),
    ],
)
async def test_enqueue_refuses_bad_input(
    store: JobStore, pool: asyncpg.Pool, kwargs: dict, message: str
) -> None:
    before = await pool.fetchval("SELECT count(*) FROM duetime.jobs")
    with pytest.raises(InvalidInput, match=message):
        await store.enqueue(**kwargs)
    assert await pool.fetchval("SELECT count(*) FROM duetime.jobs") == before


async def test_enqueue_in_the_callers_transaction(store: JobStore, pool: asyncpg.Pool) -> None:
    """The outbox pattern: the job exists exactly when the caller's own writes commit."""
    async with pool.acquire() as conn:
        with pytest.raises(RuntimeError):
            async with conn.transaction():
                rolled_back = await store.enqueue("outbox", conn=conn)
                raise RuntimeError("caller's transaction fails")
        async with conn.transaction():
            committed = await store.enqueue("outbox", conn=conn)
    with pytest.raises(JobNotFound):
        await store.get(rolled_back.id)
    assert (await store.get(committed.id)).task == "outbox"


async def test_get_unknown_job(store: JobStore) -> None:
    with pytest.raises(JobNotFound) as info:
        await store.get(UNKNOWN_ID)
    assert str(info.value) == f"job {UNKNOWN_ID} not found"
    assert info.value.job_id == UNKNOWN_ID


# -- bulk enqueue and pagination ----------------------------------------------------------


async def test_bulk_enqueue_100k_and_paginate(store: JobStore, pool: asyncpg.Pool) -> None:
    task = "bulk100k"
    start = datetime.now(UTC)
    specs = [
        JobSpec(task, {"i": i}, due_at=start + timedelta(seconds=i % 86_400))
        for i in range(100_000)
    ]
    assert await store.bulk_enqueue(specs) == 100_000
    assert await pool.fetchval("SELECT count(*) FROM duetime.jobs WHERE task = $1", task) == 100_000
    expected = [
        r["id"]
        for r in await pool.fetch("SELECT id FROM duetime.jobs WHERE task = $1 ORDER BY id", task)
    ]

    seen = [job.id async for job in store.iterate(page_size=1000, task=task)]
    assert seen == expected  # every id exactly once, ascending

    # Page by hand the way the CLI does, and check the seams between pages.
    pages: list[list[int]] = []
    after = None
    while True:
        page = await store.list(task=task, after_id=after, limit=1000)
        if not page:
            break
        pages.append([j.id for j in page])
        after = page[-1].id
    assert len(pages) == 100
    assert [i for p in pages for i in p] == expected

    # Payloads and due times arrived intact through COPY.
    sample = await store.get(expected[12_345])
    assert sample.payload == {"i": 12_345}
    assert sample.due_at == start + timedelta(seconds=12_345)


async def test_pagination_is_complete_while_inserts_happen(
    store: JobStore, pool: asyncpg.Pool
) -> None:
    task = "paging-concurrent"
    assert await store.bulk_enqueue([JobSpec(task, {"i": i}) for i in range(20_000)]) == 20_000
    existing = {
        r["id"] for r in await pool.fetch("SELECT id FROM duetime.jobs WHERE task = $1", task)
    }
    inserted: list[int] = []
    stop = asyncio.Event()

    async def producer() -> None:
        while not stop.is_set():
            job = await store.enqueue(task, {"late": True})
            inserted.append(job.id)
            await store.bulk_enqueue([JobSpec(task, {"late": True}) for _ in range(50)])

    producing = asyncio.create_task(producer())
    try:
        await wait_for(lambda: len(inserted) >= 3, timeout=10, message="concurrent inserts")
        before_scan = len(inserted)
        seen = [job.id async for job in store.iterate(page_size=1000, task=task)]
        during_scan = len(inserted) - before_scan
    finally:
        stop.set()
        await asyncio.wait_for(producing, timeout=10)
    assert during_scan > 0, "the producer must have inserted while the scan ran"
    assert seen == sorted(set(seen)), "ids must come ascending and exactly once"
    assert existing <= set(seen), "every row that existed before the scan must be seen"
    everything = {
        r["id"] for r in await pool.fetch("SELECT id FROM duetime.jobs WHERE task = $1", task)
    }
    assert set(seen) <= everything


async def test_bulk_enqueue_edge_cases(store: JobStore, pool: asyncpg.Pool) -> None:
    assert await store.bulk_enqueue([]) == 0
    tricky = {"text": "tab\there\nline\r\\back\\N \\.", "ü": "日本", "q": '"', "n": None}
    due = datetime(2030, 5, 6, 7, 8, 9, 123456, tzinfo=UTC)
    count = await store.bulk_enqueue(
        [
            JobSpec(
                "bulk\tedge\\",
                tricky,
                due_at=due,
                queue="edge",
                max_attempts=3,
                idempotency_key="k\\\t1",
            ),
            JobSpec("bulk-now"),
        ]
    )
    assert count == 2
    [job] = await store.list(queue="edge", limit=10)
    assert (job.task, job.payload, job.due_at, job.max_attempts, job.idempotency_key) == (
        "bulk\tedge\\",
        tricky,
        due,
        3,
        "k\\\t1",
    )
    [now_job] = await store.list(task="bulk-now", limit=10)
    assert now_job.due_at <= datetime.now(UTC)

    before = await pool.fetchval("SELECT count(*) FROM duetime.jobs")
    for bad in ({"x": float("nan")}, {"x": object()}):
        with pytest.raises(InvalidInput, match="job 1: payload is not valid JSON"):
            await store.bulk_enqueue([JobSpec("ok"), JobSpec("bad", bad)])
    assert await pool.fetchval("SELECT count(*) FROM duetime.jobs") == before


async def test_bulk_enqueue_in_the_callers_transaction(store: JobStore, pool: asyncpg.Pool) -> None:
    async with pool.acquire() as conn:
        with pytest.raises(RuntimeError):
            async with conn.transaction():
                await store.bulk_enqueue([JobSpec("bulk-rollback")] * 10, conn=conn)
                raise RuntimeError
    assert (
        await pool.fetchval("SELECT count(*) FROM duetime.jobs WHERE task = 'bulk-rollback'") == 0
    )


async def test_list_filters(store: JobStore, pool: asyncpg.Pool) -> None:
    q = "filters"
    t0 = datetime(2030, 1, 1, tzinfo=UTC)
    a1 = await store.enqueue("a", queue=q, due_at=t0)
    a2 = await store.enqueue("a", queue=q, due_at=t0 + timedelta(hours=1))
    b1 = await store.enqueue("b", queue=q, due_at=t0 + timedelta(hours=2))
    other = await store.enqueue("a", queue="filters-other", due_at=t0)
    await store.cancel(a2.id)

    async def ids(**filters: object) -> list[int]:
        return [j.id for j in await store.list(limit=100, **filters)]  # type: ignore[arg-type]

    assert await ids(queue=q) == [a1.id, a2.id, b1.id]
    assert await ids(queue=q, status="pending") == [a1.id, b1.id]
    assert await ids(queue=q, status="cancelled") == [a2.id]
    assert await ids(queue=q, task="a") == [a1.id, a2.id]
    assert await ids(task="a", due_from=t0, due_to=t0 + timedelta(minutes=1)) == [a1.id, other.id]
    assert await ids(queue=q, due_from=t0 + timedelta(hours=1)) == [a2.id, b1.id]  # inclusive
    assert await ids(queue=q, due_to=t0 + timedelta(hours=2)) == [a1.id, a2.id]  # exclusive
    assert await ids(queue=q, after_id=a1.id) == [a2.id, b1.id]
    assert [j.id for j in await store.list(queue=q, limit=2)] == [a1.id, a2.id]
    assert await ids(queue="no-such-queue") == []
    assert [j.id async for j in store.iterate(page_size=1, queue=q, status="pending")] == [
        a1.id,
        b1.id,
    ]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"status": "running"}, "unknown status 'running'"),
        ({"limit": 0}, f"limit must be between 1 and {MAX_PAGE}"),
        ({"limit": MAX_PAGE + 1}, f"limit must be between 1 and {MAX_PAGE}"),
    ],
)
async def test_list_refuses_bad_arguments(store: JobStore, kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        await store.list(**kwargs)


# -- cancel and retry ----------------------------------------------------------------------


async def test_cancel_pending(store: JobStore, pool: asyncpg.Pool) -> None:
    job = await store.enqueue("c", delay=3600)
    cancelled = await store.cancel(job.id)
    assert cancelled.status == "cancelled"
    assert cancelled.finished_at is not None
    assert await store.get(job.id) == cancelled


@pytest.mark.parametrize("status", ["cancelled", "succeeded", "dead"])
async def test_cancel_refuses_finished_jobs(
    store: JobStore, pool: asyncpg.Pool, status: str
) -> None:
    job = await store.enqueue("c")
    await _set(pool, job.id, status)
    with pytest.raises(InvalidTransition) as info:
        await store.cancel(job.id)
    assert str(info.value) == (
        f"job {job.id} is {status}; only pending or running (dispatched) jobs can be cancelled"
    )
    assert (await store.get(job.id)).status == status


async def test_cancel_takes_a_dispatched_job_and_tells_its_worker(
    store: JobStore, pool: asyncpg.Pool, store_dsn: str
) -> None:
    """A running job is cancelled, with who; the workers hear its id on duetime_cancel
    at the commit (tests/integration/test_job_control.py: the handler stops)."""
    job = await store.enqueue("c")
    await _set(pool, job.id, "dispatched")
    heard: list[str] = []
    listen = await asyncpg.connect(store_dsn)
    try:
        await listen.add_listener("duetime_cancel", lambda *args: heard.append(args[3]))
        cancelled = await store.cancel(job.id, by="ops")
        assert (cancelled.status, cancelled.cancelled_by) == ("cancelled", "ops")
        await wait_for(lambda: heard == [str(job.id)], timeout=5)
    finally:
        await listen.close()


async def test_cancel_unknown(store: JobStore) -> None:
    with pytest.raises(JobNotFound, match=f"job {UNKNOWN_ID} not found"):
        await store.cancel(UNKNOWN_ID)


async def test_retry_dead_job_notifies(store: JobStore, pool: asyncpg.Pool, store_dsn: str) -> None:
    job = await store.enqueue("r", max_attempts=3)
    await pool.execute(
        "UPDATE duetime.jobs SET status = 'dead', attempt = 3, last_error = 'boom', "
        "dispatched_at = now(), heartbeat_at = now(), finished_at = now(), dispatch_epoch = 7 "
        "WHERE id = $1",
        job.id,
    )
    listener = await db.connect(store_dsn)
    heard: list[str] = []
    try:
        await listener.add_listener("duetime_jobs", lambda *args: heard.append(args[-1]))
        db_before = await pool.fetchval("SELECT clock_timestamp()")
        retried = await store.retry(job.id)
        await wait_for(lambda: heard, timeout=5, message="NOTIFY on duetime_jobs after retry")
    finally:
        await listener.close()
    assert retried.status == "pending"
    assert retried.attempt == 1
    assert retried.max_attempts == 3
    assert retried.run_at is not None and retried.run_at >= db_before
    assert retried.run_at >= retried.due_at
    for column in ("dispatched_at", "heartbeat_at", "finished_at", "dispatch_epoch"):
        assert getattr(retried, column) is None, column
    assert retried.last_error == "boom"  # kept until the next outcome replaces it
    assert await store.get(job.id) == retried


@pytest.mark.parametrize("status", ["pending", "dispatched", "succeeded", "cancelled"])
async def test_retry_refuses_non_dead(store: JobStore, pool: asyncpg.Pool, status: str) -> None:
    job = await store.enqueue("r")
    if status != "pending":
        await _set(pool, job.id, status)
    with pytest.raises(InvalidTransition) as info:
        await store.retry(job.id)
    assert str(info.value) == f"job {job.id} is {status}; only dead jobs can be retried"
    after = await store.get(job.id)
    assert (after.status, after.attempt, after.run_at) == (status, 1, None)


async def test_retry_unknown(store: JobStore) -> None:
    with pytest.raises(JobNotFound, match=f"job {UNKNOWN_ID} not found"):
        await store.retry(UNKNOWN_ID)


async def test_counts_by_status(store: JobStore, pool: asyncpg.Pool) -> None:
    job = await store.enqueue("counted")
    await _set(pool, job.id, "dead")
    counts = await store.counts_by_status()
    assert set(counts) == {"pending", "dispatched", "succeeded", "dead", "cancelled", "waiting"}
    for status, n in counts.items():
        expected = await pool.fetchval(
            "SELECT count(*) FROM duetime.jobs WHERE status = $1", status
        )
        assert n == expected, status
    assert counts["dead"] >= 1
