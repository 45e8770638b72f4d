"""Injectable time. Production code asks a ``Clock`` instead of calling
``datetime.now()``/``time.monotonic()``/``asyncio.sleep`` directly, so tests can
drive time (``ManualClock``) and assert on exact instants without sleeping.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from typing import Protocol


class Clock(Protocol):
    def now(self) -> datetime:
        """Aware UTC wall-clock time."""

    def monotonic(self) -> float:
        """Seconds from an arbitrary origin, never going backwards."""

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    def now(self) -> datetime:
        return datetime.now(UTC)

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class ManualClock:
    """A clock that moves only when told to; ``sleep`` waits until ``advance`` passes it."""

    def __init__(self, start: datetime | None = None) -> None:
        self._now = start or datetime(2026, 1, 1, tzinfo=UTC)
        self._mono = 0.0
        self._changed = asyncio.Event()

    def now(self) -> datetime:
        return self._now

    def monotonic(self) -> float:
        return self._mono

    def advance(self, seconds: float) -> None:
        self._now += timedelta(seconds=seconds)
        self._mono += seconds
        self._changed.set()
        self._changed = asyncio.Event()

    async def sleep(self, seconds: float) -> None:
        until = self._mono + seconds
        while self._mono < until:
            await self._changed.wait()


SYSTEM_CLOCK = SystemClock()


async def wait_event(event: asyncio.Event, seconds: float, clock: Clock = SYSTEM_CLOCK) -> bool:
    """Wait until ``event`` is set or ``seconds`` pass on ``clock``; whether it was set.
    ``asyncio.wait_for`` would time out on the event loop's time, which a
    ``ManualClock`` does not move."""
    if event.is_set():
        return True
    sleeper = asyncio.ensure_future(clock.sleep(seconds))
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({sleeper, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        sleeper.cancel()
        waiter.cancel()
        await asyncio.gather(sleeper, waiter, return_exceptions=True)
    return event.is_set()
