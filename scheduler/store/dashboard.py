"""DashboardStore: the read models behind ``duetime dashboard`` (statements in
``sql/dashboard.sql``). Actions go through ``JobStore`` and ``ScheduleStore``, the same
transitions as the CLI; per-queue backlog and the fence come from ``StatusStore``.

Terminal counts are exact while the table is small (fewer than ``EXACT_COUNT_LIMIT``
rows: one GROUP BY, ~20 ms at that size) and estimated from planner statistics above
(catalog reads, flat at 10M rows): counting 10M succeeded rows exactly takes seconds,
and an operator at 3 a.m. needs the live states exact, which they are (partial
indexes), not the archive.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncpg

from scheduler.rows import Job
from scheduler.sql import load
from scheduler.status import DbSnapshot, StatusStore
from scheduler.store.jobs import MAX_PAGE, JobFilter

__all__ = ["DashboardStore", "JobDetail", "LedgerRow", "OverviewData", "WorkerSeen"]

Q = load("dashboard")

EXACT_COUNT_LIMIT = 200_000
DEAD_WINDOW = 3600.0
LATEST_DEAD = 5
WORKER_WINDOW = 300.0
LAG_MINUTES = 60
LAG_PER_MINUTE = 40


@dataclass(frozen=True, slots=True)
class WorkerSeen:
    worker: str
    completed: int
    last_seen: datetime
    age: float


@dataclass(frozen=True, slots=True)
class LedgerRow:
    idempotency_key: str
    job_id: int
    attempt: int
    task: str
    worker: str | None
    completed_at: datetime


@dataclass(frozen=True, slots=True)
class OverviewData:
    snapshot: DbSnapshot
    #: (queue, status) -> count for terminal states when exact; else queue is "*"
    terminal: dict[tuple[str, str], int]
    terminal_exact: bool
    oldest_overdue: Job | None
    oldest_late: float | None
    latest_dead: list[Job]
    #: minutes_ago -> completions in that minute
    throughput: dict[int, int]
    #: (minutes_ago, lag seconds) samples
    lag_samples: list[tuple[int, float]]
    workers: list[WorkerSeen] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class JobDetail:
    job: Job
    ledger: LedgerRow | None
    schedule_name: str | None


class DashboardStore:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def overview(self) -> OverviewData:
        snapshot = await StatusStore(self._pool).snapshot(dead_window=DEAD_WINDOW)
        async with self._pool.acquire() as c:
            rows = await c.fetchval(Q["table_probe"], EXACT_COUNT_LIMIT)
            exact = rows < EXACT_COUNT_LIMIT
            terminal: dict[tuple[str, str], int] = {}
            if exact:
                for r in await c.fetch(Q["terminal_counts"]):
                    terminal[(r["queue"], r["status"])] = r["n"]
            else:
                for r in await c.fetch(Q["terminal_estimates"]):
                    terminal[("*", r["status"])] = r["n"]
            oldest = await c.fetchrow(Q["oldest_overdue"])
            dead = await c.fetch(Q["latest_dead"], DEAD_WINDOW, LATEST_DEAD)
            throughput = {r["minutes_ago"]: r["n"] for r in await c.fetch(Q["throughput"], 60)}
            lags = [
                (r["minutes_ago"], r["lag"])
                for r in await c.fetch(Q["lag_sample"], LAG_MINUTES, LAG_PER_MINUTE)
            ]
            workers = [
                WorkerSeen(r["worker"], r["completed"], r["last_seen"], r["age"])
                for r in await c.fetch(Q["workers"], WORKER_WINDOW)
            ]
        return OverviewData(
            snapshot=snapshot,
            terminal=terminal,
            terminal_exact=exact,
            oldest_overdue=Job.from_record(oldest) if oldest else None,
            oldest_late=oldest["late"] if oldest else None,
            latest_dead=[Job.from_record(r) for r in dead],
            throughput=throughput,
            lag_samples=lags,
            workers=workers,
        )

    async def jobs_page(
        self, where: JobFilter, *, before_id: int | None = None, limit: int = 50
    ) -> list[Job]:
        """One page of jobs matching ``where``, newest first; pass the last id shown as
        ``before_id`` for the next page."""
        if not 1 <= limit <= MAX_PAGE:
            raise ValueError(f"limit must be between 1 and {MAX_PAGE}")
        async with self._pool.acquire() as c:
            records = await c.fetch(
                Q["jobs_page"], where.status, *where.params(), before_id, limit
            )
        return [Job.from_record(r) for r in records]

    async def job_detail(self, job: Job) -> JobDetail:
        """What the job page shows beside the row itself."""
        async with self._pool.acquire() as c:
            ledger = await c.fetchrow(Q["ledger_row"], job.effective_key)
            name = None
            if job.schedule_id is not None:
                name = await c.fetchval(Q["schedule_name"], job.schedule_id)
        return JobDetail(job, LedgerRow(**_mapping(ledger)) if ledger else None, name)


def _mapping(record: Any) -> dict[str, Any]:
    return {k: record[k] for k in record.keys()}
