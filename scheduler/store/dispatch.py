"""DispatchStore: every statement the dispatcher and the reconciler run, plus the
LISTEN connection that wakes the dispatcher (statements in ``sql/dispatch.sql``).

Methods that must run inside the caller's fenced transaction take ``conn``; the others
use the pool. Statements go through asyncpg's per-connection statement cache, so the
claim is planned once per connection (planning costs more than executing it, DESIGN §5).

A row the client cannot read (``UNREADABLE``: a date outside Python's years 1-9999 from
before migration 0006's bounds, JSON nested deeper than Python's parser goes) fails the
whole ``claim`` that returns it; ``claim_isolated`` then reads the same locked rows one
at a time, so the caller can park the bad ones and dispatch the rest.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TypeAlias

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from scheduler.config import DEFAULT_DB_TIMEOUT
from scheduler.db import checked_acquire_timeout
from scheduler.log import get_logger
from scheduler.rows import UNREADABLE, ClaimedJob
from scheduler.sql import load

Q = load("dispatch")


@functools.cache
def claim_sql(limit: int, query: str = "claim") -> str:
    """The claim with ``limit`` as a literal (why: the comment on ``claim`` in
    dispatch.sql); one text per batch size, so asyncpg prepares it once per connection."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"claim limit must be a positive integer (got {limit!r})")
    return Q[query].replace("{limit}", str(limit))


log = get_logger(__name__)

#: A connection of its own or one borrowed from a pool.
Conn: TypeAlias = asyncpg.Connection | PoolConnectionProxy

#: Channel the insert trigger, the retry paths and the client API notify (migration 0001).
NOTIFY_CHANNEL = "duetime_jobs"


@dataclass(frozen=True, slots=True)
class StalledJob:
    """A dispatched job with no sign of life past the visibility timeout."""

    job: ClaimedJob
    silent_for: float  # seconds since dispatched_at / heartbeat_at
    dispatch_epoch: int | None
    republish_count: int = 0  # re-publishes since it was dispatched


@dataclass(frozen=True, slots=True)
class UnreadableRow:
    """A claimed row the client could not decode, and why."""

    job_id: int
    error: str


def _stalled(record: asyncpg.Record) -> StalledJob:
    return StalledJob(
        ClaimedJob.from_record(record),
        record["silent_for"],
        record["dispatch_epoch"],
        record["republish_count"],
    )


def _key_arrays(jobs: Sequence[ClaimedJob]) -> tuple[list[int], datetime, datetime]:
    """Arguments identifying ``jobs``: ids, and the due_at range for partition pruning."""
    dues = [job.due_at for job in jobs]
    return [job.id for job in jobs], min(dues), max(dues)


class DispatchStore:
    def __init__(
        self, pool: asyncpg.Pool, *, acquire_timeout: float = DEFAULT_DB_TIMEOUT
    ) -> None:
        """``acquire_timeout``: see ``scheduler.db.checked_acquire_timeout``."""
        self._pool = pool
        self._acquire_timeout = checked_acquire_timeout(acquire_timeout)

    # -- dispatcher (inside its fenced transaction) ----------------------------------

    async def claim(self, conn: Conn, limit: int) -> list[ClaimedJob]:
        """Lock up to ``limit`` due pending jobs, earliest run time first."""
        records = await conn.fetch(claim_sql(limit))
        return [ClaimedJob.from_record(r) for r in records]

    async def claim_isolated(
        self, conn: Conn, limit: int
    ) -> tuple[list[ClaimedJob], list[UnreadableRow]]:
        """``claim`` one row at a time, for when ``claim`` raised ``UNREADABLE``: the jobs
        that could be read, and the rows that could not (still locked, for ``park``)."""
        jobs: list[ClaimedJob] = []
        unreadable: list[UnreadableRow] = []
        for job_id in [r["id"] for r in await conn.fetch(claim_sql(limit, "claim_ids"))]:
            try:
                record = await conn.fetchrow(Q["claimed_row"], job_id)
            except UNREADABLE as exc:
                unreadable.append(UnreadableRow(job_id, f"{type(exc).__name__}: {exc}"))
                continue
            if record is not None:
                jobs.append(ClaimedJob.from_record(record))
        return jobs, unreadable

    async def park(self, conn: Conn, job_id: int, reason: str) -> bool:
        """pending or dispatched → dead with ``reason`` as last_error, by id alone (the
        caller holds the row's lock)."""
        return await conn.execute(Q["park"], job_id, reason) == "UPDATE 1"

    async def mark_dispatched(
        self, conn: Conn, jobs: Sequence[ClaimedJob], epoch: int
    ) -> dict[int, float]:
        """pending → dispatched for ``jobs`` (all confirmed); returns {job id: lag seconds}."""
        if not jobs:
            return {}
        ids, lo, hi = _key_arrays(jobs)
        records = await conn.fetch(Q["mark_dispatched"], ids, lo, hi, epoch)
        return {r["id"]: r["lag"] for r in records}

    # -- dispatcher (pool) -----------------------------------------------------------

    async def next_run_in(self) -> float | None:
        """Seconds until the earliest pending run time (≤ 0: due now; None: nothing)."""
        async with self._pool.acquire(timeout=self._acquire_timeout) as conn:
            value = await conn.fetchval(Q["next_run_in"])
        return None if value is None else float(value)

    async def backlog(self) -> int:
        """Pending jobs whose run time has passed."""
        async with self._pool.acquire(timeout=self._acquire_timeout) as conn:
            return int(await conn.fetchval(Q["backlog"]))

    # -- reconciler (inside its fenced transaction) ----------------------------------

    async def lock_stalled(
        self,
        conn: Conn,
        visibility_timeout: float,
        limit: int,
        *,
        skip_queues: Sequence[str] = (),
    ) -> list[StalledJob]:
        """Lock up to ``limit`` stalled jobs, longest silent first."""
        records = await conn.fetch(
            Q["lock_stalled"], float(visibility_timeout), limit, list(skip_queues)
        )
        return [_stalled(r) for r in records]

    async def lock_stalled_isolated(
        self,
        conn: Conn,
        visibility_timeout: float,
        limit: int,
        *,
        skip_queues: Sequence[str] = (),
    ) -> tuple[list[StalledJob], list[UnreadableRow]]:
        """``lock_stalled`` one row at a time, for when it raised ``UNREADABLE``."""
        stalled: list[StalledJob] = []
        unreadable: list[UnreadableRow] = []
        ids = await conn.fetch(
            Q["lock_stalled_ids"], float(visibility_timeout), limit, list(skip_queues)
        )
        for job_id in [r["id"] for r in ids]:
            try:
                record = await conn.fetchrow(Q["stalled_row"], job_id)
            except UNREADABLE as exc:
                unreadable.append(UnreadableRow(job_id, f"{type(exc).__name__}: {exc}"))
                continue
            if record is not None:
                stalled.append(_stalled(record))
        return stalled, unreadable

    async def mark_redispatched(
        self, conn: Conn, jobs: Sequence[ClaimedJob], epoch: int
    ) -> set[int]:
        """Start a new visibility window for re-published ``jobs``; returns their ids."""
        if not jobs:
            return set()
        ids, lo, hi = _key_arrays(jobs)
        records = await conn.fetch(Q["mark_redispatched"], ids, lo, hi, epoch)
        return {r["id"] for r in records}

    async def give_up(self, conn: Conn, jobs: Sequence[ClaimedJob], error: str) -> set[int]:
        """dispatched → dead for ``jobs`` (re-published too often); returns their ids."""
        if not jobs:
            return set()
        ids, lo, hi = _key_arrays(jobs)
        records = await conn.fetch(Q["give_up"], ids, lo, hi, error)
        return {r["id"] for r in records}
