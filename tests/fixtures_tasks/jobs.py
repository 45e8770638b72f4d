"""What the dispatcher would do, by hand, for worker tests: make a job ``dispatched`` and
publish its contract message (DESIGN §5) to ``duetime.<queue>``.

Worker tests must not depend on the dispatcher, so they play its part: INSERT a job,
UPDATE it to ``dispatched`` (a claim), publish ``{job_id, due_at, attempt, …}`` with
``message_id = <job_id>:<attempt>``; for a retry, UPDATE it back to ``dispatched`` and
publish the next attempt.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import aio_pika
import asyncpg
from aio_pika.abc import AbstractChannel

from scheduler.broker import declare_job_queue, queue_name
from scheduler.messages import CONTENT_TYPE, JobMessage, effective_key
from tests.support.wait import wait_for

#: SQL for the fence's epoch: a row a test marks dispatched must carry it, or the
#: commit-time trigger jobs_dispatch_fenced (migration 0006) refuses the commit.
FENCE_EPOCH = "(SELECT epoch FROM duetime.leader_fence WHERE shard = 0)"


@dataclass(frozen=True)
class DispatchedJob:
    id: int
    due_at: datetime
    task: str
    queue: str
    payload: dict[str, Any]
    key: str
    epoch: int = 0  # the row's dispatch_epoch: a message of another epoch is stale

    def message(self, attempt: int = 1, *, task: str | None = None) -> JobMessage:
        return JobMessage(
            job_id=self.id,
            due_at=self.due_at,
            attempt=attempt,
            task=task or self.task,
            payload=self.payload,
            idempotency_key=self.key,
            epoch=self.epoch,
        )


async def dispatched_job(
    pool: asyncpg.Pool,
    task: str,
    payload: dict[str, Any] | None = None,
    *,
    queue: str,
    max_attempts: int = 5,
    idempotency_key: str | None = None,
) -> DispatchedJob:
    """INSERT a job due now, then claim it (status ``dispatched``) as the dispatcher would."""
    payload = payload or {}
    async with pool.acquire() as conn:
        row = await conn.fetchrow(
            "INSERT INTO duetime.jobs (task, payload, queue, max_attempts, idempotency_key) "
            "VALUES ($1, $2, $3, $4, $5) RETURNING id, due_at, created_by",
            task,
            payload,
            queue,
            max_attempts,
            idempotency_key,
        )
        assert row is not None
        epoch = await conn.fetchval(
            "UPDATE duetime.jobs SET status = 'dispatched', dispatched_at = now(), "
            f"dispatch_epoch = {FENCE_EPOCH} WHERE id = $1 AND due_at = $2 "
            "RETURNING dispatch_epoch",
            row["id"],
            row["due_at"],
        )
    return DispatchedJob(
        id=row["id"],
        due_at=row["due_at"],
        task=task,
        queue=queue,
        payload=payload,
        key=effective_key(
            row["id"], idempotency_key, schedule_id=None, created_by=row["created_by"]
        ),
        epoch=int(epoch),
    )


async def redispatch(pool: asyncpg.Pool, job: DispatchedJob) -> int:
    """Claim a retried (pending) job again; return the attempt to publish."""
    attempt = await pool.fetchval(
        "UPDATE duetime.jobs SET status = 'dispatched', dispatched_at = now(), "
        f"dispatch_epoch = {FENCE_EPOCH} "
        "WHERE id = $1 AND due_at = $2 AND status = 'pending' RETURNING attempt",
        job.id,
        job.due_at,
    )
    assert attempt is not None, f"job {job.id} is not pending"
    return int(attempt)


async def publish(
    channel: AbstractChannel,
    queue: str,
    body: JobMessage | bytes,
    *,
    message_id: str | None = None,
) -> None:
    """Publish persistently to ``duetime.<queue>`` (a contract message or raw bytes)."""
    if isinstance(body, JobMessage):
        message_id = message_id or body.message_id
        body = body.encode()
    await channel.default_exchange.publish(
        aio_pika.Message(
            body,
            message_id=message_id,
            content_type=CONTENT_TYPE,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        ),
        routing_key=queue_name(queue),
        mandatory=True,
        timeout=10,
    )


async def declare(channel: AbstractChannel, queue: str, delivery_limit: int = 20) -> None:
    await declare_job_queue(channel, queue, delivery_limit=delivery_limit)


async def queue_depth(channel: AbstractChannel, queue: str) -> tuple[int, int]:
    """(ready messages, consumers) of ``duetime.<queue>``."""
    declared = await channel.declare_queue(queue_name(queue), passive=True)
    result = declared.declaration_result
    return int(result.message_count or 0), int(result.consumer_count or 0)


async def job_row(pool: asyncpg.Pool, job: DispatchedJob) -> asyncpg.Record:
    row = await pool.fetchrow(
        "SELECT *, extract(epoch FROM run_at - now())::float8 AS run_in "
        "FROM duetime.jobs WHERE id = $1 AND due_at = $2",
        job.id,
        job.due_at,
    )
    assert row is not None
    return row


async def effects(pool: asyncpg.Pool, job: DispatchedJob, table: str) -> int:
    return int(await pool.fetchval(f"SELECT count(*) FROM {table} WHERE job_id = $1", job.id))


async def drain(
    url: str, queue: str, *, expect: int, timeout: float = 15.0
) -> list[aio_pika.abc.AbstractIncomingMessage]:
    """Get every message of ``duetime.<queue>`` (at least ``expect``), acking them."""
    got: list[aio_pika.abc.AbstractIncomingMessage] = []
    connection = await aio_pika.connect(url, timeout=10)
    try:
        channel = await connection.channel()
        q = await channel.declare_queue(queue_name(queue), passive=True)

        async def take() -> bool:
            while (message := await q.get(no_ack=True, fail=False, timeout=5)) is not None:
                got.append(message)
            return len(got) >= expect

        await wait_for(take, timeout=timeout, message=f"{expect} messages on {queue}")
    finally:
        await connection.close()
    return got
