"""Heartbeats: a running job's sign of life for the reconciler.

While a handler runs, its transaction holds the job row FOR KEY SHARE, which already
makes the reconciler's ``FOR UPDATE SKIP LOCKED`` pass it by. ``heartbeat_at`` is the
second, visible signal: operators (``duetime jobs show``) and the reconciler's
"silent for" clock see that the job is alive. A beat is one autocommit UPDATE on its own
pooled connection, so it is visible at once and does not conflict with the open
transaction. The first automatic beat comes one interval (visibility_timeout/3) after
the handler started, so short jobs never pay for one.
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
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=f"heartbeat:{self._job[0]}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                if not await self.beat():
                    return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the database may be briefly away: keep trying
                self._log.warning("heartbeat_failed", error=f"{type(exc).__name__}: {exc}")
