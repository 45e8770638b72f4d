"""StatusStore: the read-only statements behind ``duetime status``, the readiness check
and the dashboard's overview (``sql/status.sql``).

One REPEATABLE READ, READ ONLY transaction per snapshot, so the figures agree with each
other; ages are computed by the database clock. What the figures mean for health is
``scheduler.status``.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from scheduler.config import DEFAULT_DB_TIMEOUT
from scheduler.sql import load
from scheduler.store.conn import Conn, Pooled
from scheduler.store.rows import (
    DbSnapshot,
    FenceView,
    QueueStatus,
    ScheduleSummary,
    UnstartedJobs,
    UpcomingFire,
)

Q = load("status")

DEAD_WINDOW_SECONDS = 3600.0
UPCOMING_SCHEDULES = 5


class StatusStore:
    """Read-only queries behind ``duetime status`` and the ``db`` readiness check."""

    def __init__(self, pool: asyncpg.Pool, *, acquire_timeout: float = DEFAULT_DB_TIMEOUT) -> None:
        """``acquire_timeout``: see ``scheduler.store.conn.Pooled``."""
        self._db = Pooled(pool, acquire_timeout=acquire_timeout)

    async def ping(self) -> None:
        """Raise unless PostgreSQL answers a trivial query (a readiness check)."""
        async with self._db.acquire() as conn:
            await conn.fetchval(Q["ping"])

    async def unstarted(self) -> tuple[UnstartedJobs, ...]:
        """Per queue, the dispatched jobs no worker has shown a sign of life for
        (``heartbeat_at`` unset) and the age of the oldest: work the broker was handed
        that has not started."""
        async with self._db.acquire() as conn:
            return _unstarted(await conn.fetch(Q["unstarted_by_queue"]))

    async def snapshot(
        self, *, dead_window: float = DEAD_WINDOW_SECONDS, pending: bool = True
    ) -> DbSnapshot:
        """``pending=False`` skips counting pending jobs (its cost grows with the backlog:
        the dashboard skips it above a bound); every queue then reads 0 pending."""
        async with (
            self._db.acquire() as conn,
            conn.transaction(isolation="repeatable_read", readonly=True),
        ):
            fence_row = await conn.fetchrow(Q["fence"])
            pending_rows = await conn.fetch(Q["pending_by_queue"]) if pending else []
            dispatched = await conn.fetch(Q["dispatched_by_queue"])
            unstarted = _unstarted(await conn.fetch(Q["unstarted_by_queue"]))
            dead = await conn.fetch(Q["dead_by_queue"], dead_window)
            declared = await self._declared(conn)
            paused = set(await conn.fetchval(Q["paused_queues"])) if declared is not None else set()
            schedules = None
            if await conn.fetchval(Q["schedules_table"]):
                schedules = await self._schedules(conn)
            db_now = await conn.fetchval(Q["now"])
            waiting = await conn.fetchval(Q["waiting"])
        fence = FenceView.from_record(fence_row)
        queues: dict[str, dict[str, Any]] = {}
        for row in pending_rows:
            queues.setdefault(row["queue"], {}).update(
                pending=row["pending"], due_now=row["due_now"], oldest_overdue=row["oldest_overdue"]
            )
        for row in dispatched:
            queues.setdefault(row["queue"], {})["dispatched"] = row["dispatched"]
        for found in unstarted:
            queues.setdefault(found.queue, {}).update(
                unstarted=found.count, oldest_unstarted=found.oldest_age
            )
        for row in dead:
            queues.setdefault(row["queue"], {})["dead_last_hour"] = row["dead"]
        for name in paused:  # shown even when it holds no job right now
            queues.setdefault(name, {})
        if declared is not None:
            for name, counts in queues.items():
                counts["declared"] = name in declared
                counts["paused"] = name in paused
        return DbSnapshot(
            db_now=db_now,
            fence=fence,
            queues=tuple(QueueStatus(queue=q, **queues[q]) for q in sorted(queues)),
            schedules=schedules,
            waiting=waiting,
        )

    async def _declared(self, conn: Conn) -> set[str] | None:
        """Declared queue names; None when the schema predates them (all count as declared)."""
        if not await conn.fetchval(Q["queues_table"]):
            return None
        return set(await conn.fetchval(Q["declared_queues"]))

    async def _schedules(self, conn: Conn) -> ScheduleSummary:
        summary = await conn.fetchrow(Q["schedules_summary"])
        assert summary is not None  # an aggregate always returns one row
        upcoming = await conn.fetch(Q["schedules_next"], UPCOMING_SCHEDULES)
        return ScheduleSummary(
            total=summary["total"],
            paused=summary["paused"],
            next_fire_at=summary["next_fire_at"],
            upcoming=tuple(
                UpcomingFire(r["name"], r["next_fire_at"], r["fires_in"]) for r in upcoming
            ),
        )


def _unstarted(rows: list[Any]) -> tuple[UnstartedJobs, ...]:
    return tuple(
        UnstartedJobs(r["queue"], r["unstarted"], r["oldest_unstarted"])
        for r in sorted(rows, key=lambda r: r["queue"])
    )
