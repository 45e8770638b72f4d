"""ExecutionStore: every statement a worker runs (DESIGN §6; SQL in ``execution.sql``).

Deliveries are read and completed in batches (``begin``/``complete``: one statement for
many jobs, in autocommit); ``begin`` runs on the guard connection, which holds the lock
of every attempt it started until ``release`` (``scheduler.store.execution_guard``). An
attempt whose handler used ``ctx.db`` finishes inside its own transaction
(``finish_statement``, sent with its COMMIT), on the caller's connection.
Failure outcomes (``schedule_retry``, ``mark_dead``) and ``heartbeat`` run on pooled
connections of their own: a failure is rare, and a sign of life must be visible while a
handler still runs.

Every statement calls a function of migration 0009 (0012 for the guard) that settles
only a row dispatched at the attempt named, and writes the ledger row from that row (its
``effective_key`` and task): a ``Completion``'s ``key`` and ``task`` are what the worker
shows the handler and matches on, never what the database records.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import asyncpg

from scheduler.sql import load
from scheduler.store.conn import Conn, Pooled
from scheduler.store.execution_guard import AttemptGuard
from scheduler.store.rows import Completion, Finish, JobRef, LockedJob, from_record

Q = load("execution")
#: The SQLSTATEs with which ``duetime.finish_attempt`` refuses (migration 0009).
ROW_MOVED_ON = "DT001"
KEY_RECORDED = "DT002"


def quote_literal(text: str) -> str:
    """``text`` as a PostgreSQL string literal, whatever standard_conforming_strings
    says: an escape string (``E'...'``) with its backslashes and quotes escaped, the rule
    of PostgreSQL's own ``quote_literal``. Only for statements that must travel as text
    (several in one round trip); everything else is sent as parameters."""
    if "\x00" in text:
        raise ValueError("a PostgreSQL string cannot hold a NUL character")
    return "E'" + text.replace("\\", "\\\\").replace("'", "''") + "'"


def _columns(items: Sequence[Completion]) -> tuple[list[Any], ...]:
    """The array arguments of the batched completions: ids, due times, attempts (in that
    order, as the functions unnest them), and the results (JSON text, None for none)."""
    return (
        [c.ref.job_id for c in items],
        [c.ref.due_at for c in items],
        [c.ref.attempt for c in items],
        [c.result for c in items],
    )


class ExecutionStore:
    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        timeout: float = 10.0,
        budgets: Mapping[str, int] | None = None,
    ) -> None:
        """``budgets``: task -> max_attempts of the tasks registered with their own
        (``Registry.budgets()``). A failure outcome writes the budget that applied into the
        row's ``max_attempts`` (the registry's number replaces the row's), so the row says
        what the worker decided with."""
        self._db = Pooled(pool, acquire_timeout=timeout)
        self._budgets = json.dumps(dict(budgets or {}), sort_keys=True)
        self.guard = AttemptGuard(
            self._db, begin_sql=Q["begin_deliveries"], release_sql=Q["release_guards"], slots=4
        )

    async def begin(
        self, refs: Sequence[JobRef], epochs: Sequence[int] | None = None
    ) -> list[LockedJob | None]:
        """Read the rows of ``refs`` (one statement; waits for in-flight claims), taking
        the guard lock of every attempt that is its message's to run (``epochs``: the
        messages' dispatch epochs; ``LockedJob.started``; without them, a read that takes
        no lock). The result is aligned with ``refs``: None where the job does not exist.
        Every attempt started here must be ``release``d once its outcome committed or it
        ended without one."""
        records = await self.guard.begin(
            [r.job_id for r in refs],
            [r.due_at for r in refs],
            [r.attempt for r in refs],
            list(epochs) if epochs is not None else [None] * len(refs),
        )
        found: list[LockedJob | None] = [None] * len(refs)
        for record in records:
            found[record["i"] - 1] = from_record(LockedJob, record)
        return found

    def release(self, ref: JobRef, epoch: int) -> None:
        """Release the guard lock ``begin`` took for this attempt (batched, not awaited)."""
        self.guard.release((ref.job_id, ref.attempt, epoch))

    async def ping(self) -> None:
        """Raise unless PostgreSQL answers a trivial query on a pooled connection (the
        probe of ``workers.outage``)."""
        async with self._db.acquire() as conn:
            await conn.fetchval(Q["ping"])

    async def close(self) -> None:
        """Release every guard lock and give the guard connection back to the pool."""
        await self.guard.close()

    async def complete(self, items: Sequence[Completion], worker: str) -> set[int]:
        """Settle ``items`` as succeeded with their ledger rows, in one statement. Returns
        the job ids that were still this attempt's (the others moved on meanwhile)."""
        job_ids, due, attempts, results = _columns(items)
        async with self._db.acquire() as conn:
            settled = await conn.fetchval(
                Q["complete_deliveries"], job_ids, due, attempts, worker, results
            )
        return set(settled)

    @staticmethod
    def finish_statement(completion: Completion, worker: str) -> str:
        """The statement that settles an attempt inside its own transaction (succeeded +
        ledger row), as text with its values quoted in, so that the caller can send it
        with its COMMIT in one round trip (``LazyTransaction.commit``). What it refuses
        is an error that ``finish_refusal`` reads."""
        ref = completion.ref
        if ref.due_at.tzinfo is None:
            raise ValueError(f"job {ref.job_id}: due_at must carry a time zone")
        return Q["finish_attempt"].format(
            id=int(ref.job_id),
            due_at=quote_literal(ref.due_at.isoformat()),
            attempt=int(ref.attempt),
            worker=quote_literal(worker),
            result="NULL" if completion.result is None else quote_literal(completion.result),
        )

    @staticmethod
    def finish_refusal(exc: BaseException) -> Finish | None:
        """What a refused ``finish_statement`` means (see ``Finish``), or None when the
        error is not one of its verdicts."""
        code = getattr(exc, "sqlstate", None)
        if code == ROW_MOVED_ON:
            return Finish(settled=False, recorded=False)
        if code == KEY_RECORDED:
            return Finish(settled=True, recorded=False)
        return None

    async def finish_group(
        self, conn: Conn, completions: Sequence[Completion], worker: str
    ) -> list[Finish]:
        """``finish`` for many attempts in one statement, in the caller's transaction;
        aligned with ``completions`` (which must not repeat a key). ``recorded``: this
        attempt's ledger row was inserted."""
        ids, due, attempts, results = _columns(completions)
        records = await conn.fetch(
            Q["finish_group"], ids, due, attempts, worker, min(due), max(due), results
        )
        return [Finish(settled=r["settled"], recorded=r["recorded"]) for r in records]

    async def schedule_retry(self, ref: JobRef, *, delay: float, error: str) -> datetime | None:
        """dispatched → pending with attempt + 1, runnable after ``delay`` seconds.
        Returns the new run time, or None if the row is no longer this attempt's.

        No NOTIFY: the dispatcher's probe finds the new run time ahead of it, and a
        NOTIFY here would serialise worker commits on PostgreSQL's notify lock exactly
        when a failure storm retries thousands of jobs (migrations/0004_wakeups.sql)."""
        async with self._db.acquire() as conn:
            run_at = await conn.fetchval(
                Q["schedule_retry"],
                ref.job_id,
                ref.due_at,
                ref.attempt,
                float(delay),
                error,
                self._budgets,
            )
        return run_at  # type: ignore[no-any-return, unused-ignore]

    async def mark_dead(self, ref: JobRef, error: str) -> bool:
        """dispatched → dead with ``error``; False if the row moved on meanwhile."""
        async with self._db.acquire() as conn:
            value = await conn.fetchval(
                Q["mark_dead"], ref.job_id, ref.due_at, ref.attempt, error, self._budgets
            )
        return bool(value == 1)

    async def snooze(self, ref: JobRef, *, delay: float) -> int | None:
        """dispatched → pending at the same attempt, runnable after ``delay`` seconds
        (``Snooze``): the job's snooze count now, 0 when it is at its ``max_snoozes``
        (nothing changed), None when the row is no longer this attempt's."""
        async with self._db.acquire() as conn:
            value = await conn.fetchval(
                Q["snooze"], ref.job_id, ref.due_at, ref.attempt, float(delay)
            )
        return None if value is None else int(value)

    async def unstage(self, ref: JobRef, epoch: int) -> bool:
        """A staged attempt whose row was moved to a later run time: dispatched →
        pending (migration 0028), so the dispatcher stages it again for that time.
        False when the row is no longer this attempt's and dispatch's."""
        async with self._db.acquire() as conn:
            value = await conn.fetchval(
                Q["unstage"],
                [ref.job_id],
                [ref.due_at],
                [ref.attempt],
                [epoch],
                timeout=self._db.timeout,
            )
        return value is not None

    async def progress(self, ref: JobRef, fraction: float, note: str | None) -> bool:
        """Record how far a running attempt got (``workers.progress``), on a connection
        of its own; False when the row is no longer this attempt's."""
        async with self._db.acquire() as conn:
            value = await conn.fetchval(
                Q["progress"], ref.job_id, ref.due_at, ref.attempt, fraction, note,
                timeout=self._db.timeout,
            )  # fmt: skip
        return bool(value == 1)

    async def cancelled(self, job_ids: Sequence[int]) -> set[int]:
        """Which of ``job_ids`` are cancelled (``workers.cancel``)."""
        async with self._db.acquire() as conn:
            ids = await conn.fetchval(Q["cancelled"], list(job_ids), timeout=self._db.timeout)
        return set(ids)

    async def heartbeat(self, job_id: int, due_at: datetime, attempt: int) -> bool:
        """Set heartbeat_at = now() on a connection of its own (autocommit). False when
        the job is no longer this attempt's (finished elsewhere or superseded)."""
        async with self._db.acquire() as conn:
            value = await conn.fetchval(
                Q["heartbeat"], job_id, due_at, attempt, timeout=self._db.timeout
            )
        return bool(value == 1)


def _epoch() -> datetime:
    return datetime.fromtimestamp(0).astimezone()


async def prepare_store_connection(conn: asyncpg.Connection) -> None:
    """Prepare the worker's own statements on a new connection of its store pool, so the
    first deliveries after start-up pay for no parsing or planning (each runs once with
    job id 0, which matches nothing and changes nothing)."""
    await conn.fetch(Q["begin_deliveries"], [0], [_epoch()], [0], [0], [], [], [])
    await conn.fetchval(Q["complete_deliveries"], [0], [_epoch()], [0], "", [None])
    await conn.fetchval(Q["schedule_retry"], 0, _epoch(), 0, 0.0, "", "{}")
    await conn.fetchval(Q["mark_dead"], 0, _epoch(), 0, "", "{}")
    await conn.fetchval(Q["heartbeat"], 0, _epoch(), 0)


async def prepare_handler_connection(conn: asyncpg.Connection) -> None:
    """The same for a handler connection: the statement that finishes an attempt in the
    handler's transaction."""
    with contextlib.suppress(asyncpg.PostgresError):  # job 0 is no attempt's: DT001
        await conn.execute(
            ExecutionStore.finish_statement(Completion(JobRef(0, _epoch(), 0), "", ""), "")
        )
    await conn.fetch(Q["finish_group"], [0], [_epoch()], [0], "", _epoch(), _epoch(), [None])
