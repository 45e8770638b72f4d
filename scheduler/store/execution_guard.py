"""AttemptGuard: the connection that holds the guard locks of the attempts a worker runs.

At most one worker *process* runs an attempt at a time, whatever copies of its message
the broker hands out (docs/security.md, "Forged, copied and stale messages"). The begin
read (``duetime.worker_begin``, migration 0012) tries a session-level advisory lock on
the attempt (job id, attempt, dispatch epoch) for every row that is the message's to
run; it runs on this one connection, which keeps the locks it took until the attempts
are settled (``release``). A copy read by another process while the lock is held is not
run. When the holder dies (kill -9, a lost connection), PostgreSQL ends its session and
the locks with it, so a copy redelivered then runs: nothing is lost.

Why one connection held for the worker's life, and not the attempt's own transaction:
attempts whose handlers never use ``ctx.db`` have neither a transaction nor a
connection (they are read and settled in batches); a lock held by the attempt's own
session would cost a connection per running handler and a round trip per delivery. The
begin read was already one batched statement; it now takes the locks as it reads, so a
delivery pays no extra round trip. ``release`` is batched too and not awaited by the
delivery (it is sent after the outcome committed, which is all the ordering it needs):
the releases due ride along with the next begin read (the function releases them
first), and only those no read took along within ``RELEASE_DELAY`` go as a statement
of their own.

What it costs: begin reads share this one connection, one at a time (the store pool
allowed four in flight); an idle or draining worker sends its releases on their own.

A begin that fails half-way may have taken some locks of its batch (advisory locks
outlive a failed statement): every pointer of that batch is released once. When the
connection itself fails, it is dropped: the server releases everything it held, also
the locks of attempts still running here (from then on a copy of those may run: the
"connection lost" case, as if this worker had died), and the next begin opens another.
``close`` releases everything before giving the connection back to the pool, whose
sessions are never reset (``scheduler.db.keep_session``). A guard that holds no lock
gives its connection back after each statement, so an idle worker holds none for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar

from scheduler.store.conn import Conn, Pooled

T = TypeVar("T")

#: (job id, attempt, dispatch epoch): what a guard lock is taken on.
Pointer = tuple[int, int, int]
#: Seconds a release waits for a begin read to take it along before it is sent on its
#: own. Holding a settled attempt's guard a little longer only makes a copy arriving
#: meanwhile be dropped as "running" instead of as settled; an attempt that ended
#: without an outcome has its message requeued after a longer delay than this.
RELEASE_DELAY = 0.05


class AttemptGuard:
    """One long-lived connection of ``db``'s pool, for begin reads and releases."""

    def __init__(self, db: Pooled, *, begin_sql: str, release_sql: str) -> None:
        self._db = db
        self._begin_sql = begin_sql
        self._release_sql = release_sql
        self._conn: Conn | None = None
        self._lock = asyncio.Lock()
        self._held: set[Pointer] = set()
        self._releasing: list[Pointer] = []
        self._flush: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def held(self) -> int:
        """Guard locks held right now (tests)."""
        return len(self._held)

    async def begin(
        self, job_ids: Sequence[int], due_ats: Sequence[datetime], attempts: Sequence[int],
        epochs: Sequence[int | None],
    ) -> list[Any]:  # fmt: skip
        """Run the begin read on the guard connection; remember the locks it took."""
        pointers: list[tuple[int, int, int | None]] = list(
            zip(job_ids, attempts, epochs, strict=True)
        )

        releasing: list[Pointer] = []

        async def read(conn: Conn) -> list[Any]:
            # the releases due so far ride along (the function releases them first)
            releasing.extend(self._releasing)
            self._releasing.clear()
            done = _columns(releasing)
            return await conn.fetch(
                self._begin_sql,
                list(job_ids),
                list(due_ats),
                list(attempts),
                list(epochs),
                *done,
            )

        async def undo(conn: Conn) -> None:
            await self._unlock(conn, [*pointers, *releasing])

        records = await self._run(read, undo)
        for record in records:
            if record["started"]:
                job_id, attempt, epoch = pointers[record["i"] - 1]
                assert epoch is not None  # a lock is only tried for a message's epoch
                self._held.add((job_id, attempt, epoch))
        return records

    def release(self, pointer: Pointer) -> None:
        """Release one attempt's guard lock, soon (batched; the caller does not wait).
        Call it only once the attempt's outcome committed, or when it has none."""
        if pointer not in self._held:
            return  # not taken, or dropped with its connection already
        self._held.discard(pointer)
        self._releasing.append(pointer)
        if self._flush is None and not self._closed:
            self._flush = asyncio.create_task(
                self._release_soon(), name="guard:release", context=contextvars.Context()
            )

    async def _release_soon(self) -> None:
        """Send the releases that no begin read took along (an idle or draining worker)."""
        try:
            await asyncio.sleep(RELEASE_DELAY)  # a begin read may take them along first

            async def unlock(conn: Conn) -> None:
                batch, self._releasing = self._releasing, []
                await self._unlock(conn, batch)

            while self._releasing:
                with contextlib.suppress(Exception):  # the connection was dropped
                    await self._run(unlock, None)
        finally:
            self._flush = None

    async def _unlock(self, conn: Conn, pointers: Sequence[tuple[int, int, int | None]]) -> None:
        if pointers:
            await conn.fetchval(self._release_sql, *_columns(pointers))

    async def _run(
        self,
        work: Callable[[Conn], Awaitable[T]],
        undo: Callable[[Conn], Awaitable[None]] | None,
    ) -> T:
        """``work`` on the guard connection, one at a time. If it fails, ``undo`` (the
        locks it may have taken); if that fails too, or the connection broke, drop the
        connection (the server releases all its locks)."""
        async with self._lock:
            if self._closed:
                raise RuntimeError("attempt guard: closed")
            if self._conn is None:
                self._conn = await self._db.pool.acquire(timeout=self._db.timeout)
            conn = self._conn
            try:
                result = await work(conn)
                if not self._held and not self._releasing:
                    self._conn = None  # holds no lock: back to the pool until one is taken
                    await self._db.pool.release(conn)  # type: ignore[arg-type]
                return result
            except asyncio.CancelledError:
                await self._drop()
                raise
            except BaseException:
                if undo is None or conn.is_closed():
                    await self._drop()
                else:
                    try:
                        await undo(conn)
                    except BaseException:
                        await self._drop()
                        raise
                raise

    async def _drop(self) -> None:
        """Forget the connection and everything it held; the server releases the locks."""
        conn, self._conn = self._conn, None
        self._held.clear()
        self._releasing.clear()
        if conn is None:
            return
        with contextlib.suppress(Exception):
            conn.terminate()
        with contextlib.suppress(Exception):
            await self._db.pool.release(conn)  # type: ignore[arg-type]

    async def close(self) -> None:
        """Release every lock and give the connection back (dropped if that fails)."""
        self._closed = True
        flush, self._flush = self._flush, None
        if flush is not None:
            flush.cancel()
            with contextlib.suppress(BaseException):
                await flush
        async with self._lock:
            conn = self._conn
            if conn is None:
                return
            try:
                async with asyncio.timeout(self._db.timeout):
                    await conn.execute("SELECT pg_advisory_unlock_all()")
            except BaseException:
                await self._drop()
                return
            self._conn = None
            self._held.clear()
            await self._db.pool.release(conn)  # type: ignore[arg-type]


def _columns(pointers: Sequence[tuple[int, int, int | None]]) -> tuple[list[Any], ...]:
    """Job ids, attempts and epochs of ``pointers``, as the functions unnest them."""
    return (
        [p[0] for p in pointers],
        [p[1] for p in pointers],
        [p[2] for p in pointers],
    )
