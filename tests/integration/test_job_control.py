"""Job control (DESIGN §12; migration 0019) against real PostgreSQL and RabbitMQ:
results, cancelling running jobs, snooze, per-job timeouts.

Like tests/integration/test_executor.py, each test plays the dispatcher by hand
(``tests.fixtures_tasks.jobs``) and runs an in-process ``Worker`` with a registry of its
own; what is checked is the row (status, result, counters) and the handler's effects.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import asyncpg
import pytest
from aio_pika.abc import AbstractChannel
from prometheus_client import REGISTRY

from scheduler.config import Settings
from scheduler.errors import InvalidTransition, JobCancelled, JobFailed
from scheduler.store.jobs import JobStore
from tests.fixtures_tasks.basic import EFFECTS_TABLE
from tests.fixtures_tasks.jobs import DispatchedJob, dispatched_job, effects, job_row, publish
from tests.support.helpers import running_worker
from tests.support.wait import wait_for
from workers import JobContext, Registry, Snooze

pytestmark = pytest.mark.timeout(60)
MAIN = {"shard": "main"}


def _insert(ctx: JobContext, tag: str | None = None) -> Any:
    return ctx.db.execute(
        f"INSERT INTO {EFFECTS_TABLE} (job_id, attempt, tag) VALUES ($1, $2, $3)",
        ctx.job_id,
        ctx.attempt,
        tag,
    )


async def _status(pool: asyncpg.Pool, job: DispatchedJob, *statuses: str) -> bool:
    return (await job_row(pool, job))["status"] in statuses


def _finished(outcome: str, task: str) -> float:
    labels = {**MAIN, "task": task, "outcome": outcome}
    return REGISTRY.get_sample_value("duetime_jobs_finished_total", labels) or 0.0


# -- results ------------------------------------------------------------------------------


async def test_what_a_handler_returns_is_stored_with_its_outcome(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    effects_table: str,
) -> None:
    """Every way an attempt commits stores its result: batched (no ctx.db), in its own
    transaction (ctx.db), in a transaction group; None stores nothing."""
    registry = Registry()

    @registry.task("r.plain")
    async def plain(ctx: JobContext, payload: dict[str, Any]) -> Any:
        return {"n": payload["n"], "text": "é\u2603"}

    @registry.task("r.db")
    async def with_db(ctx: JobContext, payload: dict[str, Any]) -> Any:
        await _insert(ctx, "db")
        return [1, 2, payload["n"]]

    @registry.task("r.group", share_transaction=True)
    async def grouped(ctx: JobContext, payload: dict[str, Any]) -> Any:
        await _insert(ctx, "group")
        return payload["n"] * 10

    @registry.task("r.none")
    async def nothing(ctx: JobContext, payload: dict[str, Any]) -> None:
        await _insert(ctx, "none")

    jobs = {
        "plain": await dispatched_job(db_pool, "r.plain", {"n": 1}, queue=queue),
        "db": await dispatched_job(db_pool, "r.db", {"n": 2}, queue=queue),
        "group1": await dispatched_job(db_pool, "r.group", {"n": 3}, queue=queue),
        "group2": await dispatched_job(db_pool, "r.group", {"n": 4}, queue=queue),
        "none": await dispatched_job(db_pool, "r.none", {"n": 5}, queue=queue),
    }
    for job in jobs.values():
        await publish(channel, queue, job.message(1))
    async with running_worker(settings, registry, queue):
        for job in jobs.values():
            await wait_for(lambda j=job: _status(db_pool, j, "succeeded"), timeout=15)
    results = {name: (await job_row(db_pool, job))["result"] for name, job in jobs.items()}
    assert results == {
        "plain": {"n": 1, "text": "é\u2603"},
        "db": [1, 2, 2],
        "group1": 30,
        "group2": 40,
        "none": None,
    }
    assert await effects(db_pool, jobs["db"], effects_table) == 1


async def test_a_result_over_the_cap_is_a_failed_attempt_and_its_effects_roll_back(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    effects_table: str,
) -> None:
    registry = Registry()

    @registry.task("r.big")
    async def big(ctx: JobContext, payload: dict[str, Any]) -> Any:
        await _insert(ctx, "big")
        return "x" * 500

    @registry.task("r.odd")
    async def odd(ctx: JobContext, payload: dict[str, Any]) -> Any:
        return {"when": object()}

    job = await dispatched_job(db_pool, "r.big", queue=queue)
    bad = await dispatched_job(db_pool, "r.odd", queue=queue)
    small = dataclasses.replace(settings, result_max_bytes=100)
    await publish(channel, queue, job.message(1))
    await publish(channel, queue, bad.message(1))
    async with running_worker(small, registry, queue):
        await wait_for(lambda: _status(db_pool, job, "pending"), timeout=15)
        await wait_for(lambda: _status(db_pool, bad, "pending"), timeout=15)
    row = await job_row(db_pool, job)
    assert (row["attempt"], row["result"]) == (2, None)
    assert "ResultRejected" in row["last_error"] and "result_max_bytes (100)" in row["last_error"]
    assert "502 bytes" in row["last_error"]
    assert await effects(db_pool, job, effects_table) == 0
    assert "not JSON-serialisable" in (await job_row(db_pool, bad))["last_error"]


async def test_result_waits_for_the_outcome_and_raises_for_failure_and_cancel(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
) -> None:
    """``JobStore.result`` returns once the worker committed (a NOTIFY wakes it), raises
    ``JobFailed`` with the last error for a dead job, ``JobCancelled`` (with who) for a
    cancelled one, and ``TimeoutError`` when nothing finished in time."""
    registry = Registry()
    gate = asyncio.Event()

    @registry.task("r.slow")
    async def slow(ctx: JobContext, payload: dict[str, Any]) -> Any:
        await gate.wait()
        return {"answer": 42}

    @registry.task("r.fails")
    async def fails(ctx: JobContext, payload: dict[str, Any]) -> Any:
        raise ValueError("no such customer")

    store = JobStore(db_pool)
    ok = await dispatched_job(db_pool, "r.slow", queue=queue)
    dead = await dispatched_job(db_pool, "r.fails", queue=queue, max_attempts=1)
    pending = await store.enqueue("r.never", queue=f"{queue}-idle", delay=3600)
    with pytest.raises(TimeoutError, match=r"did not finish within 0\.2s"):
        await store.result(ok.id, timeout=0.2)
    waiting = asyncio.create_task(store.result(ok.id, timeout=20))
    await publish(channel, queue, ok.message(1))
    await publish(channel, queue, dead.message(1))
    async with running_worker(settings, registry, queue):
        with pytest.raises(JobFailed, match="no such customer"):
            await store.result(dead.id, timeout=20)
        await asyncio.sleep(0.2)
        assert not waiting.done()
        gate.set()
        assert await asyncio.wait_for(waiting, 20) == {"answer": 42}
    cancel_wait = asyncio.create_task(store.result(pending.id, timeout=20))
    await asyncio.sleep(0.1)
    await store.cancel(pending.id, by="ops@example")
    with pytest.raises(JobCancelled, match="by ops@example"):
        await asyncio.wait_for(cancel_wait, 20)
    # the waiters unregistered themselves
    assert (
        await db_pool.fetchval(
            "SELECT count(*) FROM duetime.result_waiters WHERE job_id = ANY($1::bigint[])",
            [ok.id, dead.id, pending.id],
        )
        == 0
    )


async def test_result_sees_a_settlement_that_was_in_flight_when_it_registered(
    db_pool: asyncpg.Pool, queue: str
) -> None:
    """The settlement updated the row (and its trigger found no waiter) but has not
    committed when ``result`` registers: the registration waits for that commit, so the
    outcome is not missed (without the wait this timed out: a lost wake-up)."""
    job = await dispatched_job(db_pool, "r.inflight", queue=queue)
    store = JobStore(db_pool)
    async with db_pool.acquire() as conn:
        tx = conn.transaction()
        await tx.start()
        await conn.execute(
            "UPDATE duetime.jobs SET status = 'succeeded', finished_at = now(), "
            "result = '7'::jsonb WHERE id = $1",
            job.id,
        )
        waiting = asyncio.create_task(store.result(job.id, timeout=5))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        await tx.commit()
    assert await asyncio.wait_for(waiting, 10) == 7


# -- cancel -------------------------------------------------------------------------------


async def test_cancelling_a_running_job_stops_its_handler_and_rolls_back_its_writes(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    effects_table: str,
) -> None:
    """A handler that wrote through ctx.db and then runs for 30 s is stopped within a
    second of the cancel: CancelledError inside it, ctx.cancelled set, its write gone,
    the row ``cancelled`` with who cancelled it."""
    registry = Registry()
    started = asyncio.Event()
    seen: dict[str, Any] = {}

    @registry.task("c.long")
    async def long(ctx: JobContext, payload: dict[str, Any]) -> None:
        await _insert(ctx, "before-cancel")
        started.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen["cancelled_flag"] = ctx.cancelled.is_set()
            raise

    job = await dispatched_job(db_pool, "c.long", queue=queue)
    store = JobStore(db_pool)
    before = _finished("cancelled", "c.long")
    await publish(channel, queue, job.message(1))
    async with running_worker(settings, registry, queue) as worker:
        await asyncio.wait_for(started.wait(), 15)
        loop = asyncio.get_running_loop()
        asked = loop.time()
        cancelled = await store.cancel(job.id, by="alice")
        assert cancelled.status == "cancelled"
        await wait_for(lambda: _finished("cancelled", "c.long") == before + 1, timeout=5)
        took = loop.time() - asked
        assert worker.consumer is not None
        await wait_for(lambda: worker.consumer.in_flight == 0, timeout=5)
    assert took < 1.0, f"the handler stopped {took:.2f}s after the cancel"
    assert seen == {"cancelled_flag": True}
    row = await job_row(db_pool, job)
    assert (row["status"], row["cancelled_by"]) == ("cancelled", "alice")
    assert await effects(db_pool, job, effects_table) == 0
    with pytest.raises(InvalidTransition, match="is cancelled; only pending or running"):
        await store.cancel(job.id)


async def test_a_cancel_racing_the_settlement_wins_cleanly(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    effects_table: str,
) -> None:
    """The handler returned and its settlement waits for the row, which a cancel holds
    locked: the cancel commits first, the settlement finds the row ``cancelled`` and
    rolls the handler's writes back; the status is never overwritten. Once a job
    succeeded, a cancel is refused."""
    registry = Registry()
    returned = asyncio.Event()

    @registry.task("c.race")
    async def race(ctx: JobContext, payload: dict[str, Any]) -> Any:
        await _insert(ctx, "race")
        returned.set()
        return "done"

    job = await dispatched_job(db_pool, "c.race", queue=queue)
    store = JobStore(db_pool)
    async with db_pool.acquire() as lock_conn:
        tx = lock_conn.transaction()
        await tx.start()
        await lock_conn.execute(
            "SELECT 1 FROM duetime.jobs WHERE id = $1 FOR NO KEY UPDATE", job.id
        )  # the settlement will wait for this lock
        await publish(channel, queue, job.message(1))
        async with running_worker(settings, registry, queue) as worker:
            await asyncio.wait_for(returned.wait(), 15)
            await asyncio.sleep(0.3)  # the settlement is now waiting on the row lock
            await store.cancel(job.id, by="racer", conn=lock_conn)
            await tx.commit()
            assert worker.consumer is not None
            await wait_for(lambda: worker.consumer.in_flight == 0, timeout=10)
    row = await job_row(db_pool, job)
    assert (row["status"], row["cancelled_by"], row["result"]) == ("cancelled", "racer", None)
    assert await effects(db_pool, job, effects_table) == 0

    done = await dispatched_job(db_pool, "c.race", queue=queue)
    returned.clear()
    await publish(channel, queue, done.message(1))
    async with running_worker(settings, registry, queue):
        await wait_for(lambda: _status(db_pool, done, "succeeded"), timeout=15)
    with pytest.raises(InvalidTransition, match="is succeeded; only pending or running"):
        await store.cancel(done.id)
    assert (await job_row(db_pool, done))["status"] == "succeeded"


async def test_a_job_cancelled_between_dispatch_and_start_never_starts(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
) -> None:
    """Cancelled while its message waits in the queue (or its worker was killed): the
    delivery finds the row cancelled and the handler never runs."""
    registry = Registry()
    ran: list[int] = []

    @registry.task("c.never")
    async def never(ctx: JobContext, payload: dict[str, Any]) -> None:
        ran.append(ctx.job_id)

    job = await dispatched_job(db_pool, "c.never", queue=queue)
    marker = await dispatched_job(db_pool, "c.never", queue=queue)
    await JobStore(db_pool).cancel(job.id)
    await publish(channel, queue, job.message(1))
    await publish(channel, queue, marker.message(1))
    async with running_worker(settings, registry, queue):
        await wait_for(lambda: _status(db_pool, marker, "succeeded"), timeout=15)
        await asyncio.sleep(0.2)
    assert ran == [marker.id]
    assert (await job_row(db_pool, job))["status"] == "cancelled"


async def test_a_cancel_whose_notify_was_lost_is_found_by_the_check(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
) -> None:
    """A cancel written by plain SQL sends no NOTIFY (as one lost with a LISTEN
    connection): the worker's periodic check of its running jobs stops the handler."""
    registry = Registry()
    started = asyncio.Event()

    @registry.task("c.quiet")
    async def quiet(ctx: JobContext, payload: dict[str, Any]) -> None:
        started.set()
        await asyncio.sleep(30)

    job = await dispatched_job(db_pool, "c.quiet", queue=queue)
    before = _finished("cancelled", "c.quiet")
    await publish(channel, queue, job.message(1))
    async with running_worker(settings, registry, queue):
        await asyncio.wait_for(started.wait(), 15)
        await db_pool.execute(
            "UPDATE duetime.jobs SET status = 'cancelled', finished_at = now() WHERE id = $1",
            job.id,
        )
        await wait_for(lambda: _finished("cancelled", "c.quiet") == before + 1, timeout=10)
    assert (await job_row(db_pool, job))["status"] == "cancelled"


# -- snooze -------------------------------------------------------------------------------


async def test_snooze_returns_the_job_to_pending_without_using_an_attempt(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    effects_table: str,
) -> None:
    """``raise Snooze`` and ``ctx.snooze``: pending at the same attempt, run later,
    counted; its ctx.db work rolled back. At the bound the next snooze is a failed
    attempt with a clear error."""
    registry = Registry()

    @registry.task("s.later")
    async def later(ctx: JobContext, payload: dict[str, Any]) -> None:
        await _insert(ctx, "snoozed")
        if payload.get("ctx"):
            ctx.snooze(120)
        raise Snooze(in_=60)

    job = await dispatched_job(db_pool, "s.later", queue=queue)
    other = await dispatched_job(db_pool, "s.later", {"ctx": True}, queue=queue)
    bounded = await dispatched_job(db_pool, "s.later", queue=queue)
    await db_pool.execute(
        "UPDATE duetime.jobs SET snoozes = 2, max_snoozes = 2 WHERE id = $1", bounded.id
    )
    before = _finished("snoozed", "s.later")
    for j in (job, other, bounded):
        await publish(channel, queue, j.message(1))
    async with running_worker(settings, registry, queue):
        for j in (job, other, bounded):
            await wait_for(lambda j=j: _status(db_pool, j, "pending"), timeout=15)
    row = await job_row(db_pool, job)
    assert (row["attempt"], row["snoozes"], row["last_error"]) == (1, 1, None)
    assert 55 < row["run_in"] <= 60
    assert 115 < (await job_row(db_pool, other))["run_in"] <= 120
    assert await effects(db_pool, job, effects_table) == 0
    assert _finished("snoozed", "s.later") == before + 2
    capped = await job_row(db_pool, bounded)
    assert (capped["attempt"], capped["snoozes"]) == (2, 2)
    assert "SnoozeLimitReached" in capped["last_error"]
    assert "max_snoozes" in capped["last_error"]


# -- per-job timeout ----------------------------------------------------------------------


async def test_a_jobs_own_timeout_overrides_the_tasks(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
) -> None:
    registry = Registry()

    @registry.task("t.sleepy", timeout=60)
    async def sleepy(ctx: JobContext, payload: dict[str, Any]) -> None:
        await asyncio.sleep(10)

    job = await dispatched_job(db_pool, "t.sleepy", queue=queue)
    await db_pool.execute("UPDATE duetime.jobs SET timeout_s = 0.3 WHERE id = $1", job.id)
    await publish(channel, queue, job.message(1))
    async with running_worker(settings, registry, queue):
        await wait_for(lambda: _status(db_pool, job, "pending"), timeout=15)
    assert "exceeded its timeout of 0.3s" in (await job_row(db_pool, job))["last_error"]


# -- plain SQL ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("column", "value", "constraint"),
    [
        ("timeout_s", -1.0, "jobs_timeout_s_out_of_range"),
        ("timeout_s", 1e9, "jobs_timeout_s_out_of_range"),
        ("max_snoozes", -1, "jobs_max_snoozes_out_of_range"),
        ("max_snoozes", 10001, "jobs_max_snoozes_out_of_range"),
        ("progress", 1.5, "jobs_progress_out_of_range"),
        ("progress_note", "x" * 201, "jobs_progress_note_too_long"),
        # migration 0023: W3C traceparent, version 00, lower case, ids not all zeros
        ("traceparent", "00-abc-def-01", "jobs_traceparent_invalid"),
        ("traceparent", "00-" + "A" * 32 + "-" + "b" * 16 + "-01", "jobs_traceparent_invalid"),
        ("traceparent", "00-" + "0" * 32 + "-" + "b" * 16 + "-01", "jobs_traceparent_invalid"),
        ("traceparent", "00-" + "a" * 32 + "-" + "0" * 16 + "-01", "jobs_traceparent_invalid"),
        ("traceparent", "01-" + "a" * 32 + "-" + "b" * 16 + "-01", "jobs_traceparent_invalid"),
        ("traceparent", "00-" + "a" * 32 + "-" + "b" * 16 + "-01-x", "jobs_traceparent_invalid"),
        ("tags", ["two words"], "jobs_tags_invalid"),
        ("tags", ["x" * 65], "jobs_tags_invalid"),
        ("tags", [f"t{i}" for i in range(33)], "jobs_tags_invalid"),
        ("tags", ["a", None], "jobs_tags_invalid"),
        ("meta", [1, 2], "jobs_meta_invalid"),
        ("meta", {"big": "x" * 70000}, "jobs_meta_invalid"),
        # migration 0025: workflows (tests/integration/test_workflows.py has the rest)
        ("on_dependency_failure", "maybe", "jobs_on_dependency_failure_invalid"),
        ("workflow_id", 0, "jobs_workflow_id_invalid"),
        ("depends_on", [1, None], "jobs_depends_on_invalid"),
    ],
)
async def test_plain_sql_producers_get_named_checks(
    db_pool: asyncpg.Pool, column: str, value: Any, constraint: str
) -> None:
    with pytest.raises(asyncpg.CheckViolationError) as raised:
        await db_pool.execute(
            f"INSERT INTO duetime.jobs (task, {column}) VALUES ('t.checked', $1)", value
        )
    assert raised.value.constraint_name == constraint


async def test_plain_sql_sets_timeout_and_snooze_bound(db_pool: asyncpg.Pool) -> None:
    row = await db_pool.fetchrow(
        "INSERT INTO duetime.jobs (task, queue, due_at, timeout_s, max_snoozes) "
        "VALUES ('t.plain', 'plain-sql-jc', now() + interval '1 day', 12.5, 3) "
        "RETURNING timeout_s, max_snoozes, snoozes, result, cancelled_by"
    )
    assert dict(row) == {
        "timeout_s": 12.5,
        "max_snoozes": 3,
        "snoozes": 0,
        "result": None,
        "cancelled_by": None,
    }


# -- progress -----------------------------------------------------------------------------


async def test_progress_is_on_the_row_while_running_and_stays_when_the_handler_fails(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    effects_table: str,
) -> None:
    """Reports are visible while the handler runs (they are not in its transaction),
    throttled (a tight loop of reports lands its last value), and survive a failure
    that rolls the handler's own writes back."""
    registry = Registry()
    reported = asyncio.Event()
    go_on = asyncio.Event()

    @registry.task("p.copy")
    async def copy(ctx: JobContext, payload: dict[str, Any]) -> None:
        await _insert(ctx, "copy")
        for i in range(1, 51):
            await ctx.progress(i / 100, f"copied {i} of 100 files")
        reported.set()
        await go_on.wait()
        raise RuntimeError("disk full")

    job = await dispatched_job(db_pool, "p.copy", queue=queue)
    await publish(channel, queue, job.message(1))
    async with running_worker(settings, registry, queue):
        await asyncio.wait_for(reported.wait(), 15)

        async def last_report_landed() -> bool:
            return (await job_row(db_pool, job))["progress_note"] == "copied 50 of 100 files"

        await wait_for(last_report_landed, timeout=5)
        row = await job_row(db_pool, job)
        assert (row["status"], row["progress"]) == ("dispatched", pytest.approx(0.5))
        go_on.set()
        await wait_for(lambda: _status(db_pool, job, "pending"), timeout=15)
    row = await job_row(db_pool, job)
    assert (row["progress"], row["progress_note"]) == (pytest.approx(0.5), "copied 50 of 100 files")
    assert row["progress_at"] is not None and "disk full" in row["last_error"]
    assert await effects(db_pool, job, effects_table) == 0


# -- plain def handlers -------------------------------------------------------------------


async def test_a_plain_def_handler_returns_results_reports_progress_and_sees_a_cancel(
    settings: Settings,
    db_pool: asyncpg.Pool,
    channel: AbstractChannel,
    queue: str,
    effects_table: str,
) -> None:
    """Job control from a handler thread: what a ``def`` returns is stored, its progress
    is on the row, and a cancel sets ``ctx.cancelled`` so its loop can stop; its
    ``ctx.db`` write is rolled back."""
    import threading
    import time

    registry = Registry()
    started = threading.Event()

    @registry.task("s.sum")
    def sum_it(ctx: Any, payload: dict[str, Any]) -> Any:
        ctx.progress(0.5, "half way")
        return {"total": sum(payload["values"])}

    @registry.task("s.loop")
    def loop_until_cancelled(ctx: Any, payload: dict[str, Any]) -> None:
        ctx.db.execute(
            f"INSERT INTO {EFFECTS_TABLE} (job_id, attempt, tag) VALUES ($1, $2, $3)",
            ctx.job_id, ctx.attempt, "sync-before-cancel",
        )  # fmt: skip
        started.set()
        deadline = time.monotonic() + 30
        while not ctx.cancelled.is_set() and time.monotonic() < deadline:
            time.sleep(0.02)  # a thread, not the loop

    summed = await dispatched_job(db_pool, "s.sum", {"values": [1, 2, 3]}, queue=queue)
    looping = await dispatched_job(db_pool, "s.loop", queue=queue)
    store = JobStore(db_pool)
    await publish(channel, queue, summed.message(1))
    await publish(channel, queue, looping.message(1))
    async with running_worker(settings, registry, queue):
        await wait_for(lambda: _status(db_pool, summed, "succeeded"), timeout=15)
        await asyncio.wait_for(asyncio.to_thread(started.wait, 15), 20)
        await store.cancel(looping.id, by="bob")
        await wait_for(lambda: _status(db_pool, looping, "cancelled"), timeout=5)
    row = await job_row(db_pool, summed)
    assert row["result"] == {"total": 6}
    assert (row["progress"], row["progress_note"]) == (0.5, "half way")
    cancelled = await job_row(db_pool, looping)
    assert (cancelled["status"], cancelled["cancelled_by"]) == ("cancelled", "bob")
    assert await effects(db_pool, looping, effects_table) == 0
