"""AttemptGuard: the connections that hold the guard locks of the attempts a worker runs.

At most one worker *process* runs an attempt at a time, whatever copies of its message
the broker hands out (docs/security.md, "Forged, copied and stale messages"). The begin
read (``duetime.worker_begin``, migration 0012) tries a session-level advisory lock on
the attempt (job id, attempt, dispatch epoch) for every row that is the message's to
run; the connection that ran it keeps the locks it took until the attempts are settled
(``release``). A copy read by another process while the lock is held is not run. When
the holder dies (kill -9, a lost connection), PostgreSQL ends its session and the locks
with it, so a copy redelivered then runs: nothing is lost.

Why sessions held for the attempts, and not the attempt's own transaction: attempts
whose handlers never use ``ctx.db`` have neither a transaction nor a connection (they
are read and settled in batches); a lock held by the attempt's own session would cost a
connection per running handler and a round trip per delivery. The begin read was
already one batched statement; it now takes the locks as it reads, so a delivery pays
no extra round trip. ``release`` is batched too and not awaited by the delivery (it is
sent after the outcome committed, which is all the ordering it needs): the releases due
on a connection ride along with its next begin read (the function releases them
first), and only those no read took along within ``RELEASE_DELAY`` go as a statement of
their own.

Begin reads run on up to ``slots`` connections of the store pool at once (the batched
reads in flight; with one, reads waited for each other and a worker at concurrency 10
started its handlers in trickles: fewer of them shared a transaction group). A slot
that holds no lock gives its connection back after each statement, so an idle worker
holds none for the guard.

A begin that fails half-way may have taken some locks of its batch (advisory locks
outlive a failed statement): every pointer of that batch is released once. When a
connection itself fails, it is dropped: the server releases everything it held, also
the locks of attempts still running here (from then on a copy of those may run: the
"connection lost" case, as if this worker had died), and the slot opens another.
``close`` releases everything before giving the connections back to the pool, whose
sessions are never reset (``scheduler.db.keep_session``).
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


class _Slot:
    """One guard connection (while it holds locks), and what it holds."""

    __slots__ = ("conn", "flush", "held", "lock", "releasing")

    def __init__(self) -> None:
        self.conn: Conn | None = None
        self.lock = asyncio.Lock()
        self.held: set[Pointer] = set()
        self.releasing: list[Pointer] = []
        self.flush: asyncio.Task[None] | None = None


class AttemptGuard:
    """Connections of ``db``'s pool for begin reads, holding the locks they take."""

    def __init__(self, db: Pooled, *, begin_sql: str, release_sql: str, slots: int = 4) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1 (got {slots})")
        self._db = db
        self._begin_sql = begin_sql
        self._release_sql = release_sql
        self._slots = [_Slot() for _ in range(slots)]
        self._holder: dict[Pointer, _Slot] = {}
        self._closed = False

    @property
    def held(self) -> int:
        """Guard locks held right now (tests)."""
        return len(self._holder)

    def _free_slot(self, pointers: Sequence[tuple[int, int, int | None]] = ()) -> _Slot:
        """The slot whose session still holds (releases pending) the guard of one of
        ``pointers``: its begin read releases them first and takes them again in the same
        session (on any other slot, this process's own lock would read as another
        worker's). Else a slot no statement is running on: first one with releases
        pending (they ride along instead of going as a statement of their own), then one
        that already holds a connection (no other connection is taken out of the pool
        and held while the attempts run); else the one holding the fewest locks."""
        if pointers:
            for slot in self._slots:
                if slot.releasing and not set(slot.releasing).isdisjoint(pointers):
                    return slot
        free = [slot for slot in self._slots if not slot.lock.locked()]
        if free:
            return max(free, key=lambda slot: (bool(slot.releasing), slot.conn is not None))
        return min(self._slots, key=lambda slot: len(slot.held))

    async def begin(
        self, job_ids: Sequence[int], due_ats: Sequence[datetime], attempts: Sequence[int],
        epochs: Sequence[int | None],
    ) -> list[Any]:  # fmt: skip
        """Run the begin read on a guard connection; remember the locks it took."""
        pointers: list[tuple[int, int, int | None]] = list(
            zip(job_ids, attempts, epochs, strict=True)
        )
        slot = self._free_slot(pointers)
        releasing: list[Pointer] = []

        async def read(conn: Conn) -> list[Any]:
            # the releases due on this connection ride along (released first)
            releasing.extend(slot.releasing)
            slot.releasing.clear()
            records = await conn.fetch(
                self._begin_sql,
                list(job_ids),
                list(due_ats),
                list(attempts),
                list(epochs),
                *_columns(releasing),
                timeout=self._db.timeout,
            )
            # recorded before _run decides whether the connection goes back to the pool:
            # a session holding the locks just taken must stay this slot's
            for record in records:
                if record["started"]:
                    job_id, attempt, epoch = pointers[record["i"] - 1]
                    assert epoch is not None  # a lock is only tried for a message's epoch
                    slot.held.add((job_id, attempt, epoch))
                    self._holder[(job_id, attempt, epoch)] = slot
            return records

        async def undo(conn: Conn) -> None:
            await self._unlock(conn, [*pointers, *releasing])

        return await self._run(slot, read, undo)

    def release(self, pointer: Pointer) -> None:
        """Release one attempt's guard lock, soon (batched; the caller does not wait).
        Call it only once the attempt's outcome committed, or when it has none."""
        slot = self._holder.pop(pointer, None)
        if slot is None:
            return  # not taken, or dropped with its connection already
        slot.held.discard(pointer)
        slot.releasing.append(pointer)
        if slot.flush is None and not self._closed:
            slot.flush = asyncio.create_task(
                self._release_soon(slot), name="guard:release", context=contextvars.Context()
            )

    async def _release_soon(self, slot: _Slot) -> None:
        """Send the releases that no begin read took along (an idle or draining worker)."""
        try:
            await asyncio.sleep(RELEASE_DELAY)  # a begin read may take them along first

            async def unlock(conn: Conn) -> None:
                batch, slot.releasing = slot.releasing, []
                await self._unlock(conn, batch)

            while slot.releasing and not self._closed:
                with contextlib.suppress(Exception):  # the connection was dropped
                    await self._run(slot, unlock, None)
        finally:
            slot.flush = None

    async def _unlock(self, conn: Conn, pointers: Sequence[tuple[int, int, int | None]]) -> None:
        if pointers:
            await conn.fetchval(self._release_sql, *_columns(pointers), timeout=self._db.timeout)

    async def _run(
        self,
        slot: _Slot,
        work: Callable[[Conn], Awaitable[T]],
        undo: Callable[[Conn], Awaitable[None]] | None,
    ) -> T:
        """``work`` on the slot's connection, one at a time. If it fails, ``undo`` (the
        locks it may have taken); if that fails too, or the connection broke, drop the
        connection (the server releases all its locks)."""
        async with slot.lock:
            if self._closed:
                raise RuntimeError("attempt guard: closed")
            if slot.conn is not None and _broken(slot.conn):
                # its session ended (a killed backend, a lost socket): the server released
                # its locks, and asyncpg put the holder back in the pool and detached this
                # proxy, which fails every call from now on, is_closed() included
                await self._drop(slot)
            if slot.conn is None:
                slot.conn = await self._db.pool.acquire(timeout=self._db.timeout)
            conn = slot.conn
            try:
                result = await work(conn)
            except asyncio.CancelledError:
                await self._drop(slot)
                raise
            except BaseException:
                if undo is None or _broken(conn):
                    await self._drop(slot)
                else:
                    try:
                        await undo(conn)
                    except BaseException:
                        await self._drop(slot)
                        raise
                raise
            if not slot.held and not slot.releasing:
                # holds no lock (``work`` recorded any it took): back to the pool until
                # one is taken
                slot.conn = None
                try:
                    await self._db.pool.release(conn, timeout=self._db.timeout)  # type: ignore[arg-type]
                except Exception:
                    with contextlib.suppress(Exception):
                        conn.terminate()
            return result

    async def _drop(self, slot: _Slot) -> None:
        """Forget the slot's connection and what it held; the server releases the locks."""
        conn, slot.conn = slot.conn, None
        for pointer in slot.held:
            self._holder.pop(pointer, None)
        slot.held.clear()
        slot.releasing.clear()
        if conn is None:
            return
        with contextlib.suppress(Exception):
            conn.terminate()
        with contextlib.suppress(Exception):
            await self._db.pool.release(conn, timeout=self._db.timeout)  # type: ignore[arg-type]

    async def close(self) -> None:
        """Release every lock and give the connections back (dropped if that fails)."""
        self._closed = True
        for slot in self._slots:
            flush, slot.flush = slot.flush, None
            if flush is not None:
                flush.cancel()
                with contextlib.suppress(BaseException):
                    await flush
            async with slot.lock:
                conn = slot.conn
                if conn is None:
                    continue
                try:
                    async with asyncio.timeout(self._db.timeout):
                        await conn.execute("SELECT pg_advisory_unlock_all()")
                except BaseException:
                    await self._drop(slot)
                    continue
                slot.conn = None
                slot.held.clear()
                await self._db.pool.release(conn)  # type: ignore[arg-type]
        self._holder.clear()


def _broken(conn: Conn) -> bool:
    """Whether ``conn`` can no longer run a statement: closed, or a pool proxy asyncpg
    detached when the connection under it was lost (whose every method then raises
    ``InterfaceError``, ``is_closed`` included)."""
    try:
        return conn.is_closed()
    except Exception:
        return True


def _columns(pointers: Sequence[tuple[int, int, int | None]]) -> tuple[list[Any], ...]:
    """Job ids, attempts and epochs of ``pointers``, as the functions unnest them."""
    return (
        [p[0] for p in pointers],
        [p[1] for p in pointers],
        [p[2] for p in pointers],
    )
