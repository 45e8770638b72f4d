"""ExecutionStore: every statement a worker runs (DESIGN §6; SQL in ``execution.sql``).

The worker owns its transactions (one per delivery: lock-read, ledger row, handler
work through ``ctx.db``, outcome), so the methods that belong to that transaction take
the caller's connection; only ``heartbeat`` runs on its own pooled connection, in
autocommit, so a sign of life is visible while the handler's transaction is still open.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import asyncpg

from scheduler.db import Conn
from scheduler.sql import load

Q = load("execution")


@dataclass(frozen=True, slots=True)
class LockedJob:
    """The job row as the delivery's transaction saw it (locked FOR KEY SHARE)."""

    status: str
    attempt: int
    max_attempts: int
    queue: str
    idempotency_key: str | None
    run_time: datetime  # coalesce(run_at, due_at): when this attempt was meant to run


@dataclass(frozen=True, slots=True)
class Delivery:
    """What a delivery's first statement found: the locked row, and whether this
    delivery inserted the ledger row (``claimed_key``, None if not)."""

    job: LockedJob
    claimed_key: str | None


def _locked(record: asyncpg.Record) -> LockedJob:
    return LockedJob(
        status=record["status"],
        attempt=record["attempt"],
        max_attempts=record["max_attempts"],
        queue=record["queue"],
        idempotency_key=record["idempotency_key"],
        run_time=record["run_time"],
    )


class ExecutionStore:
    def __init__(self, pool: asyncpg.Pool, *, timeout: float = 10.0) -> None:
        self._pool = pool
        self._timeout = timeout

    async def lock_job(self, conn: Conn, job_id: int, due_at: datetime) -> LockedJob | None:
        """Read the job FOR KEY SHARE (waits for an in-flight claim); None if missing."""
        record = await conn.fetchrow(Q["lock_job"], job_id, due_at)
        return None if record is None else _locked(record)

    async def begin_delivery(
        self,
        conn: Conn,
        *,
        job_id: int,
        due_at: datetime,
        attempt: int,
        default_key: str,
        task: str,
        worker: str,
    ) -> Delivery | None:
        """``lock_job`` and, when the row is this attempt and still dispatched, the
        ledger row under the row's key (else ``default_key``), in one round trip.
        None if the job does not exist."""
        record = await conn.fetchrow(
            Q["begin_delivery"], job_id, due_at, attempt, default_key, task, worker
        )
        if record is None:
            return None
        return Delivery(_locked(record), record["claimed_key"])

    async def mark_succeeded(self, conn: Conn, job_id: int, due_at: datetime, attempt: int) -> bool:
        """dispatched → succeeded for this attempt; False if the row moved on meanwhile."""
        return await conn.fetchval(Q["mark_succeeded"], job_id, due_at, attempt) == 1

    async def schedule_retry(
        self,
        conn: Conn,
        job_id: int,
        due_at: datetime,
        attempt: int,
        *,
        delay: float,
        error: str,
    ) -> datetime | None:
        """dispatched → pending with attempt + 1, runnable after ``delay`` seconds.
        Returns the new run time, or None if the row is no longer this attempt's.

        No NOTIFY: the dispatcher's probe finds the new run time ahead of it, and a
        NOTIFY here would serialise worker commits on PostgreSQL's notify lock exactly
        when a failure storm retries thousands of jobs (migrations/0004_wakeups.sql)."""
        run_at = await conn.fetchval(
            Q["schedule_retry"], job_id, due_at, attempt, float(delay), error
        )
        return run_at  # type: ignore[no-any-return, unused-ignore]

    async def mark_dead(
        self, conn: Conn, job_id: int, due_at: datetime, attempt: int, error: str
    ) -> bool:
        """dispatched → dead with ``error``; False if the row moved on meanwhile."""
        return await conn.fetchval(Q["mark_dead"], job_id, due_at, attempt, error) == 1

    async def heartbeat(self, job_id: int, due_at: datetime, attempt: int) -> bool:
        """Set heartbeat_at = now() on a connection of its own (autocommit). False when
        the job is no longer this attempt's (finished elsewhere or superseded)."""
        async with self._pool.acquire(timeout=self._timeout) as conn:
            value = await conn.fetchval(
                Q["heartbeat"], job_id, due_at, attempt, timeout=self._timeout
            )
        return value == 1
