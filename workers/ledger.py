"""The per-delivery transaction: where at-least-once delivery becomes exactly-once effects.

One delivery, one transaction on one pooled connection (DESIGN §6)::

    BEGIN
    WITH job AS (SELECT … FROM jobs WHERE id=$1 AND due_at=$2 FOR KEY SHARE)  -- waits
    INSERT INTO job_ledger … SELECT … FROM job    -- for the claim; one statement, one
      WHERE <dispatched, this attempt> ON CONFLICT DO NOTHING  -- round trip (begin_delivery)
      missing / not 'dispatched' / other attempt  → COMMIT, skipped (stale or duplicate)
      key already there (effect done)             → make the job succeeded, COMMIT, skipped
      (task not registered: the plain lock-read, then mark dead, COMMIT)
    handler(ctx, payload)   -- ctx.db is this connection, under the task's timeout
    UPDATE jobs SET status='succeeded' … WHERE status='dispatched' AND attempt=$n
    COMMIT                  -- effects, ledger row and status, all or nothing

On a handler exception or timeout: ROLLBACK (its ``ctx.db`` writes vanish), then in a
new transaction either ``pending`` with the next attempt (and a NOTIFY for the
dispatcher) or ``dead`` (``workers.retry.decide``). The caller acks only after
``execute`` returned: every return value means "an outcome is committed, ack".
``DatabaseUnavailable`` means no outcome could be recorded; the caller must requeue.

Round trips per delivery: BEGIN, the lock-read + ledger row (one statement), the
handler's own, UPDATE succeeded, COMMIT — and no session reset when the connection goes
back to the pool (``scheduler.db.keep_session``): a handler's changes to its *session*
(``SET`` without ``LOCAL``, session advisory locks, ``LISTEN``) outlive its job, so
handlers keep them transaction-scoped (``SET LOCAL``, ``pg_advisory_xact_lock``), which
also rolls them back with a failed attempt.

Why FOR KEY SHARE: the dispatcher publishes inside its claim transaction, so a message
can arrive before the claim commits (or for a claim that then rolls back). The lock
waits for it; held while the handler runs, it makes the reconciler's SKIP LOCKED pass
the running job by. Two deliveries of the same attempt both get the lock (it is
shared), but the second blocks on the ledger's primary key until the first ends.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

import asyncpg

from scheduler.log import get_logger
from scheduler.messages import JobMessage
from scheduler.metrics import FIRE_LAG, JOB_DURATION, JOBS_FINISHED
from scheduler.store.execution import Conn, ExecutionStore, LockedJob
from workers.context import JobContext
from workers.heartbeat import Heartbeat
from workers.registry import Registry, TaskSpec
from workers.retry import GiveUp, RetryLater, decide

log = get_logger("duetime.worker")


class Outcome(StrEnum):
    """What a delivery ended as; every value means it is settled and may be acked."""

    SUCCEEDED = "succeeded"
    RETRIED = "retried"
    DEAD = "dead"
    SKIPPED = "skipped"  # stale, duplicate, or superseded: nothing to do


class DatabaseUnavailable(Exception):
    """No outcome could be recorded (PostgreSQL unreachable, or a bug): requeue."""


@dataclass(frozen=True, slots=True)
class _Failure:
    exc: BaseException
    job: LockedJob
    spec: TaskSpec


class Ledger:
    """Runs deliveries against the database. Stateless between deliveries."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        registry: Registry,
        *,
        worker_name: str,
        heartbeat_interval: float,
        acquire_timeout: float = 10.0,
        store: ExecutionStore | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._pool = pool
        self._registry = registry
        self._store = store or ExecutionStore(pool, timeout=acquire_timeout)
        self._worker = worker_name
        self._heartbeat_interval = heartbeat_interval
        self._acquire_timeout = acquire_timeout
        self._rng = rng

    @property
    def registry(self) -> Registry:
        return self._registry

    async def execute(self, msg: JobMessage) -> Outcome:
        """Settle one delivery; raise ``DatabaseUnavailable`` if it could not be."""
        try:
            async with self._pool.acquire(timeout=self._acquire_timeout) as conn:
                result = await self._attempt(conn, msg)
        except (asyncio.CancelledError, DatabaseUnavailable):
            raise
        except Exception as exc:
            raise DatabaseUnavailable(f"{type(exc).__name__}: {exc}") from exc
        if isinstance(result, _Failure):
            result = await self._record_failure(msg, result)
        label = msg.task if msg.task in self._registry else "unknown"
        JOBS_FINISHED.labels(label, result.value).inc()
        return result

    # -- the transaction -------------------------------------------------------------

    async def _attempt(self, conn: Conn, msg: JobMessage) -> Outcome | _Failure:
        tx = conn.transaction()
        await tx.start()
        try:
            spec = self._registry.get(msg.task)
            if spec is None:
                job = await self._store.lock_job(conn, msg.job_id, msg.due_at)
                if _stale(job, msg):
                    await tx.commit()
                    return _skipped(job, msg)
                error = self._registry.unknown_message(msg.task)
                await self._store.mark_dead(conn, msg.job_id, msg.due_at, msg.attempt, error)
                await tx.commit()
                log.error(
                    "job_dead", job_id=msg.job_id, attempt=msg.attempt, task=msg.task, error=error
                )
                return Outcome.DEAD
            fallback_key = msg.idempotency_key or f"job:{msg.job_id}"
            delivery = await self._store.begin_delivery(
                conn,
                job_id=msg.job_id,
                due_at=msg.due_at,
                attempt=msg.attempt,
                default_key=fallback_key,
                task=msg.task,
                worker=self._worker,
            )
            if delivery is None or _stale(delivery.job, msg):
                await tx.commit()
                return _skipped(None if delivery is None else delivery.job, msg)
            job = delivery.job
            key = job.idempotency_key or fallback_key
            if delivery.claimed_key is None:  # the ledger already holds the key
                await self._store.mark_succeeded(conn, msg.job_id, msg.due_at, msg.attempt)
                await tx.commit()
                log.info(
                    "delivery_duplicate",
                    job_id=msg.job_id,
                    attempt=msg.attempt,
                    task=msg.task,
                    idempotency_key=key,
                )
                return Outcome.SKIPPED
            failure = await self._run_handler(conn, msg, job, spec, key)
            if failure is None:
                try:
                    current = await self._store.mark_succeeded(
                        conn, msg.job_id, msg.due_at, msg.attempt
                    )
                    if not current:
                        await _abort(conn, tx)
                        log.warning(
                            "attempt_superseded",
                            job_id=msg.job_id,
                            attempt=msg.attempt,
                            task=msg.task,
                        )
                        return Outcome.SKIPPED
                    await tx.commit()
                except Exception as exc:  # e.g. the handler left the transaction aborted
                    failure = exc
                else:
                    log.debug(
                        "job_succeeded", job_id=msg.job_id, attempt=msg.attempt, task=msg.task
                    )
                    return Outcome.SUCCEEDED
            await _abort(conn, tx)
            return _Failure(failure, job, spec)
        except BaseException:
            await _abort(conn, tx)
            raise

    async def _run_handler(
        self,
        conn: Conn,
        msg: JobMessage,
        job: LockedJob,
        spec: TaskSpec,
        key: str,
    ) -> BaseException | None:
        """Run the handler under its timeout; return its exception, or None."""
        beat_log = get_logger(
            "duetime.worker", job_id=msg.job_id, attempt=msg.attempt, task=msg.task
        )
        heartbeat = Heartbeat(
            self._store,
            job_id=msg.job_id,
            due_at=msg.due_at,
            attempt=msg.attempt,
            interval=self._heartbeat_interval,
            log=beat_log,
        )
        ctx = JobContext(
            job_id=msg.job_id,
            attempt=msg.attempt,
            max_attempts=spec.attempts_allowed(job.max_attempts),
            due_at=msg.due_at,
            task=msg.task,
            queue=job.queue,
            idempotency_key=key,
            db=conn,
            beat=heartbeat.beat,
        )
        FIRE_LAG.observe(max(0.0, (datetime.now(UTC) - job.run_time).total_seconds()))
        started = time.monotonic()
        heartbeat.start()
        try:
            async with asyncio.timeout(spec.timeout) as deadline:
                await spec.handler(ctx, msg.payload)
        except Exception as exc:
            if isinstance(exc, TimeoutError) and deadline.expired():
                return TimeoutError(f"handler exceeded its timeout of {spec.timeout:g}s")
            return exc
        finally:
            await heartbeat.stop()
            JOB_DURATION.labels(spec.name).observe(time.monotonic() - started)
        return None

    async def _record_failure(self, msg: JobMessage, failure: _Failure) -> Outcome:
        spec, job = failure.spec, failure.job
        decision = decide(
            failure.exc,
            attempt=msg.attempt,
            max_attempts=spec.attempts_allowed(job.max_attempts),
            policy=spec.retry,
            rng=self._rng,
        )
        fields: dict[str, Any] = {
            "job_id": msg.job_id,
            "attempt": msg.attempt,
            "task": msg.task,
            "error": decision.error,
        }
        try:
            async with (
                self._pool.acquire(timeout=self._acquire_timeout) as conn,
                conn.transaction(),
            ):
                if isinstance(decision, RetryLater):
                    run_at = await self._store.schedule_retry(
                        conn,
                        msg.job_id,
                        msg.due_at,
                        msg.attempt,
                        delay=decision.delay,
                        error=decision.error,
                    )
                    recorded = run_at is not None
                else:
                    recorded = await self._store.mark_dead(
                        conn, msg.job_id, msg.due_at, msg.attempt, decision.error
                    )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.error("failure_not_recorded", exc_info=failure.exc, **fields)
            raise DatabaseUnavailable(f"{type(exc).__name__}: {exc}") from exc
        if not recorded:
            log.warning("attempt_superseded", **fields)
            return Outcome.SKIPPED
        if isinstance(decision, GiveUp):
            log.error("job_dead", exc_info=failure.exc, **fields)
            return Outcome.DEAD
        log.warning(
            "job_retry_scheduled",
            exc_info=failure.exc,
            retry_in=round(decision.delay, 3),
            run_at=run_at.isoformat() if run_at else None,
            **fields,
        )
        return Outcome.RETRIED


def _stale(job: LockedJob | None, msg: JobMessage) -> bool:
    """The row is gone, or no longer waiting for this attempt: nothing to run."""
    return job is None or job.status != "dispatched" or job.attempt != msg.attempt


def _skipped(job: LockedJob | None, msg: JobMessage) -> Outcome:
    log.info(
        "delivery_skipped",
        job_id=msg.job_id,
        attempt=msg.attempt,
        task=msg.task,
        status=None if job is None else job.status,
        current_attempt=None if job is None else job.attempt,
        reason="missing" if job is None else "stale",
    )
    return Outcome.SKIPPED


async def _abort(conn: Conn, tx: Any) -> None:
    """Roll back; if that is impossible (connection broken, a query still cancelling),
    drop the connection: the server then aborts the transaction itself."""
    try:
        await tx.rollback()
    except Exception:
        if not conn.is_closed() and conn.is_in_transaction():
            conn.terminate()
