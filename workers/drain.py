"""Run the due jobs of a test database inline, through the worker's own code path
(documented as ``duetime.testing.drain``; docs/api.md "Testing end to end").

A test enqueues the way the application does (``duetime.enqueue`` in a view's
transaction, ``JobStore.enqueue``, ``enqueue_async``), commits, and calls ``drain``:
every job that is due is claimed by the dispatcher's own claim statement, marked
dispatched under the fence's current epoch (the same ``mark_dispatched`` and commit-time
fence trigger), and run by a real ``Executor``: the ``worker_begin_*`` read, the
registry, the job's timeout, the handler's ``ctx.db`` transaction committed with
``finish_attempt`` (effects, ledger row and status in one transaction), and retries and
dead-lettering decided by ``workers.retry`` and written by ``worker_retry`` /
``worker_dead``. Only the broker is left out: the message a dispatcher would publish
is handed to the executor directly.

What differs from production, on purpose:

- **No broker, no leader.** The claim runs in this process under whatever epoch the
  fence holds (no etcd election). Never drain a database a scheduler is running on:
  its next claim would be refused by nothing and its epoch would be shared.
- **One job at a time**, in claim order (aged first, then priority, then run time), so
  a test sees a deterministic sequence; production runs up to ``concurrency`` at once.
- **Back-offs are collapsed** (``collapse_retries=True``, the default): a job that a
  failure sent back to ``pending`` is made runnable at once (``JobStore.run_now``, the
  operator's command) and run again in the same drain, so a test sees every attempt
  without waiting; the ``run_at`` the retry wrote is replaced. With False the back-off
  is honoured and the retry waits for a later ``drain``.
- **Only what is due now runs.** A job with a later ``due_at``, a snoozed job, and (with
  ``collapse_retries=False``) a retry in back-off stay pending; the report counts them.
- **Concurrency and rate limits are not applied**, and jobs of queues that are not
  declared, or paused, are held exactly as the dispatcher holds them (``held``).
- Jobs enqueued by a handler during the drain are run by it too, up to ``max_runs``.

The jobs must be committed: ``drain`` reads them from connections of its own, as a
worker does (a test wrapped in a transaction that is never committed, such as Django's
``TestCase``, needs ``TransactionTestCase``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from scheduler.db import create_pool
from scheduler.errors import InvalidTransition
from scheduler.messages import JobMessage
from scheduler.store.dispatch import DispatchStore
from scheduler.store.execution import ExecutionStore
from scheduler.store.fence import lock_fence
from scheduler.store.jobs import JobStore
from scheduler.store.rows import ClaimedJob
from workers.executor import Executor
from workers.registry import Registry, default_registry
from workers.verdicts import Outcome

__all__ = ["DrainReport", "drain", "drain_async"]

#: Deliveries a drain runs at most: a handler that enqueues itself must not loop forever.
DEFAULT_MAX_RUNS = 1000
#: Jobs claimed per claim statement.
CLAIM_BATCH = 100
#: The name the drain settles attempts as (``job_ledger.worker``).
WORKER_NAME = "duetime-drain"


@dataclass
class DrainReport:
    """What a drain did: how many attempts ended in each ``Outcome`` (``"succeeded"``,
    ``"retried"``, ``"dead"``, ...), the ids of the jobs it ran in order (one entry per
    attempt), and the due jobs it left because their queue is not declared (queue ->
    jobs)."""

    outcomes: Counter[str] = field(default_factory=Counter)
    ran: list[int] = field(default_factory=list)
    held: dict[str, int] = field(default_factory=dict)

    @property
    def runs(self) -> int:
        return len(self.ran)

    def __getitem__(self, outcome: str) -> int:
        return self.outcomes[outcome]


async def drain_async(
    db: asyncpg.Pool | str,
    *,
    registry: Registry | None = None,
    collapse_retries: bool = True,
    max_runs: int = DEFAULT_MAX_RUNS,
    task_timeout: float = 60.0,
) -> DrainReport:
    """Run every due job of ``db`` (a pool, or a database URL: a small pool is opened
    and closed) with ``registry``'s handlers (default: ``@task``'s), until none is due
    or ``max_runs`` attempts ran (module docstring: what differs from a worker).
    ``task_timeout``: a handler's bound when neither its job nor its task sets one."""
    if isinstance(db, str):
        pool = await create_pool(db, min_size=1, max_size=3, application_name=WORKER_NAME)
        try:
            return await drain_async(
                pool,
                registry=registry,
                collapse_retries=collapse_retries,
                max_runs=max_runs,
                task_timeout=task_timeout,
            )
        finally:
            await pool.close()
    source = registry if registry is not None else default_registry
    executor = Executor(
        db,
        source,
        worker_name=WORKER_NAME,
        heartbeat_interval=max(task_timeout, 1.0),
        task_timeout=task_timeout,
        group_transactions=False,
        # the registry's attempt budgets written into the rows it settles, as a worker's
        store=ExecutionStore(db, budgets=source.budgets()),
    )
    report = DrainReport()
    dispatch, jobs = DispatchStore(db), JobStore(db)
    try:
        while report.runs < max_runs:
            claimed, epoch = await _claim(db, dispatch, min(CLAIM_BATCH, max_runs - report.runs))
            if not claimed:
                break
            for job in claimed:
                message = JobMessage(job.id, job.due_at, job.attempt, epoch, task=job.task)
                outcome = await executor.execute(message)
                report.outcomes[outcome.value] += 1
                report.ran.append(job.id)
                if outcome is Outcome.RETRIED and collapse_retries:
                    # a back-off of 0 left nothing to collapse
                    with contextlib.suppress(InvalidTransition):
                        await jobs.run_now(job.id)
    finally:
        await executor.close()
    held = await dispatch.held()
    report.held = dict(held.queues)
    return report


async def _claim(
    pool: asyncpg.Pool, dispatch: DispatchStore, limit: int
) -> tuple[list[ClaimedJob], int]:
    """The dispatcher's claim and ``mark_dispatched`` in one transaction, under the
    fence's current epoch (locked FOR SHARE until the commit, as a leader's claim)."""
    async with pool.acquire() as conn, conn.transaction():
        epoch = await lock_fence(conn)
        if epoch is None:
            raise RuntimeError("duetime.leader_fence has no row: is the database migrated?")
        claimed = await dispatch.claim(conn, limit)
        marked = await dispatch.mark_dispatched(conn, claimed, epoch)
    return [job for job in claimed if job.id in marked], epoch


def drain(dsn: str, **options: Any) -> DrainReport:
    """``drain_async`` for synchronous tests (no event loop running in this thread), on
    the database ``dsn`` and an event loop of its own. From ``async def`` tests, ``await
    drain_async(...)``."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(drain_async(dsn, **options))
    raise RuntimeError(
        "duetime.testing.drain() was called with an event loop running: "
        "use `await duetime.testing.drain_async(...)` in async tests"
    )
