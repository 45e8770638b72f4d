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

from datetime import datetime
from typing import Any

import asyncpg

from scheduler.sql import compose, load
from scheduler.store.job_filter import FILTERS, JobFilter, planned_for
from scheduler.store.jobs import MAX_PAGE
from scheduler.store.rows import (
    DbSnapshot,
    Job,
    JobDetail,
    JobPage,
    LedgerRow,
    MinuteSample,
    OverviewData,
    WorkerSeen,
    from_record,
)
from scheduler.store.status import StatusStore

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
#: state -> (its index's key expression, ascending?, the Job field the cursor carries);
#: every other state pages by id, newest first (``jobs_page``)
PAGE_BY_STATE: dict[str, tuple[str, bool, str]] = {
    "pending": ("coalesce(run_at, due_at)", True, "next_run_at"),
    "dead": ("finished_at", False, "finished_at"),
    "dispatched": ("coalesce(heartbeat_at, dispatched_at)", True, "last_sign_of_life"),
}
#: The page statements: one per state of PAGE_BY_STATE (planned on that state's index),
#: and ``jobs_page`` (None) for the others.
#: Each with and without a tag filter (``FILTERS``), keyed (state, tagged).
PAGES: dict[tuple[str | None, bool], str] = {
    (state, tagged): compose(
        "dashboard",
        "state_page",
        status=state,
        filter=FILTERS[tagged],
        key=key,
        after=">" if ascending else "<",
        order="ASC" if ascending else "DESC",
    )
    for state, (key, ascending, _) in PAGE_BY_STATE.items()
    for tagged in (False, True)
}
for _tagged in (False, True):
    PAGES[None, _tagged] = compose("dashboard", "jobs_page", filter=FILTERS[_tagged], order_id="id")
#: A tag filter matching at most this many jobs is paged from the tag index, sorted
#: (``FEW_PAGES``); a more common one walks the state's index, which finds a page soon.
FEW_MATCHES = 20_000
#: The tagged pages ordered by an expression no index provides (``key + 0``), so the
#: planner reads the tag index and sorts its few matches: walking an index in page
#: order read every partition without the tag to its end (6.2 s at 10M jobs, a tag in
#: a few days' partitions; docs/benchmarks.md "Tag filter").
FEW_PAGES: dict[str | None, str] = {
    state: compose(
        "dashboard",
        "state_page",
        status=state,
        filter=FILTERS[True],
        key=f"({key} + interval '0 s')",
        after=">" if ascending else "<",
        order="ASC" if ascending else "DESC",
    )
    for state, (key, ascending, _) in PAGE_BY_STATE.items()
}
FEW_PAGES[None] = compose("dashboard", "jobs_page", filter=FILTERS[True], order_id="(id + 0)")


class DashboardStore:
    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def status_snapshot(self) -> tuple[DbSnapshot, bool]:
        """``duetime status``'s snapshot, and whether pending jobs were left uncounted
        (more than ``PENDING_EXACT_LIMIT``: every queue then reads 0 pending)."""
        async with self._pool.acquire() as c:
            probed = await c.fetchval(Q["pending_probe"], PENDING_EXACT_LIMIT)
        capped = probed >= PENDING_EXACT_LIMIT
        snapshot = await StatusStore(self._pool).snapshot(
            dead_window=DEAD_WINDOW, pending=not capped
        )
        return snapshot, capped

    async def overview(self) -> OverviewData:
        snapshot, capped = await self.status_snapshot()
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
        state = PAGE_BY_STATE.get(where.status or "")
        key = state[2] if state else None
        at, after_id = _parse_cursor(cursor, keyed=key is not None)
        async with self._pool.acquire() as c:
            # Counted before the custom plans: its generic plan (a LIMIT over the tag
            # index of every bucket) is right for any tags, and planning it per tag set
            # cost ~20 ms at 10M jobs (docs/benchmarks.md, "Tags at 10M").
            tagged = bool(where.tags)
            few = tagged and (
                await c.fetchval(Q["tag_matches"], list(where.tags), FEW_MATCHES + 1) <= FEW_MATCHES
            )
            async with planned_for(c, where):
                records = await c.fetch(*self._page_statement(where, few, key, at, after_id, limit))
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

    @staticmethod
    def _page_statement(
        where: JobFilter,
        few: bool,
        key: str | None,
        at: datetime | None,
        after_id: int | None,
        limit: int,
    ) -> tuple[Any, ...]:
        """The page statement for ``where`` and its arguments."""
        tagged = bool(where.tags)
        if key is None:
            statement = FEW_PAGES[None] if few else PAGES[None, tagged]
            return (statement, *where.params(), where.status, after_id, limit)
        statement = FEW_PAGES[where.status] if few else PAGES[where.status, tagged]
        return (statement, *where.params(), at, after_id, limit)

    async def job_detail(self, job: Job) -> JobDetail:
        """What the job page shows beside the row itself."""
        async with self._pool.acquire() as c:
            ledger = await c.fetchrow(Q["ledger_row"], job.effective_key)
            name = None
            if job.schedule_id is not None:
                name = await c.fetchval(Q["schedule_name"], job.schedule_id)
        return JobDetail(job, from_record(LedgerRow, ledger) if ledger else None, name)


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
