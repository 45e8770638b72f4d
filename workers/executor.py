"""Running one delivery: where at-least-once delivery becomes exactly-once effects.

A delivery's way through the worker (DESIGN §6)::

    begin      one statement for every delivery that arrived together (autocommit):
               lock-read each row FOR KEY SHARE — waits for an in-flight claim — and
               read the task, the payload and the ledger's verdict from the row; take
               the guard lock of each attempt it may run
      guard held by another worker process         → skipped (acked; requeued if redelivered)
    (before it) the same message already running in this process → skipped, no read
      missing / not 'dispatched' / other attempt   → skipped (stale or duplicate)
      message epoch is not the row's dispatch_epoch → skipped (a copy of another dispatch)
      key already in the ledger (effect applied)    → settled as succeeded, handler not run
      key held by another attempt here, not yet committed → wait for its commit, read
                                                      again (``_wait_for_key``)
      task not registered here                      → a failed attempt (retried, rolling
                                                      deploys), dead when attempts run out
    commit     chosen once, before the handler runs: its own transaction, or a share of
               a transaction group (``_groupable``); no ctx.db means a batched commit
    handler(ctx, payload)   under the job's ``timeout_s``, else the task's timeout, else
                      the worker's task_timeout; a plain ``def`` on a handler thread
                      (``workers.threads``); stopped when the job is cancelled
                      (``workers.cancel``); what it returns is encoded for the outcome
                      (``workers.results``)
      used ctx.db   → in that transaction, the attempt's own: UPDATE succeeded +
                      INSERT ledger (``duetime.finish_attempt``) sent with the COMMIT in
                      one round trip — effects, ledger row and status, all or nothing;
                      a key that another delivery recorded first rolls the effects
                      back. Only attempts of tasks that
                      opted in (``share_transaction=True``) that use ctx.db at the same
                      time share one transaction (``workers.groups``): one
                      ``finish_group``, one COMMIT; a failing member sends the others to
                      run again alone
      no ctx.db     → succeeded + ledger rows for many attempts in one statement
                      (``complete``, batched with the others that finished meanwhile)
    failure        → ctx.db work rolled back; then ``pending`` with the next attempt, or
                      ``dead`` (``workers.retry.decide``), on a connection of its own;
                      a failure that lost to another holder of the key (the ledger
                      holds it now) is a duplicate instead (``Settler.settle``)
    slot           given back when the handler returned (``workers.slots``): the next
                      handler runs while this outcome settles
    settle     whichever way it committed, the attempt's ``Verdict`` goes through one
               ``workers.settlement.Settler``: one outcome, one log line, one metric

The caller acks only after ``execute`` returned: every return value means "an outcome is
committed". ``DatabaseUnavailable`` means none could be recorded; the caller requeues.

**One run at a time per message.** A delivery whose pointer (job id, due time, attempt,
epoch) is already running in this executor is a copy (a broker redelivery, a duplicate
publish, a forged message): it is settled as skipped at once, without a database read
and without waiting for the running one, and the caller acks it. Acking is safe because
the running delivery holds its own message: it settles the row, or, if it cannot, nacks
its message back (``DatabaseUnavailable``, shutdown), and the reconciler re-publishes a
row left ``dispatched``. A copy that names another dispatch than the row's
(``dispatch_epoch``) is stale and skipped by ``begin``'s answer. Both are counted in
``duetime_deliveries_dropped_total``. Across worker processes the begin read takes the
attempt's guard lock (``scheduler.store.execution_guard``, migration 0012), released once
the outcome committed: a copy whose attempt another process runs is not run
(``_running_elsewhere``); see docs/security.md.

**The row is authoritative.** The message only points at a job (id, due time, attempt);
the handler that runs and its payload come from the row read by ``begin``. A message
whose ``task`` disagrees with its row is a security event (logged, counted) and runs as
the row says, never as the message says.

Round trips per delivery (counted in docs/benchmarks.md): a handler without ctx.db pays
its share of two batched statements and of one multiple-ack (0.35 + 0.18 writes); one
with a ctx.db statement pays BEGIN, that statement, and ``finish_attempt`` + COMMIT (one
round trip) in its own transaction, or, when its task shares transactions, that statement
and its share of its group's BEGIN, ``finish_group`` and COMMIT (1.38 + 0.10).

Log lines of a delivery carry its job's fields (``job_id``, ``attempt``, ``task``) from
``structlog.contextvars``, bound once in ``execute`` and unbound when it returns (the
heartbeat's task inherits them). Connections are not reset between jobs
(``scheduler.db.keep_session``): handlers keep session state transaction-scoped
(``SET LOCAL``, ``pg_advisory_xact_lock``).

Why the row lock is not held while the handler runs: holding it needed the handler's
transaction open from the first statement, i.e. two round trips for every delivery even
when the handler never writes. A running job is kept from the reconciler by its
heartbeats (every visibility_timeout / 3); a re-publish it could still cause is absorbed
by the ledger like any duplicate delivery.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import cast

import asyncpg
from structlog.contextvars import bind_contextvars, reset_contextvars

from scheduler import tracing
from scheduler.broker import QUEUE_PREFIX
from scheduler.clock import SYSTEM_CLOCK, Clock
from scheduler.config.shards import DEFAULT_SHARD
from scheduler.db import DB_UNAVAILABLE
from scheduler.log import get_logger
from scheduler.messages import JobMessage, message_id
from scheduler.metrics import (
    DELIVERIES_DROPPED,
    DELIVERIES_WAITING,
    FIRE_LAG,
    JOB_DURATION,
    MESSAGE_ROW_MISMATCH,
    STAGED_RELEASED,
)
from scheduler.store.execution import ExecutionStore
from scheduler.store.rows import UNREADABLE, JobRef, LockedJob
from workers.batching import Coalescer
from workers.cancel import Cancellations, HandlerCancelled
from workers.context import JobContext, dependencies_from
from workers.errors import CONNECTION_ERRORS, AttemptRunningElsewhere, DatabaseUnavailable
from workers.groups import Groups
from workers.heartbeat import Heartbeat
from workers.lazydb import LazyTransaction
from workers.progress import Progress
from workers.registry import AsyncHandler, Registry, TaskSpec
from workers.results import DEFAULT_RESULT_MAX_BYTES, encode_result
from workers.settlement import Attempt, Settler, UnknownTask
from workers.slots import HandlerSlot
from workers.threads import ThreadRunner
from workers.verdicts import Outcome, Verdict

__all__ = ["Executor", "Outcome", "UnknownTask", "Unreadable"]

log = get_logger("duetime.worker")

#: Deliveries read per statement.
BATCH_SIZE = 256
#: Batched reads in flight at once: a delivery does not wait long for one to start, even
#: when a read waits for a claim still in flight (FOR KEY SHARE). Each runs on a guard
#: connection of its own (``scheduler.store.execution_guard``). Two, not four, since a
#: delivery is read before it takes its handler slot (``workers.slots``): deliveries then
#: reach the read as they arrive, and four reads in flight split them into batches of ~10
#: (storm at concurrency 64: 1.9k statements, 2.06 ms CPU per job); two make batches of
#: ~18 (1.1k, 1.92 ms), with no loss at concurrency 10 (docs/benchmarks.md, "A slot is a
#: running handler, from the begin on").
BEGIN_FLUSHES = 2
#: Seconds before a redelivered copy of an attempt running elsewhere goes back to the
#: queue (``AttemptRunningElsewhere``).
RUNNING_ELSEWHERE_REQUEUE = 1.0
#: Tasks whose handlers typically run longer than this get transactions of their own.
GROUP_MAX_HANDLER_SECONDS = 0.02
#: Weight of the newest run in a task's moving average of handler run time.
DURATION_WEIGHT = 0.2
#: Handler threads of an executor built without a ``ThreadRunner`` (tests, embedding).
DEFAULT_THREADS = 16
#: Default bound on a handler's run time when its task sets none (``task_timeout``).
DEFAULT_TASK_TIMEOUT = 1800.0

#: Errors that say the database could not be used at all: retried, never blamed on a row.
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    asyncio.CancelledError,
    *DB_UNAVAILABLE,
    asyncpg.InterfaceError,
    asyncpg.QueryCanceledError,
    asyncpg.OperatorInterventionError,
    asyncpg.InsufficientResourcesError,
    asyncpg.InsufficientPrivilegeError,
)


def _row_unreadable(exc: BaseException) -> bool:
    """Whether ``begin`` failed because the client could not decode a row the server
    returned (``UNREADABLE``), the one failure that may be blamed on a row. asyncpg's
    own errors are excluded even where they subclass ``ValueError`` (its client-side
    ``DataError``): they speak of the connection or of arguments, never of a row."""
    return isinstance(exc, UNREADABLE) and not isinstance(
        exc, (*_UNAVAILABLE, *CONNECTION_ERRORS, asyncpg.PostgresError, asyncpg.InterfaceError)
    )


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A job row ``begin`` could not decode, and why."""

    reason: str


class Executor:
    """Runs deliveries against the database. Stateless between deliveries apart from the
    two batching queues (``begin``, and the settler's ``complete``), which ``close()``
    stops.

    ``pool`` serves the handlers' transactions (``ctx.db``); ``store`` runs the worker's
    own statements, by default on the same pool. ``duetime worker`` gives the store a
    small pool of its own whose sessions always use generic plans: the batched
    statements carry arrays, and with custom plans PostgreSQL re-planned them on every
    execution (~5 ms each for 17 partitions, more than they take to run), while a
    handler's statements keep PostgreSQL's default plan choice.

    ``shard`` names the database ``pool`` is (``main`` unsharded): the label of every
    metric the executor records, so a worker with several shards counts each apart.
    ``clock`` times handlers and fire lag (tests drive it). ``threads`` runs the plain
    ``def`` handlers (``workers.threads``; the worker shares one across its shards);
    without it the executor makes its own of ``DEFAULT_THREADS`` on first use.
    """

    def __init__(
        self,
        pool: asyncpg.Pool,
        registry: Registry,
        *,
        worker_name: str,
        heartbeat_interval: float,
        acquire_timeout: float = 10.0,
        task_timeout: float = DEFAULT_TASK_TIMEOUT,
        store: ExecutionStore | None = None,
        group_transactions: bool = True,
        rng: random.Random | None = None,
        shard: str = DEFAULT_SHARD,
        clock: Clock = SYSTEM_CLOCK,
        threads: ThreadRunner | None = None,
        result_max_bytes: int = DEFAULT_RESULT_MAX_BYTES,
    ) -> None:
        self.shard = shard
        # a 0 sample from the start, so the first mismatch shows as an increase
        MESSAGE_ROW_MISMATCH.labels(shard)
        self._pool = pool
        self._registry = registry
        self._store = store or ExecutionStore(pool, timeout=acquire_timeout)
        self._worker = worker_name
        self._heartbeat_interval = heartbeat_interval
        self._acquire_timeout = acquire_timeout
        self._task_timeout = task_timeout
        self._result_max_bytes = result_max_bytes
        self._clock = clock
        self._threads = threads
        self._own_threads: ThreadRunner | None = None
        #: the handlers running here, by job id: a cancel stops them (``workers.cancel``)
        self.cancellations = Cancellations(shard=shard, clock=clock)
        self._durations: dict[str, float] = {}  # task -> moving average of run time
        # the pointers of the deliveries being executed: a copy is skipped (execute)
        self._running: set[tuple[int, datetime, int, int]] = set()
        # ledger key -> the newest attempt here holding it, until its outcome committed
        # (``_wait_for_key``)
        self._keys: dict[str, asyncio.Future[None]] = {}
        self._begins: Coalescer[tuple[JobRef, int], LockedJob | Unreadable | None] = Coalescer(
            self._begin,
            name="begin",
            max_batch=BATCH_SIZE,
            max_flushes=BEGIN_FLUSHES,
            ordered=True,  # deliveries take slots in the order they arrived (workers.slots)
        )
        self._settler = Settler(self._store, worker=worker_name, shard=shard, rng=rng)
        self._groups = (
            Groups(pool, self._store, worker=worker_name, timeout=acquire_timeout, clock=clock)
            if group_transactions
            else None
        )

    @property
    def registry(self) -> Registry:
        return self._registry

    def _groupable(self, spec: TaskSpec) -> bool:
        """Whether this attempt may join a transaction group: only when its task opted
        in (``share_transaction=True``; DESIGN §15 makes one transaction per attempt the
        default), and its handlers are typically quick. A shared transaction commits
        when its slowest member is done, so a handler that takes 200 ms would hold its
        neighbours' commit (and their concurrency slots) as long: measured, an
        INSERT-then-200-ms-await handler at concurrency 64 fell from 0.91x to 0.86x of
        the 320 jobs/s ideal. For such handlers the round trips of a transaction of
        their own are noise."""
        if self._groups is None or not spec.share_transaction:
            return False
        typical = self._durations.get(spec.name)
        return typical is None or typical < GROUP_MAX_HANDLER_SECONDS

    def _thread_runner(self) -> ThreadRunner:
        if self._threads is None:
            self._threads = self._own_threads = ThreadRunner(DEFAULT_THREADS)
        return self._threads

    def _learn(self, task: str, seconds: float) -> None:
        """A moving average of each task's handler run time (``_groupable``)."""
        previous = self._durations.get(task)
        self._durations[task] = (
            seconds if previous is None else previous + DURATION_WEIGHT * (seconds - previous)
        )

    def batching(self) -> dict[str, float]:
        """Deliveries per batched statement so far (logged when the worker stops)."""
        completions = self._settler.completions
        return {
            "begin_batches": self._begins.batches,
            "begin_per_batch": round(self._begins.items / max(1, self._begins.batches), 1),
            "groups": self._groups.groups if self._groups else 0,
            "group_members": self._groups.members if self._groups else 0,
            "complete_batches": completions.batches,
            "complete_per_batch": round(completions.items / max(1, completions.batches), 1),
        }

    async def ping(self, shard: str | None = None) -> None:
        """Raise unless this executor's database answers (``workers.outage``)."""
        await self._store.ping()

    async def close(self) -> None:
        if self._own_threads is not None:
            self._own_threads.close()
        await self._begins.close()
        await self._settler.close()
        if self._groups is not None:
            await self._groups.close()
        await self._store.close()

    async def execute(
        self, msg: JobMessage, *, redelivered: bool = False, slot: HandlerSlot | None = None
    ) -> Outcome:
        """Settle one delivery; raise ``DatabaseUnavailable`` if it could not be, and
        ``AttemptRunningElsewhere`` for a ``redelivered`` copy of an attempt that another
        worker process is running (the caller requeues it for later). ``slot``, the
        delivery's handler slot, is given back as soon as the handler returned
        (``workers.slots``)."""
        bound = bind_contextvars(job_id=msg.job_id, attempt=msg.attempt, task=msg.task)
        try:
            pointer = (msg.job_id, msg.due_at, msg.attempt, msg.epoch)
            if pointer in self._running:
                DELIVERIES_DROPPED.labels(self.shard, "running").inc()
                log.warning(
                    "delivery_duplicate_running",
                    action="acked without running: the running delivery settles the row",
                )
                return Outcome.SKIPPED
            self._running.add(pointer)
            try:
                return await self._execute(msg, redelivered, slot)
            finally:
                self._running.discard(pointer)
        finally:
            reset_contextvars(**bound)  # the values before this delivery, task included

    async def _execute(
        self, msg: JobMessage, redelivered: bool, slot: HandlerSlot | None
    ) -> Outcome:
        ref = JobRef(msg.job_id, msg.due_at, msg.attempt)
        try:
            job = await self._begins.submit((ref, msg.epoch))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise DatabaseUnavailable(f"{type(exc).__name__}: {exc}") from exc
        if isinstance(job, Unreadable):
            return await self._park(ref, job)
        if job is not None:
            bind_contextvars(task=job.task)  # the row's task, whatever the message said
        if job is None or job.status != "dispatched" or job.attempt != msg.attempt:
            return _skipped(job, msg)
        if job.epoch != msg.epoch:
            DELIVERIES_DROPPED.labels(self.shard, "stale_epoch").inc()
            return _skipped(job, msg, reason="other dispatch", row_epoch=job.epoch)
        if not job.started:
            return self._running_elsewhere(redelivered)
        try:
            if msg.start_at is not None and job.run_time > msg.start_at:
                return await self._moved(ref, msg, job)
            if msg.task is not None and msg.task != job.task:
                MESSAGE_ROW_MISMATCH.labels(self.shard).inc()
                log.error(
                    "message_row_mismatch",
                    message_task=msg.task[:200],
                    action="running the row's task and payload",
                )
            held = self._hold_key(job.key)
            try:
                if held.previous is not None:
                    fresh = await self._wait_for_key(ref, job, held.previous, slot)
                    if fresh is None or not _still_dispatched(fresh, msg.attempt):
                        return _skipped(fresh, msg, reason="settled meanwhile")
                    job = dataclasses.replace(job, done=fresh.done)
                return await self._attempt(Attempt(ref, job, self._registry.get(job.task)), slot)
            finally:
                held.release()
        finally:
            self._store.release(ref, msg.epoch)

    async def _moved(self, ref: JobRef, msg: JobMessage, job: LockedJob) -> Outcome:
        """A staged delivery whose row now runs later than the message says (its run_at
        written while it was staged): not started; the row goes back to pending, and
        the dispatcher stages it again for its new time (migration 0028)."""
        try:
            given_back = await self._store.unstage(ref, msg.epoch)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise DatabaseUnavailable(f"{type(exc).__name__}: {exc}") from exc
        STAGED_RELEASED.labels("moved").inc()
        log.info(
            "staged_job_moved",
            staged_for=msg.start_at.isoformat() if msg.start_at else None,
            run_time=job.run_time.isoformat(),
            action="given back to pending" if given_back else "left as it is (settled)",
        )
        return Outcome.SKIPPED

    def _hold_key(self, key: str) -> _KeyHold:
        """Register this attempt as the newest holder of its ledger key here; the
        previous holder, if any, is what it waits for (``_wait_for_key``)."""
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        previous = self._keys.get(key)
        self._keys[key] = mine
        return _KeyHold(self._keys, key, mine, previous)

    async def _wait_for_key(
        self,
        ref: JobRef,
        job: LockedJob,
        previous: asyncio.Future[None],
        slot: HandlerSlot | None,
    ) -> LockedJob | None:
        """Another attempt in this executor holds the same ledger key and has not
        committed its outcome yet: wait until it has, then read the row and the ledger
        again (no guard lock: this attempt holds its own), so that this attempt sees the
        key exactly as ``begin`` would have had it started after the other one's commit.

        Why: a slot is freed when its handler returns (``workers.slots``), so at
        ``--concurrency 1`` the next delivery's ``begin`` can run before the previous
        one's ledger row committed. Run then, a second job with the same key would race
        the first one's effect (a unique violation in its handler, a failed attempt
        instead of a duplicate; docs/benchmarks.md, "A slot is a running handler").
        Waiting here costs nothing to a delivery whose key no other attempt here holds
        (every job without an idempotency key has its own, ``job:<id>``), and one read
        to the rare one that waited. The slot is given back meanwhile (it is not a
        running handler), and the attempt heartbeats, since the other one may run long.
        Across worker processes the ledger still decides at commit, and a failure that
        lost to another holder of the key is settled as a duplicate
        (``Settler.settle``)."""
        if slot is not None:
            slot.release()
        log.info("delivery_waits_for_key", idempotency_key=job.key)
        async with self._alive(ref):
            await asyncio.shield(previous)
        try:
            (fresh,) = await self._store.begin([ref])
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise DatabaseUnavailable(f"{type(exc).__name__}: {exc}") from exc
        return fresh

    def _running_elsewhere(self, redelivered: bool) -> Outcome:
        """Another worker process holds this attempt's guard: it is running there.

        A copy that arrives fresh (a duplicate or forged publish) is acked without a run:
        the runner holds its own message and settles the row, or requeues its message if
        it cannot, and if the runner dies its message is redelivered (the broker) or the
        row published again (the reconciler). A *redelivered* copy is requeued for later
        instead: it may be the dead runner's own message, redelivered before PostgreSQL
        ended the runner's session and released its guard, and acking it would leave the
        job to the reconciler's visibility timeout. Requeued, it finds the guard free (and
        runs) or the row settled (and is dropped); a copy that keeps finding the attempt
        running is dead-lettered by the queue's delivery limit, and the row stays the
        reconciler's. Only the broker sets ``redelivered``, so forged copies cannot make
        themselves cycle."""
        DELIVERIES_DROPPED.labels(self.shard, "running").inc()
        log.warning(
            "delivery_duplicate_running",
            where="another worker",
            action="requeued for later" if redelivered else "acked without running",
        )
        if redelivered:
            raise AttemptRunningElsewhere("the attempt is running in another worker")
        return Outcome.SKIPPED

    async def _begin(self, items: list[tuple[JobRef, int]]) -> list[LockedJob | Unreadable | None]:
        """``begin`` for a batch. A row the client cannot read (a payload nested deeper
        than the JSON parser goes, a value Python cannot hold) would fail every batch it
        is in, and requeue them all forever: such a batch is read again row by row, and
        the unreadable row alone is parked.

        Only a decode error (``_row_unreadable``) leads there: any other failure (the
        connection closed or broken under the statement, asyncpg's client state machine,
        a timeout, any server error) proves nothing about a row, so it propagates and the
        whole batch is requeued (``DatabaseUnavailable``); nothing is re-read on the
        connection that failed."""
        try:
            return list(await self._store.begin([r for r, _ in items], [e for _, e in items]))
        except Exception as exc:
            if not _row_unreadable(exc):
                raise
            if len(items) == 1:
                return [Unreadable(f"{type(exc).__name__}: {str(exc)[:300]}")]
            log.warning(
                "begin_batch_unreadable",
                deliveries=len(items),
                error=f"{type(exc).__name__}: {str(exc)[:300]}",
                next_step="read the batch row by row and park the unreadable rows",
            )
        found: list[LockedJob | Unreadable | None] = []
        for item in items:
            found.extend(await self._begin([item]))
        return found

    async def _park(self, ref: JobRef, row: Unreadable) -> Outcome:
        error = f"the worker cannot read this job's row: {row.reason}"
        try:
            parked = await self._store.mark_dead(ref, error)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise DatabaseUnavailable(f"{type(exc).__name__}: {exc}") from exc
        log.error("job_row_unreadable", error=error, parked=parked)
        return Outcome.DEAD if parked else Outcome.SKIPPED

    async def _attempt(self, attempt: Attempt, slot: HandlerSlot | None = None) -> Outcome:
        """Run and settle the attempt, inside its span when the application traces
        (``scheduler.tracing``: nothing without OpenTelemetry)."""
        ref, job = attempt.ref, attempt.job
        span = tracing.attempt_span(
            job_id=ref.job_id,
            attempt=ref.attempt,
            task=job.task,
            destination=QUEUE_PREFIX + job.queue,
            message_id=message_id(ref.job_id, ref.attempt),
            traceparent=job.traceparent,
            due_at=ref.due_at,
            enqueued_at=job.enqueued_at,
        )
        if span is None:
            return await self._settle_attempt(attempt, None, slot)
        with span:
            outcome = await self._settle_attempt(attempt, span, slot)
            span.outcome(outcome.value)
            return outcome

    async def _settle_attempt(
        self, attempt: Attempt, span: tracing.AttemptSpan | None, slot: HandlerSlot | None
    ) -> Outcome:
        """Run the attempt and settle it through the settler. How it commits is chosen
        once, here: a transaction group only for a task that may share one; an attempt
        rolled back with its group (``RERUN``) runs again in a transaction of its own."""
        spec = attempt.spec
        if slot is not None and (attempt.job.done or spec is None):
            slot.release()  # no handler runs: settling it is no running handler
        if attempt.job.done:  # the ledger holds the key: the effect was applied before
            return await self._settle(attempt, Verdict.DUPLICATE)
        if spec is None:
            unknown = UnknownTask(self._registry.unknown_message(attempt.job.task))
            if span is not None:
                span.failed(unknown)
            return await self._settle(attempt, Verdict.FAILED, unknown)
        grouped = self._groupable(spec)
        while True:
            if slot is not None:
                await self._take_slot(attempt.ref, slot)  # again for a rerun: at most N
            if self.cancellations.heard(attempt.ref.job_id):
                if slot is not None:
                    slot.release()
                log.info("handler_not_started", reason="cancelled while it waited")
                cancelled = HandlerCancelled("the job was cancelled before its handler started")
                return await self._settle(attempt, Verdict.FAILED, cancelled)
            verdict, failure = await self._run(attempt, spec, grouped=grouped, slot=slot)
            if span is not None and failure is not None:
                span.failed(failure)
            outcome = await self._settler.settle(attempt, verdict, failure)
            if outcome is not None:
                return outcome
            grouped = False

    async def _take_slot(self, ref: JobRef, slot: HandlerSlot) -> None:
        """Take a handler slot for a begun delivery. One that has to wait (N handlers
        run) is alive, not stuck: it heartbeats like a running job (the reconciler
        would otherwise publish it again after the visibility timeout), and a cancel
        heard meanwhile is kept until it gets the slot (``Cancellations.waiting``)."""
        if slot.free():
            await slot.acquire()  # a permit is free: taken without waiting
            return
        DELIVERIES_WAITING.inc()
        try:
            async with self._alive(ref):
                with self.cancellations.waiting(ref.job_id):
                    await slot.acquire()
        finally:
            DELIVERIES_WAITING.dec()

    def _heartbeat(self, ref: JobRef) -> Heartbeat:
        """The attempt's heartbeat (not started); its beats log with the delivery's
        bound job fields."""
        return Heartbeat(
            self._store,
            job_id=ref.job_id,
            due_at=ref.due_at,
            attempt=ref.attempt,
            interval=self._heartbeat_interval,
            log=log,
        )

    @contextlib.asynccontextmanager
    async def _alive(self, ref: JobRef) -> AsyncIterator[None]:
        """Heartbeat the attempt while it waits (for a slot, for its key's holder): it is
        alive, and the reconciler must not publish it again."""
        heartbeat = self._heartbeat(ref)
        heartbeat.start()
        try:
            yield
        finally:
            await heartbeat.stop()

    async def _settle(
        self, attempt: Attempt, verdict: Verdict, failure: BaseException | None = None
    ) -> Outcome:
        outcome = await self._settler.settle(attempt, verdict, failure)
        assert outcome is not None  # only a group's RERUN settles nothing
        return outcome

    async def _run(
        self, attempt: Attempt, spec: TaskSpec, *, grouped: bool, slot: HandlerSlot | None = None
    ) -> tuple[Verdict, BaseException | None]:
        """Run the handler once and commit as chosen: the verdict, and the handler's
        failure if it raised (or the server refused its transaction)."""
        db = LazyTransaction(
            self._pool,
            timeout=self._acquire_timeout,
            groups=self._groups if grouped else None,
            completion=attempt.completion,
        )
        try:
            try:
                failure, result = await self._run_handler(attempt, spec, db)
            finally:
                if slot is not None:
                    slot.release()  # the handler returned: its outcome settles meanwhile
            if result is not None:
                attempt = dataclasses.replace(attempt, result=result)
            if db.member is not None:  # a share of a transaction group
                db.member.completion = attempt.completion
                return await db.member.report(failure), failure
            if failure is not None:
                return Verdict.FAILED, failure
            if db.opened:  # its own transaction
                return await self._finish_in_transaction(attempt, db)
        finally:
            await db.close()
        # never used ctx.db: batched with the others that finished meanwhile
        committed = await self._settler.complete(attempt)
        return (Verdict.COMMITTED if committed else Verdict.SUPERSEDED), None

    async def _finish_in_transaction(
        self, attempt: Attempt, db: LazyTransaction
    ) -> tuple[Verdict, BaseException | None]:
        """Succeeded + ledger row + COMMIT in the handler's transaction, one round trip.
        A refusal (the row moved on, the key recorded first by another delivery) rolls
        the handler's writes back; a server error is the handler's failure."""
        finish = self._store.finish_statement(attempt.completion, self._worker)
        try:
            try:
                await db.commit(finish)  # one round trip: finish, then COMMIT
            except asyncpg.PostgresError as exc:
                found = self._store.finish_refusal(exc)
                if found is None:
                    raise
                await db.close()  # roll back the handler's writes
                return (Verdict.DUPLICATE if found.settled else Verdict.SUPERSEDED), None
        except asyncio.CancelledError:
            raise
        except CONNECTION_ERRORS as exc:
            raise DatabaseUnavailable(f"{type(exc).__name__}: {exc}") from exc
        except asyncpg.PostgresError as exc:  # the server refused: the handler's fault
            return Verdict.FAILED, exc
        return Verdict.COMMITTED, None

    async def _run_handler(
        self, attempt: Attempt, spec: TaskSpec, db: LazyTransaction
    ) -> tuple[BaseException | None, str | None]:
        """Run the handler under its timeout, stoppable by a cancel; return its
        exception (or None) and its encoded result (or None)."""
        ref, job = attempt.ref, attempt.job
        heartbeat = self._heartbeat(ref)
        ctx = JobContext(
            job_id=ref.job_id,
            attempt=ref.attempt,
            max_attempts=attempt.max_attempts,
            due_at=ref.due_at,
            task=job.task,
            queue=job.queue,
            idempotency_key=job.key,
            db=db,
            beat=heartbeat.beat,
            cancelled=threading.Event(),
            progress=(progress := Progress(self._store, ref, clock=self._clock)).report,
            state=self._registry.lifecycle.state,
            dependencies=dependencies_from(job.dependencies),
        )
        clock = self._clock
        fire_lag = (clock.now() - job.run_time).total_seconds()
        FIRE_LAG.labels(self.shard).observe(max(0.0, fire_lag))
        timeout = job.timeout_s or (
            spec.timeout if spec.timeout is not None else self._task_timeout
        )
        started = clock.monotonic()
        heartbeat.start()
        try:
            async with (
                asyncio.timeout(timeout) as deadline,
                self.cancellations.scope(ref.job_id, ctx.cancelled),
            ):
                if spec.sync:  # a plain def: on a handler thread, same ctx.db transaction
                    value = await self._thread_runner().run_handler(
                        spec.handler, ctx, job.payload, timeout=timeout
                    )
                else:
                    value = await cast(AsyncHandler, spec.handler)(ctx, job.payload)
            return None, encode_result(value, self._result_max_bytes)
        except Exception as exc:
            if isinstance(exc, TimeoutError) and deadline.expired():
                return TimeoutError(f"handler exceeded its timeout of {timeout:g}s"), None
            return exc, None
        finally:
            await heartbeat.stop()
            await progress.close()
            took = clock.monotonic() - started
            JOB_DURATION.labels(self.shard, spec.name).observe(took)
            self._learn(spec.name, took - (db.member.waited if db.member is not None else 0.0))


@dataclass(slots=True)
class _KeyHold:
    """One attempt's hold on its ledger key in an executor (``Executor._hold_key``):
    ``release`` once its outcome committed (or it ended without one) wakes the next
    attempt with the same key."""

    keys: dict[str, asyncio.Future[None]]
    key: str
    mine: asyncio.Future[None]
    previous: asyncio.Future[None] | None

    def release(self) -> None:
        if not self.mine.done():
            self.mine.set_result(None)
        if self.keys.get(self.key) is self.mine:
            del self.keys[self.key]


def _still_dispatched(job: LockedJob, attempt: int) -> bool:
    return job.status == "dispatched" and job.attempt == attempt


def _skipped(
    job: LockedJob | None, msg: JobMessage, *, reason: str | None = None, **extra: object
) -> Outcome:
    log.info(
        "delivery_skipped",
        status=None if job is None else job.status,
        current_attempt=None if job is None else job.attempt,
        reason=reason or ("missing" if job is None else "stale"),
        message_epoch=msg.epoch,
        **extra,
    )
    return Outcome.SKIPPED
