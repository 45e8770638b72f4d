"""The one seam where an attempt settles: every verdict becomes one outcome, one log line
and one metric.

However an attempt committed — in a batch with others (its handler never used
``ctx.db``), in its own transaction (``finish_attempt`` sent with the COMMIT), or in a
transaction group (``workers.groups``) — what happened to it is one ``Verdict``:

=========== ====================================== =================== =================
verdict     meaning                                outcome             log line
=========== ====================================== =================== =================
COMMITTED   succeeded, its ledger row committed    ``succeeded``       ``job_succeeded``
DUPLICATE   the key was in the ledger: the effect  ``skipped``         ``delivery_duplicate``
            was applied before; the row is
            settled as succeeded. Also a
            FAILED attempt that lost to another
            holder of its key (``_key_applied``)
SUPERSEDED  the row moved on (settled by another   ``skipped``         ``attempt_superseded``
            delivery, or a newer attempt)
FAILED      the handler raised (or the server      ``retried``/``dead`` ``job_retry_scheduled``
            refused its transaction): retry or     (``skipped`` if the /``job_dead``
            dead (``workers.retry.decide``)        row moved on)
            ... with ``HandlerCancelled``: the     ``cancelled``       ``job_cancelled``
            job was cancelled while it ran
            (``workers.cancel``); nothing to write
            ... with ``Snooze``: pending again at  ``snoozed``         ``job_snoozed``
            the same attempt (``workers.snooze``); (``retried``/``dead``
            past ``max_snoozes`` a failure         past the bound)
RERUN       rolled back with its transaction       none: run again     ``attempt_rerun_alone``
            group through no fault of its own      alone
=========== ====================================== =================== =================

``Settler.settle`` is the only place that writes those outcomes and lines, and counts
``duetime_jobs_finished_total`` once per settled attempt. The job's fields (id,
attempt, task) are not passed around: the executor binds them to the logger once per
delivery (``structlog.contextvars``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from scheduler.log import get_logger
from scheduler.metrics import JOBS_FINISHED
from scheduler.store.execution import ExecutionStore
from scheduler.store.rows import Completion, JobRef, LockedJob
from workers.batching import Coalescer
from workers.cancel import HandlerCancelled
from workers.errors import DatabaseUnavailable
from workers.registry import TaskSpec
from workers.retry import DEFAULT_RETRY, GiveUp, RetryLater, RetryPolicy, decide, describe
from workers.snooze import Snooze, SnoozeLimitReached
from workers.verdicts import Outcome, Verdict

log = get_logger("duetime.worker")

#: Deliveries completed per batched statement.
BATCH_SIZE = 256

#: Errors with which PostgreSQL refuses a *value* (out of range, violates a CHECK):
#: recording the same outcome again cannot succeed, so the job is parked as dead instead
#: of being requeued forever.
_REFUSED_VALUE = (asyncpg.DataError, asyncpg.IntegrityConstraintViolationError)


class UnknownTask(Exception):
    """The row names a task this worker has not registered (a rolling deploy, a typo)."""


@dataclass(frozen=True, slots=True)
class Attempt:
    """One attempt being settled: its pointer, its row, and its task (None: unknown)."""

    ref: JobRef
    job: LockedJob
    spec: TaskSpec | None
    #: the handler's result as JSON text (``workers.results``), once it returned
    result: str | None = None

    @property
    def completion(self) -> Completion:
        return Completion(self.ref, self.job.key, self.job.task, self.result)

    @property
    def policy(self) -> RetryPolicy:
        return self.spec.retry if self.spec is not None else DEFAULT_RETRY

    @property
    def max_attempts(self) -> int:
        """The attempt budget that applies: the task's own, else the row's."""
        if self.spec is None:
            return self.job.max_attempts
        return self.spec.attempts_allowed(self.job.max_attempts)


class Settler:
    """Settles attempts (module docstring). Owns the batched completion, which
    ``close()`` stops.

    ``shard`` labels the metric; ``rng`` draws the retry jitter (tests fix it)."""

    def __init__(
        self,
        store: ExecutionStore,
        *,
        worker: str,
        shard: str,
        rng: random.Random | None = None,
    ) -> None:
        self._store = store
        self._worker = worker
        self._shard = shard
        self._rng = rng
        self.completions: Coalescer[Completion, bool] = Coalescer(
            self._complete, name="complete", max_batch=BATCH_SIZE
        )

    async def close(self) -> None:
        await self.completions.close()

    async def complete(self, attempt: Attempt) -> bool:
        """Settle as succeeded with its ledger row, batched with the other attempts that
        finished meanwhile (one statement). False: the row moved on."""
        try:
            return await self.completions.submit(attempt.completion)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise DatabaseUnavailable(f"{type(exc).__name__}: {exc}") from exc

    async def _complete(self, items: list[Completion]) -> list[bool]:
        settled = await self._store.complete(items, self._worker)
        return [c.ref.job_id in settled for c in items]

    async def settle(
        self, attempt: Attempt, verdict: Verdict, failure: BaseException | None = None
    ) -> Outcome | None:
        """Write what ``verdict`` means for ``attempt``, log it, count it. None only for
        ``RERUN``: nothing is settled, the caller runs the attempt again alone."""
        if verdict is Verdict.FAILED and failure is None:
            verdict = Verdict.RERUN  # a group member that failed through no fault of its own
        if verdict is Verdict.RERUN:
            log.info("attempt_rerun_alone")
            return None
        if verdict is Verdict.COMMITTED:
            log.debug("job_succeeded")
            outcome = Outcome.SUCCEEDED
        elif verdict is Verdict.SUPERSEDED:
            log.warning("attempt_superseded")
            outcome = Outcome.SKIPPED
        elif verdict is Verdict.DUPLICATE or (
            verdict is Verdict.FAILED
            and not isinstance(failure, (HandlerCancelled, Snooze))
            and await self._key_applied(attempt)
        ):
            settled = await self.complete(attempt)
            log.info(
                "delivery_duplicate",
                idempotency_key=attempt.job.key,
                settled=settled,
                **({"failure": describe(failure)} if failure is not None else {}),
            )
            outcome = Outcome.SKIPPED
        elif isinstance(failure, HandlerCancelled):
            log.info("job_cancelled", effects="rolled back")
            outcome = Outcome.CANCELLED
        elif isinstance(failure, Snooze):
            outcome = await self._snooze(attempt, failure)
        else:
            assert failure is not None
            outcome = await self._fail(attempt, failure)
        label = attempt.job.task if attempt.spec is not None else "unknown"
        JOBS_FINISHED.labels(self._shard, label, outcome.value).inc()
        return outcome

    async def _key_applied(self, attempt: Attempt) -> bool:
        """Whether another job holding this attempt's ledger key committed meanwhile (the
        ledger holds the key now, the row is still this attempt's): a failed attempt that
        lost to a concurrent holder of its key — its handler's write hit that job's
        effect (a unique violation), or its own commit did — is a duplicate, settled as
        if ``begin`` had found the key, never a failed attempt. Its ``ctx.db`` work was
        rolled back before this (the failure's transaction). A job whose key is its own
        default (``job:<id>``) has no other holder and pays no read; any other failure
        pays one ``begin`` read (no guard lock: the attempt holds its own)."""
        if attempt.spec is None or attempt.job.key == f"job:{attempt.ref.job_id}":
            return False
        try:
            (row,) = await self._store.begin([attempt.ref])
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise DatabaseUnavailable(f"{type(exc).__name__}: {exc}") from exc
        return (
            row is not None
            and row.done
            and row.status == "dispatched"
            and row.attempt == attempt.ref.attempt
        )

    async def _snooze(self, attempt: Attempt, snooze: Snooze) -> Outcome:
        """Pending again at the same attempt after the snooze's delay; past the row's
        ``max_snoozes``, a failed attempt like any other."""
        try:
            count = await self._store.snooze(attempt.ref, delay=snooze.delay)
        except asyncio.CancelledError:
            raise
        except Exception as failed:
            # like ``failure_not_recorded``: the delivery goes back and runs again
            log.warning("snooze_not_recorded", error=describe(failed))
            raise DatabaseUnavailable(f"{type(failed).__name__}: {failed}") from failed
        if count is None:
            log.warning("attempt_superseded", snooze=True)
            return Outcome.SKIPPED
        if count == 0:
            limit = SnoozeLimitReached(
                "the job asked to snooze past its max_snoozes; "
                "raise Retry to try again and count it, or raise max_snoozes"
            )
            return await self._fail(attempt, limit)
        log.info("job_snoozed", snoozes=count, snooze_in=round(snooze.delay, 3))
        return Outcome.SNOOZED

    async def _fail(self, attempt: Attempt, exc: BaseException) -> Outcome:
        """Record a failed attempt: pending at the next attempt, or dead."""
        ref = attempt.ref
        decision = decide(
            exc,
            attempt=ref.attempt,
            max_attempts=attempt.max_attempts,
            policy=attempt.policy,
            rng=self._rng,
        )
        if isinstance(exc, UnknownTask):  # its message says all: no exception type
            decision = dataclasses.replace(decision, error=str(exc))
        # a traceback is logged when it can be: an exception whose str() raised or is
        # huge is summarised by ``describe`` instead (it must not break the log line)
        exc_info = exc if len(decision.error) < 2000 and not isinstance(exc, UnknownTask) else None
        run_at: datetime | None = None
        try:
            if isinstance(decision, RetryLater):
                try:
                    run_at = await self._store.schedule_retry(
                        ref, delay=decision.delay, error=decision.error
                    )
                except _REFUSED_VALUE as refused:
                    decision = GiveUp(
                        f"{decision.error} (the retry could not be recorded: {describe(refused)})"
                    )
                    recorded = await self._store.mark_dead(ref, decision.error)
                else:
                    recorded = run_at is not None
            else:
                recorded = await self._store.mark_dead(ref, decision.error)
        except asyncio.CancelledError:
            raise
        except Exception as failed:
            # no traceback: the delivery goes back once the database answers
            # (``delivery_requeued``), runs again as the same attempt, and its failure is
            # logged with its traceback when it is recorded. An outage fails every
            # delivery at once; a traceback each buried ``database_unreachable``.
            log.warning("failure_not_recorded", error=decision.error, cause=describe(failed))
            raise DatabaseUnavailable(f"{type(failed).__name__}: {failed}") from failed
        if not recorded:
            log.warning("attempt_superseded", error=decision.error)
            return Outcome.SKIPPED
        if isinstance(decision, GiveUp):
            log.error("job_dead", exc_info=exc_info, error=decision.error)
            return Outcome.DEAD
        log.warning(
            "job_retry_scheduled",
            exc_info=exc_info,
            error=decision.error,
            retry_in=round(decision.delay, 3),
            run_at=run_at.isoformat() if run_at else None,
        )
        return Outcome.RETRIED
