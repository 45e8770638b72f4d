"""Deliveries that could not reach their database wait until it answers again.

A delivery whose outcome could not be recorded (``DatabaseUnavailable``) goes back to
the queue, but not at once: during an outage that would be a hot redelivery loop. How
long it holds its message (and its prefetch slot) decides how fast a worker recovers.
A delay that grows with every failed delivery does not: a busy worker's deliveries all
fail within the first second of a cut, so every one of them then waits 5-10 s, and a
3 s outage leaves the worker idle for up to 10 s more with its prefetch full of
deliveries waiting out their delays (docs/benchmarks.md, "Recovering from a database
outage").

So a delivery waits for its shard's database to be back, and no longer:

- a delivery of the same shard committed (the database answers), or
- the shard's probe answered: while deliveries wait, one ``SELECT 1`` at a time, every
  0.25 s doubling to 2 s (jittered) while it fails, or
- ``cap`` seconds passed: it goes back either way (another worker may reach the
  database).

A database that answers the probe while deliveries still fail (a pool that cannot hand
out a connection in time, say) must not become a hot loop either: every wake-up by the
probe that no commit follows raises a floor every later wait keeps (0.125-0.25 s,
doubling up to ``cap``); a commit resets it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable

from scheduler.backoff import bounded_jitter
from scheduler.clock import SYSTEM_CLOCK, Clock, wait_event
from scheduler.log import get_logger
from scheduler.metrics import DELIVERIES_AWAITING_DATABASE

__all__ = ["Outage"]

log = get_logger("duetime.worker")

PROBE_BASE = 0.25
PROBE_CAP = 2.0
FLOOR_BASE = 0.25


class Outage:
    """One shard's database as the deliveries that could not reach it see it (module
    docstring). ``wait`` is what such a delivery awaits before going back to the queue;
    ``committed`` is called for every delivery that committed."""

    def __init__(
        self,
        probe: Callable[[], Awaitable[object]],
        *,
        cap: float,
        probe_timeout: float,
        shard: str = "",
        clock: Clock = SYSTEM_CLOCK,
        rng: random.Random | None = None,
    ) -> None:
        self._probe = probe
        self._cap = cap
        self._probe_timeout = probe_timeout
        self._shard = shard
        self._clock = clock
        self._rng = rng
        self._back = asyncio.Event()  # replaced by a fresh one at every wake-up
        self._prober: asyncio.Task[None] | None = None
        self._closed = False
        self.waiting = 0  # deliveries waiting now
        self.failures = 0  # deliveries that could not reach it since the last commit
        self._false_wakes = 0  # probe wake-ups no commit followed

    def committed(self) -> None:
        """A delivery of this shard committed: the database answers. Cheap when nothing
        failed (the hot path calls it for every delivery)."""
        if self.failures or self._false_wakes or self.waiting:
            self.failures = 0
            self._false_wakes = 0
            self._wake()

    async def wait(self) -> float:
        """Wait until the database is back or ``cap`` passed (module docstring); the
        seconds waited."""
        started = self._clock.monotonic()
        back = self._back  # set by a wake-up after this point only
        self.failures += 1
        self.waiting += 1
        gauge = DELIVERIES_AWAITING_DATABASE.labels(self._shard)
        gauge.inc()
        floor = (
            bounded_jitter(self._false_wakes, base=FLOOR_BASE, cap=self._cap, rng=self._rng)
            if self._false_wakes
            else 0.0
        )
        try:
            self._start_probe()
            if floor:
                await self._clock.sleep(floor)
            left = self._cap - (self._clock.monotonic() - started)
            if left > 0:
                await wait_event(back, left, self._clock)
        finally:
            self.waiting -= 1
            gauge.dec()
        return self._clock.monotonic() - started

    async def close(self) -> None:
        """Stop the probe (the worker stops)."""
        self._closed = True
        prober, self._prober = self._prober, None
        if prober is not None:
            prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await prober

    def _wake(self) -> None:
        self._back.set()
        self._back = asyncio.Event()

    def _start_probe(self) -> None:
        if self._closed or (self._prober is not None and not self._prober.done()):
            return
        self._prober = asyncio.create_task(self._probing(), name=f"outage-probe-{self._shard}")

    async def _probing(self) -> None:
        """Probe while deliveries wait; wake them all when the database answers."""
        failed = 0
        started = self._clock.monotonic()
        while self.waiting:
            delay = bounded_jitter(failed + 1, base=PROBE_BASE, cap=PROBE_CAP, rng=self._rng)
            await self._clock.sleep(delay)
            if not self.waiting:
                return
            try:
                await asyncio.wait_for(self._probe(), self._probe_timeout)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failed += 1
                if failed == 1:
                    log.warning(
                        "database_unreachable",
                        shard=self._shard,
                        waiting=self.waiting,
                        error=f"{type(exc).__name__}: {exc}",
                    )
                continue
            if failed:
                log.info(
                    "database_back",
                    shard=self._shard,
                    waiting=self.waiting,
                    after=round(self._clock.monotonic() - started, 3),
                )
            self._false_wakes += 1  # undone by the commit that should follow
            self._wake()
            return
