"""What ``/readyz`` and ``/healthz`` answer (``scheduler.observability`` serves them).

- **Readiness** (``Readiness``): every registered check passes. Checks are the
  process's own callables (``{"db": ..., "amqp": ..., "etcd": ...}``), sync or async; a
  check passes unless it raises, returns ``False`` or outlives its timeout. Concurrent
  callers share one evaluation, so a hammering prober cannot multiply the load on the
  dependencies. Once draining (shutdown began) the answer is ``shutting_down``.
- **Liveness** (``LoopWatch``): the event loop is responsive. A small watcher task
  wakes every ``interval`` and notes how late it woke; the process counts as stalled
  while that lag, or the time since its last wake-up, exceeds ``stall_threshold``. It
  does not feed ``duetime_event_loop_lag_seconds``: ``scheduler.loopmon.LoopMonitor``
  owns that metric, so a process running both does not count every stall twice.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from scheduler.clock import SYSTEM_CLOCK, Clock
from scheduler.log import scrub

__all__ = ["Check", "CheckResult", "LoopWatch", "NotReady", "Readiness", "ReadinessReport"]

Check = Callable[[], Awaitable[object] | object]
"""A readiness check: passes unless it raises or returns ``False``."""


class NotReady(Exception):
    """Raised by a check to say why it fails (the text is the check's ``error``)."""


@dataclass(frozen=True, slots=True)
class CheckResult:
    name: str
    ok: bool
    seconds: float
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ok": self.ok, "seconds": round(self.seconds, 4)}
        if self.error is not None:
            out["error"] = self.error
        return out


@dataclass(frozen=True, slots=True)
class ReadinessReport:
    ready: bool
    checks: tuple[CheckResult, ...] = ()
    failing: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": "ready" if self.ready else "not_ready",
            "failing": list(self.failing),
            "checks": {c.name: c.to_dict() for c in self.checks},
        }


class Readiness:
    """The registered checks, each bounded by ``timeout`` seconds."""

    def __init__(
        self,
        checks: Mapping[str, Check] | None,
        *,
        timeout: float,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.timeout = timeout
        self.clock = clock  # times each check's duration
        self.draining = False
        self._checks: dict[str, Check] = dict(checks or {})
        self._evaluation: asyncio.Task[ReadinessReport] | None = None

    def add(self, name: str, check: Check) -> None:
        self._checks[name] = check

    def remove(self, name: str) -> None:
        self._checks.pop(name, None)

    async def report(self) -> ReadinessReport:
        """Run the checks (sharing an evaluation already in flight) and report."""
        if self.draining:
            return ReadinessReport(False, (), ("shutting_down",))
        if self._evaluation is None or self._evaluation.done():
            self._evaluation = asyncio.create_task(self._evaluate(), name="observability:readyz")
        return await asyncio.shield(self._evaluation)

    def take_evaluation(self) -> asyncio.Task[ReadinessReport] | None:
        """The evaluation in flight, for its owner to cancel at close (and forget)."""
        evaluation, self._evaluation = self._evaluation, None
        return evaluation

    async def _evaluate(self) -> ReadinessReport:
        names = sorted(self._checks)
        results = await asyncio.gather(*(self._run(n, self._checks[n]) for n in names))
        failing = tuple(r.name for r in results if not r.ok)
        return ReadinessReport(not failing, tuple(results), failing)

    async def _run(self, name: str, check: Check) -> CheckResult:
        started = self.clock.monotonic()
        try:
            async with asyncio.timeout(self.timeout):
                value = check()
                if inspect.isawaitable(value):
                    value = await value
        except TimeoutError:
            error: str | None = f"timed out after {self.timeout:g}s"
        except Exception as exc:
            error = scrub(f"{type(exc).__name__}: {exc}")[:500]
        else:
            error = "check returned false" if value is False else None
        return CheckResult(name, error is None, self.clock.monotonic() - started, error)


class LoopWatch:
    """How late the event loop wakes up; ``run()`` is the watcher task's body.

    The lag of one wake-up is measured on the loop's own clock (it is the loop that is
    being watched); the time since the last tick and the uptime come from ``clock``, so
    a test can tell a stalled watcher from a live one without stalling a loop."""

    def __init__(
        self, *, interval: float, stall_threshold: float, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self.interval = interval
        self.stall_threshold = stall_threshold
        self.clock = clock
        self.lag = 0.0
        self.last_tick = clock.monotonic()
        self._started_at = clock.monotonic()

    async def run(self) -> None:
        self.last_tick = self.clock.monotonic()
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(self.interval)
            self.lag = max(0.0, loop.time() - before - self.interval)
            self.last_tick = self.clock.monotonic()

    def liveness(self) -> tuple[bool, dict[str, Any]]:
        since_tick = self.clock.monotonic() - self.last_tick
        lag = max(self.lag, since_tick - self.interval)
        alive = lag <= self.stall_threshold
        return alive, {
            "status": "ok" if alive else "stalled",
            "loop_lag_seconds": round(max(lag, 0.0), 4),
            "uptime_seconds": round(self.clock.monotonic() - self._started_at, 1),
        }
