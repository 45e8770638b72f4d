"""Plain ``def`` handlers: a bounded pool of threads, and what happens to a thread that
outlives its attempt.

``@task("resize") def resize(ctx, payload): ...`` runs on one of ``threads`` threads
(``--threads``, default the worker's concurrency), never on the event loop. The
executor treats the thread's run like an async handler's await: the same timeout, the
same ``ctx.db`` transaction (``workers.sync_db`` bridges each call to the loop, where
``LazyTransaction`` runs it), the same commit and the same ``Settler``. Only the place
the handler's Python code runs differs.

**A thread cannot be killed.** When an attempt times out (or the worker cancels it at
shutdown) the executor gets ``CancelledError`` here as it would for a coroutine: the
attempt is settled as failed at once and its slot is free for the next delivery. The
thread itself keeps running the handler's code until that returns. It is *abandoned*:

- its ``ctx`` is closed before the attempt's transaction is rolled back, so every later
  ``ctx.db`` or ``ctx.heartbeat()`` call raises ``AttemptAbandoned`` (a call in flight
  at that moment is cancelled and raises it too): nothing it writes through ``ctx.db``
  can commit, and it never opens a second transaction;
- what it does outside ``ctx.db`` (an HTTP call, a file) still happens: pass
  ``ctx.idempotency_key`` on, as for any effect outside the database;
- a new thread replaces it in the pool, so the pool keeps ``threads`` usable threads;
  the abandoned one ends when its handler returns, and its result is dropped.

Abandoned threads hold memory and whatever the handler holds (sockets, locks), so a
worker tolerates ``max_abandoned`` of them alive at once
(``DUETIME_WORKER_MAX_ABANDONED_THREADS``). One more and the runner calls
``on_exhausted``: the worker logs ``worker_abandoned_threads_exceeded``, stops
gracefully (running attempts finish within the grace period) and exits with status
``RESTART_EXIT_STATUS`` for its supervisor (systemd ``Restart=always``, Kubernetes) to
start a fresh process. ``duetime_worker_abandoned_threads`` shows how many are alive,
``duetime_worker_threads_abandoned_total`` how many there have been.

Threads are reused, not started per job: thread-local state a handler keeps (a Django
database connection, a ``requests`` session) lives as long as its thread. Each run
copies the event loop's ``contextvars`` (structlog's bound job fields come along).
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import itertools
import queue
import threading
from collections.abc import Callable
from typing import Any

from scheduler.log import get_logger
from scheduler.metrics import THREADS_ABANDONED, THREADS_ABANDONED_ALIVE
from workers.context import JobContext
from workers.sync_db import Bridge, SyncJobContext

__all__ = ["RESTART_EXIT_STATUS", "ThreadRunner"]

log = get_logger("duetime.worker")

#: Exit status of a worker that stopped because too many handler threads were
#: abandoned (EX_TEMPFAIL: "try again", i.e. start a fresh process).
RESTART_EXIT_STATUS = 75
#: Default number of abandoned threads a worker tolerates alive at once.
DEFAULT_MAX_ABANDONED = 8

_QUEUED, _RUNNING, _DONE, _CANCELLED, _ABANDONED = range(5)
_names = itertools.count(1)


class _Item:
    """One handler run handed to the pool."""

    __slots__ = ("args", "context", "fn", "future", "loop", "state", "thread")

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[Any],
    ) -> None:
        self.fn = fn
        self.args = args
        self.context = contextvars.copy_context()
        self.loop = loop
        self.future = future
        self.state = _QUEUED
        self.thread: _PoolThread | None = None


class _PoolThread(threading.Thread):
    def __init__(self, runner: ThreadRunner) -> None:
        super().__init__(name=f"duetime-handler-{next(_names)}", daemon=True)
        self.runner = runner
        self.retired = False  # abandoned by its attempt: exit after the current run

    def run(self) -> None:
        runner = self.runner
        while True:
            item = runner._work.get()
            if item is None:
                return
            if not runner._claim(item, self):
                continue
            result: Any = None
            error: BaseException | None = None
            try:
                result = item.context.run(item.fn, *item.args)
            except BaseException as exc:
                error = exc
            if error is None and inspect.isawaitable(result):
                if inspect.iscoroutine(result):
                    result.close()
                error = TypeError(
                    f"handler {getattr(item.fn, '__qualname__', item.fn)!r} returned an "
                    "awaitable: declare it 'async def' to run it on the event loop"
                )
                result = None
            if runner._finish(item, self, result, error):
                return


def _resolve(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # the attempt was cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class ThreadRunner:
    """At most ``threads`` plain ``def`` handlers at once, on reused daemon threads
    (module docstring). ``on_exhausted`` is called once, on the event loop, when more
    than ``max_abandoned`` abandoned threads are alive. ``close()`` lets idle threads
    exit; abandoned ones end with their handler (daemon threads never block the
    process's exit)."""

    def __init__(
        self,
        threads: int,
        *,
        max_abandoned: int = DEFAULT_MAX_ABANDONED,
        on_exhausted: Callable[[], None] | None = None,
    ) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1 (got {threads!r})")
        if max_abandoned < 0:
            raise ValueError(f"max_abandoned must be >= 0 (got {max_abandoned!r})")
        self.threads = threads
        self.max_abandoned = max_abandoned
        self._on_exhausted = on_exhausted
        self._slots = asyncio.Semaphore(threads)
        self._work: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # item states and thread retirement
        self._live: set[_PoolThread] = set()  # threads not abandoned
        self._in_flight = 0
        self._closed = False
        #: abandoned threads still running their handler
        self.abandoned = 0
        self.exhausted = False

    async def run_handler(
        self, handler: Callable[..., Any], ctx: JobContext, payload: Any, *, timeout: float | None
    ) -> Any:
        """Run a plain ``def`` handler with a synchronous ``ctx`` (``SyncJobContext``)
        whose calls are bounded by ``timeout`` each; the ``ctx`` is closed when this
        returns or is cancelled, before the executor ends the attempt's transaction."""
        bridge = Bridge(asyncio.get_running_loop(), timeout=timeout)
        try:
            return await self.run(handler, SyncJobContext(ctx, bridge), payload)
        finally:
            bridge.close()

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on a pool thread; cancelling this abandons a started run."""
        if self._closed:
            raise RuntimeError("the handler thread pool is closed")
        async with self._slots:
            loop = asyncio.get_running_loop()
            item = _Item(fn, args, loop, loop.create_future())
            self._in_flight += 1
            try:
                self._grow()
                self._work.put(item)
                try:
                    return await item.future
                except asyncio.CancelledError:
                    self._abandon(item)
                    raise
            finally:
                self._in_flight -= 1

    def _grow(self) -> None:
        """Start threads until every run in flight has one (at most ``threads``)."""
        with self._lock:
            missing = min(self._in_flight, self.threads) - len(self._live)
            started = [_PoolThread(self) for _ in range(max(0, missing))]
            self._live.update(started)
        for thread in started:
            thread.start()

    def _claim(self, item: _Item, thread: _PoolThread) -> bool:
        with self._lock:
            if item.state != _QUEUED:
                return False  # cancelled before a thread took it
            item.state, item.thread = _RUNNING, thread
            return True

    def _finish(
        self, item: _Item, thread: _PoolThread, result: Any, error: BaseException | None
    ) -> bool:
        """Hand the result to the loop; True when the thread was abandoned and exits."""
        with self._lock:
            retired = thread.retired
            item.state = _DONE
        try:
            if retired:
                item.loop.call_soon_threadsafe(self._reaped)
            else:
                item.loop.call_soon_threadsafe(_resolve, item.future, result, error)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass
        return retired

    def _abandon(self, item: _Item) -> None:
        """The attempt was cancelled (timeout, shutdown) while its run was queued or
        running: a queued one never starts; a running one's thread is retired and
        replaced (module docstring)."""
        with self._lock:
            if item.state == _QUEUED:
                item.state = _CANCELLED
                return
            if item.state != _RUNNING or item.thread is None:
                return  # finished meanwhile: its result is dropped
            item.state = _ABANDONED
            item.thread.retired = True
            self._live.discard(item.thread)
            self.abandoned += 1
            alive = self.abandoned
        THREADS_ABANDONED.inc()
        THREADS_ABANDONED_ALIVE.set(alive)
        log.warning(
            "handler_thread_abandoned",
            thread=item.thread.name,
            abandoned_alive=alive,
            max_abandoned=self.max_abandoned,
            detail="the attempt is settled as failed; the thread runs on until its "
            "handler returns, and its ctx.db and ctx.heartbeat calls now fail",
        )
        if alive > self.max_abandoned and not self.exhausted:
            self.exhausted = True
            log.error(
                "worker_abandoned_threads_exceeded",
                abandoned_alive=alive,
                max_abandoned=self.max_abandoned,
                action="stopping gracefully to be restarted by the supervisor",
            )
            if self._on_exhausted is not None:
                self._on_exhausted()

    def _reaped(self) -> None:
        """An abandoned thread's handler returned: the thread has exited."""
        with self._lock:
            self.abandoned -= 1
            alive = self.abandoned
        THREADS_ABANDONED_ALIVE.set(alive)
        log.info("handler_thread_ended", abandoned_alive=alive)

    def close(self) -> None:
        """Let the idle threads exit (safe twice); runs still in flight finish first."""
        self._closed = True
        with self._lock:
            live, self._live = list(self._live), set()
        for _ in live:
            self._work.put(None)
