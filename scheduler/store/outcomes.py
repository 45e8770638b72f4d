"""Waiting for a job's outcome (``JobStore.result``; DESIGN §12, migration 0019).

The waiter LISTENs on ``duetime_job_finished`` first, then registers its job id in
``duetime.result_waiters`` (``duetime.await_job``, which also waits for a settlement of
the row already in flight), then reads the row: a job that finished before the
registration is seen by that read, one that finishes after it NOTIFYs (the trigger
``jobs_notify_finished`` sends one only for jobs somebody waits for). Each NOTIFY for
the job wakes the waiter, which reads the row again, so a notification is a hint and
the row is the answer. No polling: a waiter costs one pooled connection while it waits.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import asyncpg

from scheduler.errors import JobCancelled, JobFailed, JobNotFound
from scheduler.sql import load
from scheduler.store.conn import Pooled
from scheduler.store.rows import TERMINAL_STATUSES, Job

__all__ = ["FINISHED_CHANNEL", "outcome", "wait_for_outcome"]

Q = load("jobs")
FINISHED_CHANNEL = "duetime_job_finished"


def outcome(job: Job) -> Any:
    """A finished job's answer: its result when it succeeded (None when it returned
    nothing), ``JobFailed`` when it is dead, ``JobCancelled`` when cancelled."""
    if job.status == "dead":
        raise JobFailed(job.id, job.last_error)
    if job.status == "cancelled":
        raise JobCancelled(job.id, job.cancelled_by)
    return job.result


async def wait_for_outcome(db: Pooled, job_id: int, timeout: float | None) -> Any:
    """The outcome of ``job_id`` once it finished (``outcome``); ``TimeoutError`` when it
    has not within ``timeout`` seconds (None: wait as long as it takes)."""
    heard = asyncio.Event()
    wanted = str(job_id)

    def notified(_conn: Any, _pid: int, _channel: str, payload: object) -> None:
        if payload == wanted:
            heard.set()

    job: Job | None = None
    async with db.acquire() as conn:
        await conn.add_listener(FINISHED_CHANNEL, notified)
        try:
            await conn.execute(Q["await_job"], job_id)
            try:
                async with asyncio.timeout(timeout):
                    while True:
                        heard.clear()
                        record = await conn.fetchrow(Q["get"], job_id)
                        if record is None:
                            raise JobNotFound(job_id)
                        job = Job.from_record(record)
                        if job.status in TERMINAL_STATUSES:
                            return outcome(job)
                        await heard.wait()
            except TimeoutError:
                status = job.status if job is not None else "unknown"
                raise TimeoutError(
                    f"job {job_id} did not finish within {timeout:g}s (it is {status})"
                ) from None
        finally:
            await _unregister(conn, job_id, notified, db.timeout)


async def _unregister(conn: Any, job_id: int, listener: Any, timeout: float) -> None:
    """Remove the waiter's row and its LISTEN; a connection that cannot is dropped (the
    row left behind only costs a NOTIFY nobody hears, and is pruned after a day)."""
    try:
        async with asyncio.timeout(timeout):
            await conn.execute(Q["unawait_job"], job_id)
            await conn.remove_listener(FINISHED_CHANNEL, listener)
    except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError):
        with contextlib.suppress(Exception):
            conn.terminate()
