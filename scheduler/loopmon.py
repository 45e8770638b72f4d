"""Event-loop lag monitor: the asyncio form of a GC pause, made visible.

A coroutine that blocks (a synchronous DNS lookup, a big ``json.loads``, a CPU-bound
loop) stalls *every* task of the process: lease renewals, duty passes, heartbeats. The
leader's trust window already subtracts a safety margin for such stalls; this monitor
says when one happened and how long it was, so an operator can tell "etcd was slow"
from "our own loop was stuck".

How: one owned task sleeps a fixed ``interval`` and measures how much later than asked
it woke up. Every wake-up is observed in ``duetime_event_loop_lag_seconds``; a lag above
``threshold`` also logs ``event_loop_blocked`` (warning).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from scheduler.clock import SYSTEM_CLOCK, Clock
from scheduler.log import get_logger
from scheduler.metrics import EVENT_LOOP_LAG

DEFAULT_INTERVAL = 0.1
DEFAULT_THRESHOLD = 0.5

log = get_logger(__name__)


def wake_lag(started: float, woke: float, interval: float) -> float:
    """How late a sleep of ``interval`` begun at ``started`` woke at ``woke`` (>= 0)."""
    return max(0.0, woke - started - interval)


class LoopMonitor:
    """Measures event-loop scheduling delay until stopped. ``stop()`` is safe twice."""

    def __init__(
        self,
        *,
        interval: float = DEFAULT_INTERVAL,
        threshold: float = DEFAULT_THRESHOLD,
        clock: Clock = SYSTEM_CLOCK,
        logger: Any = None,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be > 0 (got {interval})")
        if threshold <= 0:
            raise ValueError(f"threshold must be > 0 (got {threshold})")
        self.interval = interval
        self.threshold = threshold
        self.clock = clock
        self.log = logger or log
        self.max_lag = 0.0
        self.blocked_count = 0
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> asyncio.Task[None]:
        if self.running:
            raise RuntimeError("loop monitor already running")
        self._task = asyncio.create_task(self._run(), name="loop-monitor")
        return self._task

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    def observe(self, lag: float) -> None:
        """Record one measured lag (metric, maximum, and a warning above the threshold)."""
        EVENT_LOOP_LAG.observe(lag)
        self.max_lag = max(self.max_lag, lag)
        if lag > self.threshold:
            self.blocked_count += 1
            self.log.warning("event_loop_blocked", lag=round(lag, 3), threshold=self.threshold)

    async def _run(self) -> None:
        while True:
            started = self.clock.monotonic()
            await asyncio.sleep(self.interval)
            self.observe(wake_lag(started, self.clock.monotonic(), self.interval))
