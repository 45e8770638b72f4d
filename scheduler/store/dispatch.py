"""DispatchStore: every statement the dispatcher and the reconciler run (statements in
``sql/dispatch.sql``; the LISTEN connection that wakes the dispatcher is
``scheduler.store.listener``).

Methods that must run inside the caller's fenced transaction take ``conn``; the others
use the pool. Statements go through asyncpg's per-connection statement cache, so the
claim is planned once per connection (planning costs more than executing it, DESIGN §5).

A row the client cannot read (``UNREADABLE``: a date outside Python's years 1-9999 from
before migration 0006's bounds, JSON nested deeper than Python's parser goes) fails the
whole ``claim`` that returns it; ``claim_isolated`` then reads the same locked rows one
at a time, so the caller can park the bad ones (``park_unreadable``) and dispatch the
rest.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from datetime import datetime
from typing import TypeVar

import asyncpg

from scheduler.jobspec import validate_queue
from scheduler.log import get_logger
from scheduler.sql import compose, fragment, load
from scheduler.store.conn import Conn, PooledStore, local_setting
from scheduler.store.rows import (
    UNREADABLE,
    ClaimedJob,
    HeldQueues,
    ParkedRow,
    StalledJob,
    UnreadableRow,
)

Q = load("dispatch")
T = TypeVar("T")


CLAIMED = fragment("dispatch", "claimed_columns")
STALLED = fragment("dispatch", "stalled_columns")
STAGEABLE = fragment("dispatch", "stageable")
CLAIMED_ROW = compose("dispatch", "claimed_row", columns=CLAIMED)
LOCK_STALLED = compose("dispatch", "lock_stalled", columns=STALLED)
LOCK_STALLED_IDS = compose("dispatch", "lock_stalled", columns="id")
STALLED_ROW = compose("dispatch", "stalled_row", columns=STALLED)


#: Default ``priority_max_wait`` (seconds), as in ``Settings``.
DEFAULT_MAX_WAIT = 300.0


@functools.cache
def claim_sql(
    limit: int,
    columns: str = CLAIMED,
    *,
    max_wait: float = DEFAULT_MAX_WAIT,
    held: tuple[str, ...] = (),
    skip_tasks: tuple[str, ...] = (),
) -> str:
    """The claim with ``limit``, ``max_wait``, the ``held`` queues and the ``skip_tasks``
    as literals (why: the comment on ``claim`` in dispatch.sql); one text per distinct
    value, so asyncpg prepares each once per connection. ``columns="id"``: the id-only
    form, for ``claim_isolated``."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"claim limit must be a positive integer (got {limit!r})")
    if not math.isfinite(max_wait) or max_wait < 0:
        raise ValueError(f"max_wait must be a finite number >= 0 (got {max_wait!r})")
    names = ",".join(f"'{validate_queue(name)}'" for name in held)  # [A-Za-z0-9_.-] only
    return compose(
        "dispatch",
        "claim",
        columns=columns,
        limit=str(limit),
        max_wait=repr(float(max_wait)),
        held=f"ARRAY[{names}]::text[]",
        skip_tasks=f"ARRAY[{','.join(map(_literal, skip_tasks))}]::text[]",
    )


@functools.cache
def staging_sql(
    name: str,
    *,
    limit: int = 1,
    ahead: float = 0.0,
    held: tuple[str, ...] = (),
    skip_tasks: tuple[str, ...] = (),
) -> str:
    """``claim_staged`` (``name``) or ``next_stage_in`` with their placeholders as
    literals, like ``claim_sql``; one text per distinct value."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"claim limit must be a positive integer (got {limit!r})")
    if not math.isfinite(ahead) or ahead < 0:
        raise ValueError(f"stage_ahead must be a finite number >= 0 (got {ahead!r})")
    names = ",".join(f"'{validate_queue(queue)}'" for queue in held)
    return compose(
        "dispatch",
        name,
        stageable=STAGEABLE,
        columns=CLAIMED,
        limit=str(limit),
        ahead=repr(float(ahead)),
        held=f"ARRAY[{names}]::text[]",
        skip_tasks=f"ARRAY[{','.join(map(_literal, skip_tasks))}]::text[]",
    )


def _literal(text: str) -> str:
    """``text`` as an escape-string literal: E'' reads backslashes the same whatever
    standard_conforming_strings says, and task names are producers' text (NUL cannot be
    in a text value)."""
    return "E'" + text.replace("\\", "\\\\").replace("'", "''") + "'"


log = get_logger(__name__)

#: Channel the client API, the CLI and the planner notify when they write a job that is
#: runnable within about a second; plain-SQL inserts are found by the probe
#: (``next_run_in``; migrations/0004_wakeups.sql).
NOTIFY_CHANNEL = "duetime_jobs"


def _ordered(conn: Conn) -> AbstractAsyncContextManager[None]:
    """Within the claim transaction, plan the claim as ordered index scans (why:
    ``ordered_claim`` in dispatch.sql); the session's choice again after it."""
    return local_setting(conn, Q["ordered_claim"], Q["default_sort"])


async def _one_by_one(
    conn: Conn,
    ids: Sequence[asyncpg.Record],
    row_sql: str,
    build: Callable[[asyncpg.Record], T],
) -> tuple[list[T], list[UnreadableRow]]:
    """Read the rows ``ids`` (locked by the caller) one at a time with ``row_sql``: the
    ones the client can decode, and the ones it cannot, with why."""
    read: list[T] = []
    unreadable: list[UnreadableRow] = []
    for job_id in [r["id"] for r in ids]:
        try:
            record = await conn.fetchrow(row_sql, job_id)
        except UNREADABLE as exc:
            unreadable.append(UnreadableRow(job_id, f"{type(exc).__name__}: {exc}"))
            continue
        if record is not None:
            read.append(build(record))
    return read, unreadable


def _key_arrays(jobs: Sequence[ClaimedJob]) -> tuple[list[int], datetime, datetime]:
    """Arguments identifying ``jobs``: ids, and the due_at range for partition pruning."""
    dues = [job.due_at for job in jobs]
    return [job.id for job in jobs], min(dues), max(dues)


class DispatchStore(PooledStore):
    # -- dispatcher (inside its fenced transaction) ----------------------------------

    async def claim(
        self,
        conn: Conn,
        limit: int,
        *,
        max_wait: float = DEFAULT_MAX_WAIT,
        held: Sequence[str] = (),
        skip_tasks: Sequence[str] = (),
    ) -> list[ClaimedJob]:
        """Lock up to ``limit`` due pending jobs of declared queues not in ``held``, of
        tasks not in ``skip_tasks``: those due for more than ``max_wait`` seconds oldest
        first, then by priority (highest first) and run time."""
        sql = claim_sql(
            limit, max_wait=max_wait, held=tuple(sorted(held)), skip_tasks=tuple(skip_tasks)
        )
        async with _ordered(conn):
            records = await conn.fetch(sql)
        return [ClaimedJob.from_record(r) for r in records]

    async def claim_isolated(
        self,
        conn: Conn,
        limit: int,
        *,
        max_wait: float = DEFAULT_MAX_WAIT,
        held: Sequence[str] = (),
        skip_tasks: Sequence[str] = (),
    ) -> tuple[list[ClaimedJob], list[UnreadableRow]]:
        """``claim`` one row at a time, for when ``claim`` raised ``UNREADABLE``: the jobs
        that could be read, and the rows that could not (still locked, for ``park``)."""
        sql = claim_sql(
            limit,
            "id",
            max_wait=max_wait,
            held=tuple(sorted(held)),
            skip_tasks=tuple(skip_tasks),
        )
        async with _ordered(conn):
            ids = await conn.fetch(sql)
        return await _one_by_one(conn, ids, CLAIMED_ROW, ClaimedJob.from_record)

    async def park(self, conn: Conn, job_id: int, reason: str) -> bool:
        """pending or dispatched → dead with ``reason`` as last_error, by id alone (the
        caller holds the row's lock)."""
        return await conn.execute(Q["park"], job_id, reason) == "UPDATE 1"

    async def park_unreadable(
        self, conn: Conn, rows: Sequence[UnreadableRow], *, reader: str
    ) -> list[ParkedRow]:
        """Make each of ``rows`` (locked by the caller's claim) dead with why ``reader``
        could not read it, each under a savepoint: a park the database refuses (a row
        breaking an older NOT VALID CHECK) leaves that row as it is and the caller's
        transaction, with the rest of its batch, intact."""
        parked: list[ParkedRow] = []
        for row in rows:
            reason = f"the {reader} cannot read this row ({row.error}); parked as dead"
            try:
                async with conn.transaction():  # a savepoint
                    done = await self.park(conn, row.job_id, reason)
            except asyncpg.PostgresError as exc:
                done = False
                reason = f"{reason}; the park was refused: {type(exc).__name__}: {exc}"
            parked.append(ParkedRow(row.job_id, done, reason))
        return parked

    async def mark_dispatched(
        self, conn: Conn, jobs: Sequence[ClaimedJob], epoch: int
    ) -> dict[int, float]:
        """pending → dispatched for ``jobs`` (all confirmed); returns {job id: lag seconds}."""
        if not jobs:
            return {}
        ids, lo, hi = _key_arrays(jobs)
        records = await conn.fetch(Q["mark_dispatched"], ids, lo, hi, epoch)
        return {r["id"]: r["lag"] for r in records}

    async def claim_staged(
        self,
        conn: Conn,
        limit: int,
        *,
        ahead: float,
        held: Sequence[str] = (),
        skip_tasks: Sequence[str] = (),
    ) -> list[ClaimedJob]:
        """Lock up to ``limit`` pending jobs whose run time is in the next ``ahead``
        seconds (not yet due), earliest first, of declared unpaused queues not in
        ``held`` and tasks not in ``skip_tasks``."""
        sql = staging_sql(
            "claim_staged",
            limit=limit,
            ahead=ahead,
            held=tuple(sorted(held)),
            skip_tasks=tuple(sorted(skip_tasks)),
        )
        return [ClaimedJob.from_record(r) for r in await conn.fetch(sql)]

    async def mark_staged(self, conn: Conn, jobs: Sequence[ClaimedJob], epoch: int) -> set[int]:
        """pending → dispatched for staged ``jobs`` (all confirmed), heartbeat_at = their
        run time; returns the ids marked."""
        if not jobs:
            return set()
        ids, lo, hi = _key_arrays(jobs)
        return {r["id"] for r in await conn.fetch(Q["mark_staged"], ids, lo, hi, epoch)}

    # -- dispatcher (pool) -----------------------------------------------------------

    async def next_run_in(self) -> float | None:
        """Seconds until the earliest pending run time (≤ 0: due now; None: nothing)."""
        async with self._db.acquire() as conn:
            value = await conn.fetchval(Q["next_run_in"])
        return None if value is None else float(value)

    async def next_stage_in(
        self, *, held: Sequence[str] = (), skip_tasks: Sequence[str] = ()
    ) -> float | None:
        """Seconds until the earliest run time, after now, of a job ``claim_staged``
        could take (None: none)."""
        sql = staging_sql(
            "next_stage_in", held=tuple(sorted(held)), skip_tasks=tuple(sorted(skip_tasks))
        )
        async with self._db.acquire() as conn:
            value = await conn.fetchval(sql)
        return None if value is None else float(value)

    async def backlog(self) -> int:
        """Pending jobs whose run time has passed."""
        async with self._db.acquire() as conn:
            return int(await conn.fetchval(Q["backlog"]))

    async def waiting(self) -> int:
        """Jobs waiting for their dependencies (workflows, migration 0025)."""
        async with self._db.acquire() as conn:
            return int(await conn.fetchval(Q["waiting"]))

    async def held(self, names: int = 20) -> HeldQueues:
        """Due pending jobs held because their queue is not declared: the ``names``
        queues holding most, and the totals over all of them."""
        async with self._db.acquire() as conn:
            records = await conn.fetch(Q["held"], names)
        if not records:
            return HeldQueues()
        return HeldQueues(
            queues=tuple((r["queue"], int(r["jobs"])) for r in records),
            total_jobs=int(records[0]["total_jobs"]),
            total_queues=int(records[0]["total_queues"]),
        )

    async def queue_flags(self, limit: int = 1000) -> dict[str, bool]:
        """The declared queues (at most ``limit``, by name), each with whether it is
        paused."""
        async with self._db.acquire() as conn:
            records = await conn.fetch(Q["queue_flags"], limit)
        return {r["name"]: bool(r["paused"]) for r in records}

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
            LOCK_STALLED, float(visibility_timeout), limit, list(skip_queues)
        )
        return [StalledJob.from_record(r) for r in records]

    async def lock_stalled_isolated(
        self,
        conn: Conn,
        visibility_timeout: float,
        limit: int,
        *,
        skip_queues: Sequence[str] = (),
    ) -> tuple[list[StalledJob], list[UnreadableRow]]:
        """``lock_stalled`` one row at a time, for when it raised ``UNREADABLE``."""
        ids = await conn.fetch(
            LOCK_STALLED_IDS, float(visibility_timeout), limit, list(skip_queues)
        )
        return await _one_by_one(conn, ids, STALLED_ROW, StalledJob.from_record)

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
