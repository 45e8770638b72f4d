"""DashboardStore: the read models behind ``duetime dashboard`` (statements in
``sql/dashboard.sql``). Actions go through ``JobStore`` and ``ScheduleStore``, the same
transitions as the CLI; per-queue backlog and the fence come from ``StatusStore``.

Pending jobs are counted exactly per queue up to ``PENDING_EXACT_LIMIT`` (a bounded
probe decides); a larger backlog reads "at least 50,000" with no per-queue split, since
an exact count costs ~0.75 µs per pending row. Terminal counts are exact while the
table is small (heap under ``EXACT_COUNT_BYTES``:
one GROUP BY of ~50k rows) and estimated from planner statistics above (catalog reads,
flat at 10M rows): counting 10M succeeded rows exactly takes seconds, and an operator
at 3 a.m. needs the live states exact, which they are (partial indexes), not the
archive. Throughput and lag come from a bounded sample of the ledger per minute
(``MINUTE_SAMPLE`` completions, the lag of ``LAG_SAMPLE`` of them).

The job list pages by the index of the state asked for (pending: soonest runnable
first; dead: most recently dead first; dispatched: longest silent first; otherwise
newest id first), with an opaque keyset cursor ``"<id>"`` or ``"<timestamp>|<id>"``.
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

__all__ = [
    "DashboardStore",
    "JobDetail",
    "JobPage",
    "LedgerRow",
    "MinuteSample",
    "OverviewData",
    "WorkerSeen",
]

Q = load("dashboard")

EXACT_COUNT_BYTES = 16 * 1024 * 1024
PENDING_EXACT_LIMIT = 50_000
DEAD_WINDOW = 3600.0
LATEST_DEAD = 5
WORKER_WINDOW = 300.0
SAMPLE_MINUTES = 60
MINUTE_SAMPLE = 200
LAG_SAMPLE = 25
#: state -> (statement, the column that orders it); None: by id
PAGE_BY_STATE: dict[str | None, tuple[str, str | None]] = {
    "pending": ("pending_page", "next_run_at"),
    "dead": ("dead_page", "finished_at"),
    "dispatched": ("dispatched_page", "last_sign_of_life"),
}


@dataclass(frozen=True, slots=True)
class MinuteSample:
    """Up to ``MINUTE_SAMPLE`` of one minute's latest completions."""

    minutes_ago: int
    sampled: int
    span: float  # seconds between the oldest and newest sampled completion
    lags: list[float]


@dataclass(frozen=True, slots=True)
class JobPage:
    jobs: list[Job]
    next_cursor: str | None


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
    #: None: pending counts in ``snapshot`` are exact; else at least this many pending
    pending_at_least: int | None
    #: (queue, status) -> count for terminal states when exact; else queue is "*"
    terminal: dict[tuple[str, str], int]
    terminal_exact: bool
    oldest_overdue: Job | None
    oldest_late: float | None
    latest_dead: list[Job]
    minutes: list[MinuteSample]
    workers: list[WorkerSeen] = field(default_factory=list)

    @property
    def lag_samples(self) -> list[tuple[int, float]]:
        return [(m.minutes_ago, lag) for m in self.minutes for lag in m.lags]


@dataclass(frozen=True, slots=True)
class JobDetail:
    job: Job
    ledger: LedgerRow | None
    schedule_name: str | None


class DashboardStore:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def overview(self) -> OverviewData:
        async with self._pool.acquire() as c:
            probed = await c.fetchval(Q["pending_probe"], PENDING_EXACT_LIMIT)
        capped = probed >= PENDING_EXACT_LIMIT
        snapshot = await StatusStore(self._pool).snapshot(
            dead_window=DEAD_WINDOW, pending=not capped
        )
        async with self._pool.acquire() as c:
            exact = await c.fetchval(Q["table_bytes"]) < EXACT_COUNT_BYTES
            terminal: dict[tuple[str, str], int] = {}
            if exact:
                for r in await c.fetch(Q["terminal_counts"]):
                    terminal[(r["queue"], r["status"])] = r["n"]
            else:
                for r in await c.fetch(Q["terminal_estimates"]):
                    terminal[("*", r["status"])] = r["n"]
            oldest = await c.fetchrow(Q["oldest_overdue"])
            dead = await c.fetch(Q["latest_dead"], DEAD_WINDOW, LATEST_DEAD)
            minutes = [
                MinuteSample(r["minutes_ago"], r["sampled"], r["span"] or 0.0, list(r["lags"]))
                for r in await c.fetch(
                    Q["minute_samples"], SAMPLE_MINUTES, MINUTE_SAMPLE, LAG_SAMPLE
                )
            ]
            workers = [
                WorkerSeen(r["worker"], r["completed"], r["last_seen"], r["age"])
                for r in await c.fetch(Q["workers"], WORKER_WINDOW)
            ]
        return OverviewData(
            snapshot=snapshot,
            pending_at_least=PENDING_EXACT_LIMIT if capped else None,
            terminal=terminal,
            terminal_exact=exact,
            oldest_overdue=Job.from_record(oldest) if oldest else None,
            oldest_late=oldest["late"] if oldest else None,
            latest_dead=[Job.from_record(r) for r in dead],
            minutes=minutes,
            workers=workers,
        )

    async def jobs_page(
        self, where: JobFilter, *, cursor: str | None = None, limit: int = 50
    ) -> JobPage:
        """One page of jobs matching ``where``, in the order of the state's index; pass
        ``next_cursor`` back as ``cursor`` for the next page. A cursor that does not
        parse starts from the beginning."""
        if not 1 <= limit <= MAX_PAGE:
            raise ValueError(f"limit must be between 1 and {MAX_PAGE}")
        statement, key = PAGE_BY_STATE.get(where.status, ("jobs_page", None))
        at, after_id = _parse_cursor(cursor, keyed=key is not None)
        async with self._pool.acquire() as c:
            if key is None:
                args = (where.status, *where.params(), after_id, limit)
            else:
                args = (*where.params(), at, after_id, limit)
            records = await c.fetch(Q[statement], *args)
        jobs = [Job.from_record(r) for r in records]
        if len(jobs) < limit:
            return JobPage(jobs, None)
        last = jobs[-1]
        if key is None:
            return JobPage(jobs, str(last.id))
        value = {
            "next_run_at": last.next_run_at,
            "finished_at": last.finished_at,
            "last_sign_of_life": last.heartbeat_at or last.dispatched_at,
        }[key]
        return JobPage(jobs, f"{value.isoformat() if value else ''}|{last.id}")

    async def job_detail(self, job: Job) -> JobDetail:
        """What the job page shows beside the row itself."""
        async with self._pool.acquire() as c:
            ledger = await c.fetchrow(Q["ledger_row"], job.effective_key)
            name = None
            if job.schedule_id is not None:
                name = await c.fetchval(Q["schedule_name"], job.schedule_id)
        return JobDetail(job, LedgerRow(**_mapping(ledger)) if ledger else None, name)


def _parse_cursor(cursor: str | None, *, keyed: bool) -> tuple[datetime | None, int | None]:
    if not cursor:
        return None, None
    stamp, _, ident = cursor.rpartition("|")
    if not ident.isdigit() or int(ident) >= 2**63:
        return None, None
    if not keyed:
        return None, int(ident)
    try:
        return datetime.fromisoformat(stamp), int(ident)
    except ValueError:
        return None, None


def _mapping(record: Any) -> dict[str, Any]:
    return {k: record[k] for k in record.keys()}
