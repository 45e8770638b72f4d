"""duetime workers: the execution runtime (DESIGN §6).

Write tasks::

    from workers import JobContext, Retry, Fail, task

    @task("send_email", timeout=30, max_attempts=8)
    async def send_email(ctx: JobContext, payload: dict) -> None:
        row = await ctx.db.fetchrow("SELECT ... FOR UPDATE", payload["user_id"])
        if row is None:
            raise Fail("no such user")              # dead now, no retries
        if not mailer_ready():
            raise Retry(in_=60)                     # try again in a minute (counts an attempt)
        await mailer.send(..., idempotency_key=ctx.idempotency_key)
        await ctx.db.execute("UPDATE users SET emailed_at = now() WHERE id = $1", ...)

    @task("resize")                                 # a plain def: runs on a handler thread
    def resize(ctx: SyncJobContext, payload: dict) -> None:
        ctx.db.execute("UPDATE images SET done = true WHERE id = $1", payload["id"])

and run them: ``duetime worker --import myapp.tasks --queue default --concurrency 64``,
or from Python with ``Worker`` / ``run_worker``. The names below are the whole worker
API (``docs/api.md``, spelled ``from duetime import ...``); ``duetime.testing`` runs one
handler in a test without a broker.

Guarantee: delivery is at least once; effects done through ``ctx.db`` happen exactly
once (they commit in the same transaction as the idempotency-ledger row and the job's
``succeeded`` status); give ``ctx.idempotency_key`` to external APIs.
"""

from workers.context import Dependency, JobContext
from workers.lifecycle import WorkerStartupFailed, WorkerState
from workers.registry import (
    DuplicateTask,
    Registry,
    TaskSpec,
    default_registry,
    task,
    worker_shutdown,
    worker_startup,
)
from workers.retry import Fail, Retry, RetryPolicy
from workers.snooze import Snooze
from workers.sync_db import AttemptAbandoned, SyncJobContext
from workers.worker import Worker, run_worker

__all__ = [
    "AttemptAbandoned",
    "Dependency",
    "DuplicateTask",
    "Fail",
    "JobContext",
    "Registry",
    "Retry",
    "RetryPolicy",
    "Snooze",
    "SyncJobContext",
    "TaskSpec",
    "Worker",
    "WorkerStartupFailed",
    "WorkerState",
    "default_registry",
    "run_worker",
    "task",
    "worker_shutdown",
    "worker_startup",
]
