"""Shortcuts over production objects that only tests need (production code has no use
for them, so they live here rather than on the classes)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from datetime import datetime

import asyncpg
from aio_pika.abc import AbstractChannel

from scheduler.broker import job_queue_names
from scheduler.config import Settings
from scheduler.publisher import Publisher
from workers import Registry, Worker

#: Fire rows of schedule_fires before a cut-off, at most up to each schedule's
#: next_fire_at (the rule the maintainer's fenced, batched statement follows too,
#: scheduler/sql/maintenance.sql), all at once.
PRUNE_FIRES = """
DELETE FROM duetime.schedule_fires f
 USING duetime.schedules s
 WHERE f.schedule_id = s.id
   AND f.fire_time < least($1::timestamptz, coalesce(s.next_fire_at, $1::timestamptz))
"""


async def job_rows_read(conn: asyncpg.Connection) -> int:
    """Rows of duetime.jobs (every bucket) read so far in ``conn``'s open transaction:
    by sequential scans, and fetched through indexes. What a statement reads, not how
    long it took: a plan that reads every row shows here on any machine."""
    return int(
        await conn.fetchval(
            "SELECT coalesce(sum(coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0)), 0)"
            " FROM pg_stat_xact_all_tables t JOIN pg_inherits i ON i.inhrelid = t.relid"
            " WHERE i.inhparent = 'duetime.jobs'::regclass"
        )
    )


async def prune_fires(pool: asyncpg.Pool, older_than: datetime) -> int:
    """Forget dedupe rows of fire times before ``older_than``; returns how many."""
    status = await pool.execute(PRUNE_FIRES, older_than)
    return int(status.split()[-1])


def should_throttle(publisher: Publisher) -> bool:
    """Whether the publisher asks its caller to wait before the next batch."""
    return publisher.throttle_delay() > 0


async def declare_queues(db: asyncpg.Pool | asyncpg.Connection | str, *names: str) -> None:
    """Declare job queues in duetime.queues (what ``duetime queues add`` does), so the
    dispatcher claims their jobs: only declared queues are dispatched (migration 0008).
    ``db``: a pool, a connection or a database URL."""
    sql = "INSERT INTO duetime.queues (name) SELECT unnest($1::text[]) ON CONFLICT DO NOTHING"
    if isinstance(db, str):
        conn = await asyncpg.connect(db, timeout=10)
        try:
            await conn.execute(sql, list(names))
        finally:
            await conn.close()
        return
    await db.execute(sql, list(names))


@contextlib.asynccontextmanager
async def running_worker(
    settings: Settings, registry: Registry, queue: str, *, concurrency: int = 16
) -> AsyncIterator[Worker]:
    """An in-process ``Worker`` on ``queue`` with ``registry``, stopped on the way out."""
    worker = Worker(
        dataclasses.replace(settings), queues=[queue], registry=registry, concurrency=concurrency
    )
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop()


async def delete_job_queue(channel: AbstractChannel, queue: str) -> None:
    """Delete a job queue's broker queues: ``duetime.<queue>`` and its staged twin
    (DESIGN §14), which a worker declares when it starts. Either may be missing."""
    for name in job_queue_names(queue):
        await channel.queue_delete(name)
