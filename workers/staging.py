"""Staged deliveries: jobs handed to this worker before their run time (DESIGN §14).

The dispatcher publishes a job whose run time is within ``stage_ahead`` seconds to its
queue's staged twin (``duetime.<queue>:staged``), its message carrying the run time
(``start_at``). The worker consumes staged queues on a channel of their own, whose
prefetch (``worker_stage_limit``) bounds what it holds, and keeps each delivery here,
unacked and outside its handler slots, until the run time; then the delivery goes
through the same path as any other (the batched begin, a slot, the handler). So:

- a staged job starts from this worker's timer, not after a claim, a publish and a
  consume that all begin at its run time;
- the row stays authoritative: the begin at start reads it, and a job cancelled, paused
  or moved meanwhile does not run (migration 0028);
- a worker that dies holding staged jobs loses nothing: their messages are unacked, the
  broker redelivers them to another worker, which starts each at its run time if that
  is still ahead, at once otherwise. A worker that stops gives them back (nack) first.

What one staged delivery costs while held: the aio-pika message (its body is a pointer
of ~150 bytes) and one heap entry (docs/benchmarks.md, "Staging ahead").

Times are compared on this host's wall clock against the database's run time, so a
host clock ahead of PostgreSQL's starts jobs early by that much (and one behind, late):
keep workers on NTP, as the leases already require.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import Callable
from datetime import datetime
from typing import Generic, TypeVar

from scheduler.clock import SYSTEM_CLOCK, Clock
from scheduler.log import get_logger
from scheduler.metrics import STAGED_HELD

__all__ = ["StagedDeliveries"]

log = get_logger("duetime.worker")

T = TypeVar("T")

#: A delivery whose run time is at most this far ahead is released now: a timer set for
#: less than a millisecond would cost an event-loop turn for nothing.
EARLY = 0.0005


class StagedDeliveries(Generic[T]):
    """Holds items until their start time, then hands each to ``release`` (in start
    order), from one owned timer task (``start`` / ``close``)."""

    def __init__(self, release: Callable[[T], None], *, clock: Clock = SYSTEM_CLOCK) -> None:
        self._release = release
        self._clock = clock
        self._heap: list[tuple[float, int, T]] = []
        self._order = itertools.count()
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._heap)

    def hold(self, item: T, start_at: datetime) -> None:
        """Keep ``item`` until ``start_at`` (released at the next timer turn when that
        time has passed)."""
        entry = (start_at.timestamp(), next(self._order), item)
        heapq.heappush(self._heap, entry)
        STAGED_HELD.set(len(self._heap))
        if self._heap[0] is entry:
            self._changed.set()  # the timer sleeps for a later start

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="staged:timer")

    async def close(self) -> list[T]:
        """Stop the timer; returns the items still held, earliest first (the caller gives
        them back to the broker)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        held = [item for _, _, item in sorted(self._heap)]
        self._heap.clear()
        STAGED_HELD.set(0)
        return held

    async def _run(self) -> None:
        while True:
            if not self._heap:
                self._changed.clear()
                await self._changed.wait()
                continue
            now = self._clock.now().timestamp()
            if self._heap[0][0] - now > EARLY:
                await self._sleep(self._heap[0][0] - now)
                continue
            while self._heap and self._heap[0][0] - now <= EARLY:
                _, _, item = heapq.heappop(self._heap)
                try:
                    self._release(item)
                except Exception:  # one item must not stop the timer of the others
                    log.exception("staged_release_failed")
            STAGED_HELD.set(len(self._heap))

    async def _sleep(self, seconds: float) -> None:
        """Sleep ``seconds`` or until an earlier item arrives."""
        self._changed.clear()
        sleeper = asyncio.ensure_future(self._clock.sleep(seconds))
        waiter = asyncio.ensure_future(self._changed.wait())
        try:
            await asyncio.wait({sleeper, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            sleeper.cancel()
            waiter.cancel()
