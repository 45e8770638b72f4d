"""Enqueue from synchronous code, in the caller's transaction: ``duetime.enqueue(conn,
task, payload, **options)`` and ``duetime.bulk_enqueue(conn, specs)``.

``conn`` is what a synchronous application already holds: a psycopg 3 (or psycopg2)
connection or cursor, a SQLAlchemy ``Connection`` or ``Session``, or a Django
connection (``django.db.connection`` when omitted; ``django.db.connections["other"]``).
The job is inserted through that connection, inside whatever transaction it is in, and
commits or rolls back with the caller's own writes; the dispatcher's wake-up
(``pg_notify``) is sent in the same transaction, so PostgreSQL delivers it only at
COMMIT. Outside a transaction (Django's autocommit, a psycopg connection with
``autocommit=True``) the job commits at once, like any other statement there.

Same statements, same validation, same answers as ``JobStore.enqueue``: both build the
call with ``plan_enqueue`` (``InvalidInput`` before any database work), run the named
statement of ``jobs.sql`` (turned into the driver's ``%s`` placeholders by
``scheduler.sql.format_paramstyle``, not written a second time) and read the row with
``EnqueueCall.job`` (``UniqueKeyTaken``, the holder of a unique key). What differs: an
error the database raises (a CHECK constraint refusing a value, a lost connection) is
the driver's own exception, naming the constraint.

The drivers are optional (``pip install 'duetime[psycopg]'``, ``[sqlalchemy]``,
``[django]``): nothing here imports one. A connection is recognised by the module of
its type, and Django's default connection is imported only when ``conn`` is omitted.
asyncpg connections use ``await enqueue_async(conn, ...)`` (or ``JobStore.enqueue(...,
conn=conn)``).

``get(conn, job_id)`` reads one job back through the same kinds of connection (the
Django Tasks backend's ``get_result``, ``duetime.contrib.django``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from scheduler.clock import SYSTEM_CLOCK, Clock
from scheduler.errors import InvalidInput
from scheduler.jobspec import JobSpec
from scheduler.sql import format_paramstyle, fragment
from scheduler.store.conn import Conn
from scheduler.store.jobs import Q, copy_lines, plan_enqueue, wakes
from scheduler.store.rows import Job
from scheduler.store.workflows import layer_document, place
from scheduler.workflow import Workflow, WorkflowJobs

__all__ = ["bulk_enqueue", "enqueue", "enqueue_async", "enqueue_workflow", "get"]

#: The statements in the drivers' ``format`` paramstyle, with their argument order.
_FORMAT = {name: format_paramstyle(fragment("jobs", name)) for name in ("insert", "insert_unique")}
_GET = format_paramstyle(fragment("jobs", "get_as_text"))
_COPY = {
    tagged: fragment("jobs", "copy_jobs_tagged" if tagged else "copy_jobs").strip().rstrip(";")
    for tagged in (False, True)
}
_NOTIFY = fragment("jobs", "notify").strip().rstrip(";")
_WORKFLOW = {
    name: format_paramstyle(fragment("workflows", name))
    for name in ("next_workflow_id", "insert_layer")
}
_BIGINT_MAX = 2**63 - 1


class _Cursor:
    """A DB-API cursor (psycopg 3, psycopg2, Django's cursor wrapper) as the three calls
    enqueueing needs."""

    def __init__(self, cursor: Any) -> None:
        self._cursor = cursor

    def fetchrow(self, sql: str, args: Sequence[Any]) -> dict[str, Any] | None:
        self._cursor.execute(sql, tuple(args))
        row = self._cursor.fetchone()
        if row is None:
            return None
        if isinstance(row, Mapping):  # a dict row factory
            return dict(row)
        return dict(zip((d[0] for d in self._cursor.description), row, strict=True))

    def fetchall(self, sql: str, args: Sequence[Any]) -> list[dict[str, Any]]:
        self._cursor.execute(sql, tuple(args))
        names = [d[0] for d in self._cursor.description]
        return [
            dict(row) if isinstance(row, Mapping) else dict(zip(names, row, strict=True))
            for row in self._cursor.fetchall()
        ]

    def execute(self, sql: str) -> None:
        self._cursor.execute(sql)

    def copy(self, sql: str, lines: list[str]) -> int:
        cursor = getattr(self._cursor, "cursor", self._cursor)  # Django wraps the driver's
        if hasattr(cursor, "copy"):  # psycopg 3
            with cursor.copy(sql) as copy:
                for line in lines:
                    copy.write(line)
        else:  # psycopg2
            import io

            cursor.copy_expert(sql, io.StringIO("".join(lines)))
        return int(cursor.rowcount)


class _SQLAlchemy:
    """A SQLAlchemy ``Connection``: statements through ``exec_driver_sql`` (which begins
    the connection's transaction as any statement does), COPY on its DB-API connection
    inside that transaction."""

    def __init__(self, connection: Any) -> None:
        self._connection = connection

    def fetchrow(self, sql: str, args: Sequence[Any]) -> dict[str, Any] | None:
        row = self._connection.exec_driver_sql(sql, tuple(args)).mappings().first()
        return None if row is None else dict(row)

    def fetchall(self, sql: str, args: Sequence[Any]) -> list[dict[str, Any]]:
        return [dict(r) for r in self._connection.exec_driver_sql(sql, tuple(args)).mappings()]

    def execute(self, sql: str) -> None:
        self._connection.exec_driver_sql(sql)

    def copy(self, sql: str, lines: list[str]) -> int:
        if not self._connection.in_transaction():
            self._connection.begin()
        cursor = self._connection.connection.cursor()  # the same DB-API connection
        try:
            return _Cursor(cursor).copy(sql, lines)
        finally:
            cursor.close()


def _open(conn: Any) -> tuple[Any, Any]:
    """The adapter for ``conn`` and the cursor to close after (or None)."""
    if conn is None:
        try:
            from django.db import connection as default
        except ImportError:
            raise InvalidInput(
                "duetime.enqueue needs a connection: a psycopg connection or cursor, a "
                "SQLAlchemy Connection or Session, or a Django connection"
            ) from None
        conn = default
    home = type(conn).__module__ or ""
    root = home.split(".")[0]
    if root == "django":
        if getattr(conn, "vendor", None) != "postgresql":
            raise InvalidInput(
                f"duetime.enqueue: Django database {getattr(conn, 'alias', '?')!r} is "
                f"{getattr(conn, 'vendor', '?')}, not PostgreSQL"
            )
        cursor = conn.cursor()
        return _Cursor(cursor), cursor
    if root == "sqlalchemy":
        if hasattr(conn, "exec_driver_sql"):  # Connection
            return _SQLAlchemy(conn), None
        if hasattr(conn, "connection") and hasattr(conn, "get_bind"):  # Session
            return _SQLAlchemy(conn.connection()), None
    if root in ("psycopg", "psycopg2"):
        if hasattr(conn, "fetchone"):  # a cursor
            return _Cursor(conn), None
        cursor = conn.cursor()
        return _Cursor(cursor), cursor
    if root == "asyncpg":
        raise InvalidInput(
            "duetime.enqueue takes a synchronous connection; with asyncpg use "
            "`await duetime.enqueue_async(conn, ...)` or JobStore.enqueue(..., conn=conn)"
        )
    raise InvalidInput(
        f"duetime.enqueue: unsupported connection {type(conn).__module__}."
        f"{type(conn).__qualname__} (a psycopg connection or cursor, a SQLAlchemy "
        "Connection or Session, or a Django connection)"
    )


def _job(record: dict[str, Any] | None) -> dict[str, Any] | None:
    """The row as asyncpg would give it: a jsonb column some drivers return as text
    (Django's psycopg 3 setup) decoded."""
    if record is not None:
        for column in ("payload", "meta"):
            if isinstance(record.get(column), str):
                record[column] = json.loads(record[column])
    return record


def _driver_args(args: tuple[Any, ...], order: tuple[int, ...]) -> list[Any]:
    """The ``$n`` arguments in ``%s`` order; the payload and the meta (the dicts) as JSON
    text, which PostgreSQL casts to jsonb (no driver-specific JSON adapter needed); the
    tags a list, which every driver sends as an array."""
    values = [
        json.dumps(v, ensure_ascii=False, allow_nan=False) if isinstance(v, dict) else v
        for v in args
    ]
    return [values[i] for i in order]


def enqueue(
    conn: Any = None,
    task: str | None = None,
    payload: dict[str, Any] | None = None,
    *,
    clock: Clock = SYSTEM_CLOCK,
    **options: Any,
) -> Job:
    """Insert one job through ``conn`` in its current transaction (module docstring);
    ``options`` are ``JobStore.enqueue``'s (``due_at``, ``delay``, ``queue``,
    ``max_attempts``, ``idempotency_key``, ``unique_key``, ``on_conflict``,
    ``unique_for``, ``priority``, ``limit_key``, ``tags``, ``meta``). Returns the ``Job``."""
    if task is None:
        raise InvalidInput("duetime.enqueue needs a task name")
    call = plan_enqueue(task, payload, now=clock.now(), **options)
    sql, order = _FORMAT[call.statement]
    adapter, cursor = _open(conn)
    try:
        job = call.job(_job(adapter.fetchrow(sql, _driver_args(call.args, order))))
        if wakes(job, clock.now()):
            adapter.execute(_NOTIFY)
    finally:
        if cursor is not None:
            cursor.close()
    return job


def bulk_enqueue(conn: Any, specs: Iterable[JobSpec], *, clock: Clock = SYSTEM_CLOCK) -> int:
    """COPY many jobs through ``conn`` in its current transaction, one NOTIFY after when
    any is due soon (as ``JobStore.bulk_enqueue``). Returns the number inserted."""
    lines, due_soon, tagged = copy_lines(specs, clock.now())
    if not lines:
        return 0
    adapter, cursor = _open(conn)
    try:
        count = adapter.copy(_COPY[tagged], lines)
        if due_soon:
            adapter.execute(_NOTIFY)
    finally:
        if cursor is not None:
            cursor.close()
    return count if count >= 0 else len(lines)


def enqueue_workflow(conn: Any, workflow: Workflow, *, clock: Clock = SYSTEM_CLOCK) -> WorkflowJobs:
    """``JobStore.enqueue_workflow`` through a synchronous connection, in its current
    transaction (module docstring): every step, one statement per layer, under a new
    ``workflow_id``. Outside a transaction each layer commits on its own, so open one
    (``with conn.transaction()``, ``transaction.atomic()``) for all-or-nothing."""
    if not len(workflow):
        raise InvalidInput("an empty workflow: add a step first")
    adapter, cursor = _open(conn)
    try:
        sql, _ = _WORKFLOW["next_workflow_id"]
        record = adapter.fetchrow(sql, [])
        assert record is not None
        workflow_id = int(record["workflow_id"])
        ids: list[int | None] = [None] * len(workflow)
        jobs: list[Job | None] = [None] * len(workflow)
        insert, order = _WORKFLOW["insert_layer"]
        for layer in workflow.layers():
            doc = layer_document(workflow, layer, ids, clock.now())
            records = adapter.fetchall(insert, [(doc, workflow_id)[i] for i in order])
            place(workflow, layer, records, ids, jobs, lambda r: Job.from_record(_job(r)))
        run = WorkflowJobs(workflow_id, [j for j in jobs if j is not None])
        if any(j.status == "pending" and wakes(j, clock.now()) for j in run.jobs):
            adapter.execute(_NOTIFY)
    finally:
        if cursor is not None:
            cursor.close()
    return run


def get(conn: Any, job_id: int) -> Job | None:
    """Job ``job_id`` read through ``conn`` (in its current transaction, so a job the
    caller enqueued and has not committed yet is seen), or None when there is none. The
    jsonb columns are read as text and decoded here, the same for every driver."""
    if not 1 <= job_id <= _BIGINT_MAX:
        return None
    sql, order = _GET
    adapter, cursor = _open(conn)
    try:
        record = adapter.fetchrow(sql, [(job_id,)[i] for i in order])
    finally:
        if cursor is not None:
            cursor.close()
    if record is None:
        return None
    record["payload"] = json.loads(record["payload_text"])
    text = record["result_text"]
    record["result"] = None if text is None else json.loads(text)
    return Job.from_record(record)


async def enqueue_async(
    conn: Conn,
    task: str,
    payload: dict[str, Any] | None = None,
    *,
    clock: Clock = SYSTEM_CLOCK,
    **options: Any,
) -> Job:
    """``enqueue`` on an asyncpg connection, in its current transaction: the same as
    ``JobStore.enqueue(..., conn=conn)`` without a store."""
    call = plan_enqueue(task, payload, now=clock.now(), **options)
    job = call.job(await conn.fetchrow(Q[call.statement], *call.args))
    if wakes(job, clock.now()):
        await conn.execute(Q["notify"])
    return job
