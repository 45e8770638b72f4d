"""The loop every leader duty runs in, and the leadership term it runs under.

A duty is any object with a ``name`` and ``async run_once() -> float`` (one pass of
work; it returns how long to wait before the next pass), and optionally ``setup()`` /
``teardown()`` (per-term resources: connections, LISTEN). It owns a ``DutyLoop``
(``duty.loop``) that runs it in one owned asyncio task, started by ``start(term)`` and
cancelled by ``stop()``; ``wake()`` cuts the wait short (a NOTIFY arrived, a new job
is due earlier). Contract (after River's startstop):

- ``stop()`` is safe before ``start()`` and safe twice; it awaits the task's cleanup.
- A pass that raises is logged with its traceback and counted (per shard and duty),
  and the loop retries after a jittered back-off: a duty never dies silently while the
  replica still claims leadership.
- ``Fenced`` and ``LeadershipLost`` are not retried: they end the task, and the
  replica, which watches ``task``, steps down (a planned stop is told apart from a
  failure by ``stopped_by_request``).

Tests call ``run_once()`` directly after ``loop.bind(term)``; no sleeps needed.

Every duty is built the same way, from the replica's ``DutyContext``
(``scheduler.duties.context``); its settings-to-config step is
``scheduler.duties.knobs``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from scheduler.backoff import bounded_jitter
from scheduler.config.shards import DEFAULT_SHARD
from scheduler.errors import Fenced, LeadershipLost
from scheduler.log import get_logger
from scheduler.metrics import DUTY_FAILURES

#: A failed pass is cheap; lateness is what guarantee 5 promises against.
MAX_BACKOFF = 2.0


@dataclass(frozen=True, slots=True)
class LeaderTerm:
    """What a duty knows about the leadership it runs under."""

    epoch: int
    node_id: str


class Work(Protocol):
    """What a ``DutyLoop`` runs: ``setup()`` and ``teardown()`` are optional."""

    name: str

    async def run_once(self) -> float: ...


class Duty(Protocol):
    """What the replica runs: a named duty and the loop it owns."""

    name: str
    loop: DutyLoop


class DutyLoop:
    """The owned loop around one duty's ``run_once`` (see the module docstring)."""

    def __init__(
        self, work: Work, *, shard: str = DEFAULT_SHARD, max_backoff: float = MAX_BACKOFF
    ) -> None:
        self.work = work
        self.name = work.name
        self.shard = shard  # the label of the duty's failures: whose work failed
        self.max_backoff = max_backoff
        self._setup: Callable[[], Awaitable[None]] | None = getattr(work, "setup", None)
        self._teardown: Callable[[], Awaitable[None]] | None = getattr(work, "teardown", None)
        self._term: LeaderTerm | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self.stopped_by_request = False
        self.failures = 0
        self.log: Any = get_logger(f"duetime.{self.name}")

    @property
    def term(self) -> LeaderTerm:
        if self._term is None:
            raise RuntimeError(f"duty {self.name} used outside a leadership term")
        return self._term

    @property
    def task(self) -> asyncio.Task[None] | None:
        return self._task

    def bind(self, term: LeaderTerm) -> None:
        """Set the term without starting the loop (tests drive ``run_once`` directly)."""
        self._term = term
        self.log = get_logger(f"duetime.{self.name}", node_id=term.node_id, epoch=term.epoch)

    def start(self, term: LeaderTerm) -> asyncio.Task[None]:
        if self._task is not None and not self._task.done():
            raise RuntimeError(f"duty {self.name} already running")
        self.bind(term)
        self.stopped_by_request = False
        self.failures = 0
        self._task = asyncio.create_task(self._loop(), name=f"duty:{self.name}")
        return self._task

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        self.stopped_by_request = True
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Fenced, LeadershipLost):
            await task
        # a task that died with any other error was logged by _loop already

    def wake(self) -> None:
        self._wake.set()

    async def _loop(self) -> None:
        ready = self._setup is None
        try:
            while True:
                try:
                    if not ready:
                        assert self._setup is not None
                        await self._setup()
                        ready = True
                    delay = await self.work.run_once()
                    self.failures = 0
                except (Fenced, LeadershipLost):
                    raise
                except asyncio.CancelledError:
                    raise
                except Exception:
                    if _cancel_requested():
                        raise asyncio.CancelledError from None
                    self.failures += 1
                    DUTY_FAILURES.labels(self.shard, self.name).inc()
                    delay = bounded_jitter(self.failures, base=0.2, cap=self.max_backoff)
                    self.log.exception(
                        "duty_failed", duty=self.name, failures=self.failures, retry_in=delay
                    )
                    if ready:
                        ready = self._setup is None
                        await self._safe_teardown()
                if _cancel_requested():
                    raise asyncio.CancelledError
                await self._sleep(delay)
        finally:
            await self._safe_teardown()

    async def _safe_teardown(self) -> None:
        """Run ``teardown`` to its end even when ``stop()`` cancels us meanwhile, then let
        that cancellation through: swallowed here (teardown after a failed pass), it
        would keep the loop running until the replica's stop timeout (10 s)."""
        if self._teardown is None:
            return
        teardown = asyncio.ensure_future(self._teardown())
        try:
            await asyncio.shield(teardown)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await teardown
            raise
        except Exception:
            self.log.exception("duty_teardown_failed", duty=self.name)

    async def _sleep(self, delay: float) -> None:
        if self._wake.is_set():
            self._wake.clear()
            return
        if delay <= 0:
            await asyncio.sleep(0)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout=delay)
        self._wake.clear()


def _cancel_requested() -> bool:
    """``stop()`` cancelled the running task, even if the pass it interrupted answered
    with another error or returned: asyncpg turns a cancelled query on a connection that
    died meanwhile into ``InterfaceError`` ("connection is closed"); taken for a failed
    pass, it would keep the loop running until the replica's stop timeout (10 s)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
