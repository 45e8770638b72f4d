"""JobStore: the producer-facing job API (enqueue, bulk enqueue, get, list, cancel, retry).

Every method is async and takes its connection from the pool it was built with; pass
``conn=`` to run inside a caller's transaction (enqueue a job atomically with your own
writes — the transactional-outbox pattern that makes duetime safe to publish from).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

import asyncpg

from scheduler.clock import SYSTEM_CLOCK, Clock
from scheduler.config import DEFAULT_DB_TIMEOUT
from scheduler.errors import InvalidInput, InvalidTransition, JobNotFound, UniqueKeyTaken
from scheduler.jobspec import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_QUEUE,
    JobSpec,
    resolve_due,
    validate_limit_key,
    validate_unique_key,
)
from scheduler.metrics import JOBS_CANCELLED, UNIQUE_CONFLICTS
from scheduler.sql import compose, load
from scheduler.store.conn import Conn, PooledStore
from scheduler.store.job_filter import FILTERS, JobFilter, filter_for, planned_for
from scheduler.store.outcomes import wait_for_outcome
from scheduler.store.rows import JOB_STATUSES, BulkPreview, Job
from scheduler.store.workflows import Q as WQ
from scheduler.store.workflows import insert_workflow
from scheduler.tracing import current_traceparent
from scheduler.workflow import Workflow, WorkflowJobs

#: ``BulkPreview`` is a row type (``rows``), re-exported: the public API imports it from here.
__all__ = [
    "MAX_PAGE",
    "NOTIFY_HORIZON",
    "BulkPreview",
    "JobFilter",
    "JobStore",
    "filter_for",
]

Q = load("jobs")
LIST = {tagged: compose("jobs", "list", filter=FILTERS[tagged]) for tagged in (False, True)}

#: Jobs due within this many seconds of now get a NOTIFY so the dispatcher wakes at
#: once; later ones are found ahead of time by its probe (migrations/0004_wakeups.sql).
NOTIFY_HORIZON = timedelta(seconds=1)

BULK_COLUMNS = (
    "task", "payload", "due_at", "queue", "max_attempts", "idempotency_key", "traceparent",
)  # fmt: skip
#: BULK_COLUMNS with tags and meta: COPYed only when a job of the batch has either, so a
#: bulk enqueue that uses neither sends what it sent before.
TAGGED_COLUMNS = (*BULK_COLUMNS, "tags", "meta")
MAX_PAGE = 10_000
#: Ids per transaction of a bulk cancel/retry: short transactions, so the dispatcher's
#: SKIP LOCKED claim and the workers are never held up by one large UPDATE.
BULK_BATCH = 1000
#: Job ids per cancel NOTIFY (a payload holds at most 8000 bytes).
CANCEL_NOTIFY_IDS = 300
#: The states a bulk action starts from: only these may be spliced into ``matching``. A
#: cancel takes running (dispatched) jobs too: their workers are told (``_cancel_ids``).
BULK_SOURCE: dict[str, tuple[str, ...]] = {
    "cancel": ("pending", "dispatched", "waiting"),
    "retry": ("dead",),
}

OnConflict = Literal["skip", "replace", "error"]
ON_CONFLICT: tuple[str, ...] = ("skip", "replace", "error")
#: The longest ``unique_for`` window; the trigger refuses longer ones too (migration 0014).
MAX_UNIQUE_FOR = timedelta(days=366)


class JobStore(PooledStore):
    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        acquire_timeout: float = DEFAULT_DB_TIMEOUT,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        """``clock`` is "now" for ``delay=`` and for whether a new job is due soon enough
        to wake the dispatcher (``NOTIFY_HORIZON``)."""
        super().__init__(pool, acquire_timeout=acquire_timeout)
        self._clock = clock

    async def enqueue(
        self,
        task: str,
        payload: dict[str, Any] | None = None,
        *,
        due_at: datetime | None = None,
        delay: timedelta | float | None = None,
        queue: str = DEFAULT_QUEUE,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        idempotency_key: str | None = None,
        unique_key: str | None = None,
        on_conflict: OnConflict = "skip",
        unique_for: timedelta | None = None,
        priority: int = 0,
        limit_key: str | None = None,
        tags: Sequence[str] = (),
        meta: dict[str, Any] | None = None,
        conn: Conn | None = None,
    ) -> Job:
        """Insert one job. ``due_at`` (aware datetime) or ``delay``; neither means now.

        With ``unique_key`` the job holds that key in its queue (for this producer) while
        it is live, and for ``unique_for`` after the enqueue even once finished. When the
        key is already held, ``on_conflict`` decides: ``"skip"`` returns the holder
        unchanged; ``"replace"`` (debounce) gives a pending holder this task, payload and
        run time and returns it (a dispatched holder has started and is returned
        unchanged; a holder due later than this job is cancelled and this job inserted);
        ``"error"`` raises ``UniqueKeyTaken`` naming the holder. In every case the job
        returned is the one holding the key afterwards (docs/api.md "Unique jobs").

        ``priority`` (-100..100, higher first among due jobs of the queue; the database
        refuses others by ``jobs_priority_range``); a replaced holder takes it too.

        ``limit_key``: the key per-key limits count this job under (``duetime limits``;
        docs/api.md "Limits"); a replaced holder keeps its own.

        ``tags``: what the job is about, to find, cancel and retry it by
        (``JobFilter(tags=...)``; at most 32, each 1-64 characters without whitespace,
        comma or control character). ``meta``: a dict of the producer's own kept with
        the job (at most 64 KiB as JSON), never passed to the handler. A replaced holder
        keeps its own of both."""
        call = plan_enqueue(
            task,
            payload,
            now=self._clock.now(),
            due_at=due_at,
            delay=delay,
            queue=queue,
            max_attempts=max_attempts,
            idempotency_key=idempotency_key,
            unique_key=unique_key,
            on_conflict=on_conflict,
            unique_for=unique_for,
            priority=priority,
            limit_key=limit_key,
            tags=tags,
            meta=meta,
        )
        async with self._db.conn(conn) as c:
            job = call.job(await c.fetchrow(Q[call.statement], *call.args))
            if wakes(job, self._clock.now()):
                await c.execute(Q["notify"])
        return job

    async def enqueue_workflow(
        self, workflow: Workflow, *, conn: Conn | None = None
    ) -> WorkflowJobs:
        """Insert every step of ``workflow`` (``duetime.workflow``: ``chain``, ``group``,
        ``chord``, ``Workflow``) in one transaction (the caller's, with ``conn``) under a
        new ``workflow_id``; the jobs come back in step order. Steps that wait are
        ``waiting`` until their dependencies end (migration 0025). One NOTIFY when a
        step is due soon."""
        async with self._db.conn(conn) as c, c.transaction():
            run = await insert_workflow(c, workflow, self._clock.now())
            if any(j.status == "pending" and wakes(j, self._clock.now()) for j in run.jobs):
                await c.execute(Q["notify"])
        return run

    async def workflow(
        self, workflow_id: int, *, limit: int = 10_000, conn: Conn | None = None
    ) -> list[Job]:
        """The jobs of workflow ``workflow_id``, oldest first (at most ``limit``)."""
        if not 1 <= workflow_id <= _BIGINT_MAX:
            return []
        async with self._db.conn(conn) as c:
            records = await c.fetch(WQ["workflow_jobs"], workflow_id, limit)
        return [Job.from_record(r) for r in records]

    async def cancel_workflow(self, workflow_id: int, *, by: str | None = None) -> int:
        """Cancel every unfinished job of the workflow (one transaction, the ``cancel``
        transition: running handlers are told at the commit). Returns how many."""
        if not 1 <= workflow_id <= _BIGINT_MAX:
            return 0
        async with self._db.acquire() as c, c.transaction():
            ids = [r["id"] for r in await c.fetch(WQ["cancel_workflow_ids"], workflow_id)]
            if not ids:
                return 0
            return len(await self._cancel_ids(c, ids, by))

    async def bulk_enqueue(self, specs: Iterable[JobSpec], *, conn: Conn | None = None) -> int:
        """COPY many jobs in one statement (hundreds of thousands per second).

        Jobs without ``due_at`` are due now. Returns the number of rows inserted. One
        NOTIFY follows the COPY when any job is due within ``NOTIFY_HORIZON``.

        Why text COPY built here rather than ``copy_records_to_table``: asyncpg's binary
        COPY needs a binary codec for every column, and jsonb is registered with a text
        codec (``scheduler.db``), so the binary path fails with "no binary format encoder
        for type jsonb". Every row is encoded before the COPY starts, so a payload that
        is not JSON-serialisable is refused with ``InvalidInput`` and nothing is written.
        """
        lines, due_soon, tagged = copy_lines(specs, self._clock.now())
        if not lines:
            return 0
        async with self._db.conn(conn) as c:
            result = await c.copy_to_table(
                "jobs",
                schema_name="duetime",
                columns=list(TAGGED_COLUMNS if tagged else BULK_COLUMNS),
                source=_chunks(lines),
                format="text",
            )
            if due_soon:
                await c.execute(Q["notify"])
        # asyncpg returns the command tag, e.g. "COPY 1000"
        return int(str(result).split()[-1])

    async def get(self, job_id: int, *, conn: Conn | None = None) -> Job:
        if not 1 <= job_id <= _BIGINT_MAX:  # no such row: ids are bigint, from 1
            raise JobNotFound(job_id)
        async with self._db.conn(conn) as c:
            record = await c.fetchrow(Q["get"], job_id)
        if record is None:
            raise JobNotFound(job_id)
        return Job.from_record(record)

    async def list(
        self,
        *,
        status: str | None = None,
        queue: str | None = None,
        task: str | None = None,
        due_from: datetime | None = None,
        due_to: datetime | None = None,
        tags: Sequence[str] = (),
        after_id: int | None = None,
        limit: int = 100,
        conn: Conn | None = None,
    ) -> list[Job]:
        """One page ordered by id; pass the last id as ``after_id`` for the next page.
        ``tags``: only jobs holding every one of them."""
        where = JobFilter(
            status=status, queue=queue, task=task, due_from=due_from, due_to=due_to, tags=tags
        )
        if not 1 <= limit <= MAX_PAGE:
            raise InvalidInput(f"limit must be between 1 and {MAX_PAGE}")
        async with self._db.conn(conn) as c, planned_for(c, where):
            records = await c.fetch(
                LIST[bool(where.tags)], *where.params(), status, after_id, limit
            )
        return [Job.from_record(r) for r in records]

    async def iterate(self, *, page_size: int = 1000, **filters: Any) -> AsyncIterator[Job]:
        """Every job matching ``filters``, page by page (keyset pagination)."""
        after: int | None = None
        while True:
            page = await self.list(after_id=after, limit=page_size, **filters)
            for job in page:
                yield job
            if len(page) < page_size:
                return
            after = page[-1].id

    async def cancel(self, job_id: int, *, by: str | None = None, conn: Conn | None = None) -> Job:
        """pending or dispatched → cancelled, recording ``by`` (default: the database
        role) as ``cancelled_by``. A running job's worker is told at the commit and
        stops its handler within a second, rolling back its ``ctx.db`` work
        (``workers.cancel``). A finished job is refused with the reason."""
        if not 1 <= job_id <= _BIGINT_MAX:
            raise JobNotFound(job_id)
        async with self._db.conn(conn) as c, c.transaction():
            records = await self._cancel_ids(c, [job_id], by)
            if records:
                return Job.from_record(records[0])
            current = await self.get(job_id, conn=c)
        raise InvalidTransition(
            f"job {job_id} is {current.status}; only pending or running (dispatched) jobs "
            "can be cancelled"
        )

    async def _cancel_ids(self, c: Conn, ids: Sequence[int], by: str | None) -> Sequence[Any]:
        """The cancel transition for ``ids``, in the caller's transaction, with the
        NOTIFY that tells the workers running any of them (sent at COMMIT)."""
        records = await c.fetch(Q["cancel"], ids, by)
        running = [str(r["id"]) for r in records if r["was"] == "dispatched"]
        for start in range(0, len(running), CANCEL_NOTIFY_IDS):
            await c.execute(
                Q["cancel_notify"], ",".join(running[start : start + CANCEL_NOTIFY_IDS])
            )
        for r in records:
            JOBS_CANCELLED.labels(r["was"]).inc()
        return records

    async def result(self, job_id: int, *, timeout: float | None = None) -> Any:
        """Wait until the job finished and return what its handler returned (None when
        it returned nothing); raise ``JobFailed`` (with its last error) when it ended
        ``dead``, ``JobCancelled`` when it was cancelled, ``TimeoutError`` when it has
        not finished within ``timeout`` seconds. Waits on a NOTIFY, not by polling
        (``scheduler.store.outcomes``), holding one pooled connection meanwhile."""
        if not 1 <= job_id <= _BIGINT_MAX:
            raise JobNotFound(job_id)
        if timeout is not None and not timeout > 0:
            raise InvalidInput(f"timeout must be > 0 seconds (got {timeout!r})")
        return await wait_for_outcome(self._db, job_id, timeout)

    async def retry(self, job_id: int, *, conn: Conn | None = None) -> Job:
        """dead → pending, runnable now, with attempts reset to 1 (a fresh budget)."""
        return await self._transition(
            "retry",
            [job_id],
            job_id,
            conn,
            _retry_refused,
            wakes=True,
        )

    async def run_now(self, job_id: int, *, conn: Conn | None = None) -> Job:
        """A pending job waiting for its retry back-off becomes runnable now."""
        return await self._transition(
            "run_now",
            job_id,
            job_id,
            conn,
            lambda job: (
                f"job {job_id} is {job.status}, runnable from "
                f"{job.next_run_at.isoformat()}; only a pending job in retry back-off "
                "can be run now (never before its due time)"
            ),
            wakes=True,
        )

    async def _transition(
        self,
        statement: str,
        argument: Any,
        job_id: int,
        conn: Conn | None,
        refused: Callable[[Job], str],
        *,
        wakes: bool = False,
    ) -> Job:
        """Run one job's transition; ``InvalidTransition(refused(job as it is))`` when the
        job is not in the state the transition leaves. A transition that ``wakes`` makes
        the job runnable now: it NOTIFYs the dispatcher in the same transaction."""
        if not 1 <= job_id <= _BIGINT_MAX:  # no such row: ids are bigint, from 1
            raise JobNotFound(job_id)
        async with self._db.conn(conn) as c:
            async with c.transaction() if wakes else contextlib.nullcontext():
                record = await c.fetchrow(Q[statement], argument)
                if record is not None:
                    if wakes:
                        await c.execute(Q["notify"])
                    return Job.from_record(record)
                current = await self.get(job_id, conn=c)
        raise InvalidTransition(refused(current))

    async def preview_matching(self, action: str, where: JobFilter) -> BulkPreview:
        """How many jobs ``cancel_matching``/``retry_matching`` would change now: shown
        to the operator, who confirms with the returned preview (it pins the set)."""
        states = _bulk_source(action, where)
        async with self._db.pool.acquire() as c, planned_for(c, where):
            row = await c.fetchrow(
                compose("jobs", "matching", states=states, filter=filter_for(where)),
                *where.params(),
                _BIGINT_MAX,
            )
        assert row is not None  # an aggregate always returns one row
        return BulkPreview(action, int(row["n"]), int(row["max_id"] or 0), row["as_of"])

    async def cancel_matching(
        self, where: JobFilter, *, preview: BulkPreview | None = None, by: str | None = None
    ) -> int:
        """Cancel the pending, running (dispatched) and waiting jobs ``preview`` counted (matching
        ``where``, ids up to its ``up_to_id``, at most its ``count``, each once), in
        batches of ``BULK_BATCH``, through the same transition as ``cancel``: the
        workers running any of them are told at each batch's commit and stop their
        handlers. ``by`` is recorded as ``cancelled_by`` (default: the database role).
        Without ``preview`` the set is the one matching now (``preview_matching`` first,
        in this call). Returns how many were cancelled."""
        return await self._bulk("cancel", where, preview, by)

    async def retry_matching(self, where: JobFilter, *, preview: BulkPreview | None = None) -> int:
        """Retry the dead jobs ``preview`` counted, like ``retry`` (attempts reset,
        runnable now): only jobs already dead at the preview, each at most once, at most
        ``preview.count`` (without ``preview``: those dead now). Returns how many were
        retried."""
        return await self._bulk("retry", where, preview, None)

    async def _bulk(
        self, action: str, where: JobFilter, preview: BulkPreview | None, by: str | None
    ) -> int:
        states = _bulk_source(action, where)
        if preview is None:
            preview = await self.preview_matching(action, where)
        if preview.action != action:
            raise InvalidInput(f"the preview was for {preview.action}, not {action}")
        select = compose("jobs", "matching_ids", states=states, filter=filter_for(where))
        as_of = preview.as_of if action == "retry" else None
        changed = 0
        after = 0
        while changed < preview.count:
            size = min(BULK_BATCH, preview.count - changed)
            async with self._db.pool.acquire() as c, c.transaction(), planned_for(c, where):
                ids = [
                    r["id"]
                    for r in await c.fetch(
                        select, *where.params(), preview.up_to_id, after, as_of, size
                    )
                ]
                if not ids:
                    return changed
                if action == "cancel":
                    done = await self._cancel_ids(c, ids, by)
                else:
                    done = await c.fetch(Q[action], ids)
                if action == "retry" and done:
                    await c.execute(Q["notify"])
            changed += len(done)
            after = ids[-1]
        return changed

    async def counts_by_status(self) -> dict[str, int]:
        async with self._db.acquire() as c:
            rows = await c.fetch(Q["count_by_status"])
        counts = dict.fromkeys(JOB_STATUSES, 0)
        counts.update({r["status"]: r["n"] for r in rows})
        return counts


_BIGINT_MAX = 2**63 - 1


def _retry_refused(job: Job) -> str:
    if job.status == "dead" and job.unique_key is not None:
        # the revive trigger (migration 0014) skipped the row: another job holds the key
        return (
            f"job {job.id} stays dead: its unique key {job.unique_key!r} is held by another "
            f"job of queue {job.queue!r}; retry that one or wait until it finishes"
        )
    return f"job {job.id} is {job.status}; only dead jobs can be retried"


def _bulk_source(action: str, where: JobFilter) -> str:
    """The state predicate of ``action`` (``BULK_SOURCE``), narrowed to ``where.status``
    when that is one of its states: SQL text made only from the fixed names above."""
    states = BULK_SOURCE.get(action)
    if states is None:
        raise InvalidInput(f"unknown bulk action {action!r} (one of {', '.join(BULK_SOURCE)})")
    if where.status is not None:
        if where.status not in states:
            raise InvalidInput(
                f"{action} applies to {' or '.join(states)} jobs, not {where.status}"
            )
        states = (where.status,)
    return " OR ".join(f"status = '{state}'" for state in states)


@dataclass(frozen=True, slots=True)
class EnqueueCall:
    """One enqueue, validated and ready to run: the statement of ``jobs.sql`` it runs
    (``insert`` or ``insert_unique``) with its arguments, and ``job()``, which reads its
    one row. Every producer API builds it (``plan_enqueue``): ``JobStore.enqueue`` on
    asyncpg, ``scheduler.store.sync_jobs`` on the synchronous drivers, so they validate
    and answer alike."""

    statement: str
    args: tuple[Any, ...]

    def job(self, record: Any) -> Job:
        """The job the row describes; for a unique job, the holder of the key, or
        ``UniqueKeyTaken`` (``on_conflict="error"``, or the holder gone)."""
        if self.statement == "insert":
            return Job.from_record(record)
        assert record is not None  # the function returns exactly one row
        outcome = record["outcome"]
        if outcome != "inserted":
            UNIQUE_CONFLICTS.labels(outcome=outcome).inc()
        if outcome == "refused" or record["id"] is None:
            # refused, or the holder finished and retention removed it in its window
            raise UniqueKeyTaken(self.args[3], self.args[8], record["holder_id"])
        return Job.from_record(record)


def plan_enqueue(
    task: str,
    payload: dict[str, Any] | None,
    *,
    now: datetime,
    due_at: datetime | None = None,
    delay: timedelta | float | None = None,
    queue: str = DEFAULT_QUEUE,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    idempotency_key: str | None = None,
    unique_key: str | None = None,
    on_conflict: OnConflict = "skip",
    unique_for: timedelta | None = None,
    priority: int = 0,
    limit_key: str | None = None,
    tags: Sequence[str] = (),
    meta: dict[str, Any] | None = None,
) -> EnqueueCall:
    """Validate one enqueue (``JobStore.enqueue`` documents the options) into the
    statement that inserts it; ``now`` is the time ``delay`` counts from. Raises
    ``InvalidInput`` before any database work. The unique statement's verdict lives in
    transaction-local settings that the function reads inside the statement, so no
    transaction of its own is needed, and an ``"error"`` refusal comes back as an
    outcome without aborting the caller's transaction. The last argument is the
    enqueuing code's trace context (``scheduler.tracing``; None without OpenTelemetry)."""
    when = resolve_due(due_at=due_at, delay=delay, now=now)
    spec = JobSpec(
        task=task,
        payload={} if payload is None else payload,
        due_at=when,
        queue=queue,
        max_attempts=max_attempts,
        idempotency_key=idempotency_key,
        tags=() if tags is None else tags,
        meta={} if meta is None else meta,
    )
    if limit_key is not None:
        validate_limit_key(limit_key)
    args = (
        spec.task,
        spec.payload,
        spec.due_at,
        spec.queue,
        spec.max_attempts,
        spec.idempotency_key,
        priority,
        limit_key,
    )
    labels = (list(spec.tags), spec.meta)
    if unique_key is None:
        if on_conflict != "skip" or unique_for is not None:
            raise InvalidInput("on_conflict and unique_for need a unique_key")
        return EnqueueCall("insert", (*args, *labels, current_traceparent()))
    validate_unique_key(unique_key)
    if on_conflict not in ON_CONFLICT:
        raise InvalidInput(f"on_conflict must be one of {', '.join(ON_CONFLICT)}")
    window = ""
    if unique_for is not None:
        if not isinstance(unique_for, timedelta) or not (
            timedelta(0) <= unique_for <= MAX_UNIQUE_FOR
        ):
            raise InvalidInput(f"unique_for must be a timedelta from 0 to {MAX_UNIQUE_FOR}")
        window = f"{unique_for.total_seconds()} seconds"
    return EnqueueCall(
        "insert_unique", (*args, unique_key, on_conflict, window, *labels, current_traceparent())
    )


def wakes(job: Job, now: datetime) -> bool:
    """Whether ``job`` is due soon enough to NOTIFY the dispatcher (``NOTIFY_HORIZON``)."""
    return job.next_run_at <= now + NOTIFY_HORIZON


def copy_lines(specs: Iterable[JobSpec], now: datetime) -> tuple[list[str], bool, bool]:
    """``specs`` as lines of COPY text format (jobs without ``due_at`` due ``now``),
    whether any is due within ``NOTIFY_HORIZON``, and whether the lines are of
    ``TAGGED_COLUMNS`` (a job has tags or meta) rather than ``BULK_COLUMNS``. A payload
    or meta that is not JSON is ``InvalidInput`` before anything is written. Every job
    carries the trace context of the code that enqueues them (``scheduler.tracing``)."""
    specs = list(specs)
    tagged = any(s.tags or s.meta for s in specs)
    soon = now + NOTIFY_HORIZON
    traceparent = current_traceparent()
    due_soon = False
    lines: list[str] = []
    for index, s in enumerate(specs):
        due_soon = due_soon or s.due_at is None or s.due_at <= soon
        fields: tuple[str | None, ...] = (
            s.task,
            _json_field(index, "payload", s.payload),
            (s.due_at or now).isoformat(),
            s.queue,
            str(s.max_attempts),
            s.idempotency_key,
            traceparent,
        )
        if tagged:
            fields = (*fields, _array_literal(s.tags), _json_field(index, "meta", s.meta))
        lines.append("\t".join(map(_copy_field, fields)) + "\n")
    return lines, due_soon, tagged


def _json_field(index: int, name: str, value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"job {index}: {name} is not valid JSON: {exc}") from None


def _array_literal(items: Sequence[str]) -> str:
    """A text[] literal (``{"a","b"}``), every element quoted and escaped; ``_copy_field``
    then escapes it for COPY, as the two layers are read back in reverse."""
    quoted = ('"' + item.replace("\\", "\\\\").replace('"', '\\"') + '"' for item in items)
    return "{" + ",".join(quoted) + "}"


def _copy_field(value: str | None) -> str:
    """One field in PostgreSQL's COPY text format (backslash escapes, \\N for NULL)."""
    if value is None:
        return "\\N"
    return (
        value.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")
    )


async def _chunks(lines: list[str], rows: int = 5000) -> AsyncIterator[bytes]:
    """Feed COPY in slices so the encoded bytes never exist all at once."""
    for start in range(0, len(lines), rows):
        yield "".join(lines[start : start + rows]).encode()
