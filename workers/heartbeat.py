"""Heartbeats: a running job's sign of life for the reconciler.

No lock on the job row is held while a handler runs (``workers.executor`` says why), so
``heartbeat_at`` is what keeps the reconciler from publishing a running job again: its
"silent for" clock, and operators (``duetime jobs show``), see that the job is alive.
A beat is one autocommit UPDATE on its own pooled connection, so it is visible at once
and does not conflict with the handler's open transaction. The first automatic beat
comes one interval (visibility_timeout/3) after the handler started, so short jobs never
pay for one.
"""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime
from typing import Any

from scheduler.store.execution import ExecutionStore


class Heartbeat:
    """Automatic and manual heartbeats for one running attempt. ``stop()`` is safe twice."""

    def __init__(
        self,
        store: ExecutionStore,
        *,
        job_id: int,
        due_at: datetime,
        attempt: int,
        interval: float,
        log: Any,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"heartbeat interval must be > 0 (got {interval})")
        self._store = store
        self._job = (job_id, due_at, attempt)
        self.interval = interval
        self._log = log
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.beats = 0
        self.lost = False

    async def beat(self) -> bool:
        """One heartbeat now; False when the job is no longer this attempt's."""
        alive = await self._store.heartbeat(*self._job)
        if alive:
            self.beats += 1
        elif not self.lost:
            self.lost = True
            self._log.warning("heartbeat_job_moved_on")
        return alive

    def start(self) -> None:
        """Arm the first beat one interval from now. A timer, not a task: most attempts
        end before it fires, and a task per delivery (created, then cancelled) was a
        measurable share of a storm's CPU."""
        if self._task is None and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.interval, self._begin)

    def _begin(self) -> None:
        self._timer = None
        self._task = asyncio.create_task(self._loop(), name=f"heartbeat:{self._job[0]}")

    async def stop(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _loop(self) -> None:
        first = True
        while True:
            if not first:
                await asyncio.sleep(self.interval)
            first = False
            try:
                if not await self.beat():
                    return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the database may be briefly away: keep trying
                self._log.warning("heartbeat_failed", error=f"{type(exc).__name__}: {exc}")
