"""Cancelling a running handler (DESIGN §12): how a worker hears of a cancel and stops the
handler it runs.

The guarantee sits in the database, not here: ``JobStore.cancel`` moves the row to
``cancelled`` and every settling function changes only a ``dispatched`` row (migration
0019), so a handler that is not stopped in time still cannot commit: its ``ctx.db``
work is rolled back when it tries (``finish_attempt`` refuses with DT001). What this
module adds is promptness, and not running work whose outcome cannot count:

- the cancel's transaction NOTIFYs ``duetime_cancel`` with the job ids; each worker
  LISTENs on every shard (``CancelWatch``), one connection per shard, and cancels the
  handlers of those ids that it runs (``Cancellations.cancel``): ``asyncio.CancelledError``
  inside the handler, ``ctx.cancelled`` set for cooperative code, and the attempt ends
  with ``HandlerCancelled`` (settled as ``cancelled``: nothing is written, the row
  already says so);
- a NOTIFY sent while the LISTEN connection was down is lost: when the connection is
  (re)opened, and every ``check_interval`` seconds while handlers run, the watch asks
  the database which of the running jobs are cancelled (``worker_cancelled``): a lost
  NOTIFY costs seconds, never the cancel;
- a delivery whose begin read saw ``dispatched`` and which waits for a handler slot
  (``workers.slots``: a slot is taken after the begin) is *waiting* here
  (``Cancellations.waiting``): a cancel heard meanwhile is kept however long it waits,
  the backstop check asks about it too, and its handler never starts
  (``Cancellations.heard``);
- any other cancel heard for a job not running here (the cancel committed just before
  a handler's scope opened) is remembered for ``REMEMBER`` seconds, and the scope
  opening for that job cancels at once.

A job cancelled before its delivery is read never starts: the begin read finds it
``cancelled`` and skips it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from types import TracebackType
from typing import Any

from scheduler.clock import SYSTEM_CLOCK, Clock
from scheduler.log import get_logger
from scheduler.metrics import HANDLERS_CANCELLED
from scheduler.store.execution import ExecutionStore
from scheduler.store.listener import KeptListener

__all__ = [
    "CANCEL_CHANNEL",
    "CancelScope",
    "CancelWatch",
    "Cancellations",
    "HandlerCancelled",
    "parse_ids",
]

log = get_logger("duetime.worker")

#: The NOTIFY channel of cancels (payload: job ids, comma-separated).
CANCEL_CHANNEL = "duetime_cancel"
#: Seconds a cancel heard for a job not (yet) running here is remembered.
REMEMBER = 60.0
#: Seconds between the watch's passes (listener health, remembered cancels expiring).
TICK = 0.5
#: Seconds between database checks of the running jobs (the lost-NOTIFY backstop).
CHECK_INTERVAL = 5.0


class HandlerCancelled(Exception):
    """The job was cancelled while its handler ran: the handler was stopped, its
    ``ctx.db`` work is rolled back, and the row already says ``cancelled``."""


def parse_ids(payload: str) -> list[int]:
    """The job ids of a ``duetime_cancel`` payload; anything else in it is ignored."""
    found = []
    for part in payload.split(","):
        part = part.strip()
        if part.isdigit() and len(part) <= 19:
            found.append(int(part))
    return found


class CancelScope:
    """Where one handler runs (``async with``): ``cancel()`` stops it. Modelled on
    ``asyncio.timeout``: the running task is cancelled, and the ``CancelledError`` that
    comes out of the body is turned into ``HandlerCancelled`` only when this scope caused
    it, so a worker shutdown still propagates as ``CancelledError``."""

    def __init__(self, owner: Cancellations, job_id: int, flag: threading.Event) -> None:
        self._owner = owner
        self.job_id = job_id
        self.flag = flag
        self.requested = False
        self._task: asyncio.Task[Any] | None = None
        self._cancelling = 0
        self._closed = False

    def cancel(self) -> None:
        """Stop the handler. Called from the event loop's callbacks (a NOTIFY, the
        watch), never from the handler's own task, so the task is suspended inside the
        body and the cancellation lands there; a scope already closed ignores it."""
        if self.requested or self._task is None or self._closed:
            return
        self.requested = True
        self.flag.set()
        self._task.cancel(msg=f"job {self.job_id} cancelled")

    async def __aenter__(self) -> CancelScope:
        self._task = asyncio.current_task()
        assert self._task is not None
        self._cancelling = self._task.cancelling()
        self._owner.opened(self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._closed = True
        self._owner.closed(self)
        if not self.requested:
            return
        assert self._task is not None
        remaining = self._task.uncancel()
        if exc_type is asyncio.CancelledError and remaining > self._cancelling:
            return  # cancelled by someone else too (the worker stopping): propagate
        # whatever the handler made of the cancellation (raised it, swallowed it, raised
        # something else), its outcome cannot count: the row is already cancelled
        raise HandlerCancelled("the job was cancelled while its handler ran") from None


class Cancellations:
    """The handlers running in one executor, by job id, the deliveries waiting for a
    slot, and the cancels heard for jobs not running (yet). ``clock`` ages what is
    remembered."""

    def __init__(self, *, shard: str, clock: Clock = SYSTEM_CLOCK) -> None:
        self._shard = shard
        self._clock = clock
        self._scopes: dict[int, CancelScope] = {}
        self._heard: dict[int, float] = {}  # job id -> monotonic time the cancel was heard
        self._waiting: dict[int, int] = {}  # job id -> deliveries of it waiting for a slot

    def scope(self, job_id: int, flag: threading.Event) -> CancelScope:
        return CancelScope(self, job_id, flag)

    def running(self) -> list[int]:
        """The jobs whose cancel this executor acts on: handlers running, and
        deliveries begun and waiting for a slot (the backstop check asks about both)."""
        return list(self._scopes.keys() | self._waiting.keys())

    @contextlib.contextmanager
    def waiting(self, job_id: int) -> Iterator[None]:
        """While a begun delivery waits for a handler slot: a cancel heard for it is
        not forgotten after ``REMEMBER`` seconds (``heard`` tells it at start)."""
        self._waiting[job_id] = self._waiting.get(job_id, 0) + 1
        try:
            yield
        finally:
            left = self._waiting.pop(job_id) - 1
            if left:
                self._waiting[job_id] = left
            elif job_id in self._heard:
                self._heard[job_id] = self._clock.monotonic()  # aged from now on

    def heard(self, job_id: int) -> bool:
        """A cancel for ``job_id`` was heard before its handler started: it must not
        start (the row is, or is about to be, ``cancelled``). Forgets it."""
        return self._heard.pop(job_id, None) is not None

    def opened(self, scope: CancelScope) -> None:
        self._scopes[scope.job_id] = scope
        if self._heard.pop(scope.job_id, None) is not None:
            # from a callback, so that it lands where the handler waits (CancelScope.cancel)
            asyncio.get_running_loop().call_soon(self._stop, scope)

    def closed(self, scope: CancelScope) -> None:
        if self._scopes.get(scope.job_id) is scope:
            del self._scopes[scope.job_id]

    def cancel(self, job_ids: list[int]) -> int:
        """Stop the handlers of ``job_ids`` that run here; remember the others for a
        while. Returns how many handlers were stopped."""
        now = self._clock.monotonic()
        stopped = 0
        for job_id in job_ids:
            scope = self._scopes.get(job_id)
            if scope is None:
                self._heard[job_id] = now
            elif not scope.requested:
                self._stop(scope)
                stopped += 1
        return stopped

    def forget_old(self) -> None:
        horizon = self._clock.monotonic() - REMEMBER
        old = [j for j, at in self._heard.items() if at < horizon and j not in self._waiting]
        for job_id in old:
            del self._heard[job_id]

    def _stop(self, scope: CancelScope) -> None:
        if scope.requested or self._scopes.get(scope.job_id) is not scope:
            return
        HANDLERS_CANCELLED.labels(self._shard).inc()
        log.info("handler_cancel_requested", job_id=scope.job_id)
        scope.cancel()


class CancelWatch:
    """One shard's LISTEN on ``duetime_cancel`` and the backstop check (module
    docstring). ``start()`` runs it as a task of its own; ``close()`` stops it."""

    def __init__(
        self,
        dsn: str,
        cancellations: Cancellations,
        store: ExecutionStore,
        *,
        timeout: float,
        node_id: str,
        check_interval: float = CHECK_INTERVAL,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._cancellations = cancellations
        self._store = store
        self._clock = clock
        self._check_interval = check_interval
        self._listener = KeptListener(
            dsn,
            CANCEL_CHANNEL,
            lambda: None,
            on_payload=self._heard,
            timeout=timeout,
            application_name=f"duetime:cancels:{node_id}"[:63],
            check_interval=30.0,
            log=lambda: log,
            clock=clock,
        )
        self._task: asyncio.Task[None] | None = None
        self._checked_at = 0.0

    def _heard(self, payload: str) -> None:
        self._cancellations.cancel(parse_ids(payload))

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="duetime-cancel-watch")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._listener.close()

    async def _run(self) -> None:
        while True:
            try:
                await self.run_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the database is away: the next pass tries again
                log.warning("cancel_watch_failed", error=f"{type(exc).__name__}: {exc}")
            await self._clock.sleep(TICK)

    async def run_once(self) -> None:
        """One pass: keep the LISTEN connection; check the running jobs when it was just
        (re)opened or ``check_interval`` has passed."""
        fresh = await self._listener.ensure()
        self._cancellations.forget_old()
        now = self._clock.monotonic()
        running = self._cancellations.running()
        if not running or not (fresh or now - self._checked_at >= self._check_interval):
            return
        self._checked_at = now
        cancelled = await self._store.cancelled(running)
        if cancelled:
            self._cancellations.cancel(sorted(cancelled))
