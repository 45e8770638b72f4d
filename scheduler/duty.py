"""One shape for every leader duty (dispatcher, planner, reconciler, maintainer, ...).

A duty is a loop around ``run_once()``: do one pass of work, return how long to wait
before the next pass; ``wake()`` cuts the wait short (a NOTIFY arrived, a new job is
due earlier). The loop lives in one owned asyncio task started by ``start(term)`` and
cancelled by ``stop()``. Contract (after River's startstop):

- ``stop()`` is safe before ``start()`` and safe twice; it awaits the task's cleanup.
- A pass that raises is logged with its traceback and counted, and the loop retries
  after a jittered back-off: a duty never dies silently while the replica still
  claims leadership.
- ``Fenced`` and ``LeadershipLost`` are not retried: they end the task, and the
  replica, which watches ``task``, steps down (a planned stop is told apart from a
  failure by ``stopped_by_request``).

Tests call ``run_once()`` directly; no sleeps needed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import asyncpg

from scheduler.backoff import bounded_jitter
from scheduler.clock import SYSTEM_CLOCK, Clock
from scheduler.errors import Fenced, LeadershipLost
from scheduler.log import get_logger
from scheduler.metrics import DUTY_FAILURES

if TYPE_CHECKING:
    from typing import Self

    from scheduler.config import Settings
    from scheduler.leadership.replica import ReplicaContext


@dataclass(frozen=True, slots=True)
class LeaderTerm:
    """What a duty knows about the leadership it runs under."""

    epoch: int
    node_id: str


class LoopDuty:
    """Base class: subclasses implement ``run_once`` and may override ``setup``/``teardown``."""

    name = "duty"
    max_backoff = 2.0  # a failed pass is cheap; lateness is what §1.5 promises against

    def __init__(self, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        self._term: LeaderTerm | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self.stopped_by_request = False
        self.failures = 0
        self.log: Any = get_logger(f"duetime.{self.name}")

    # -- what subclasses implement ---------------------------------------------------

    async def setup(self) -> None:
        """Acquire per-term resources (connections, LISTEN). Retried like a pass."""

    async def run_once(self) -> float:
        """One pass of work; return seconds to wait before the next pass."""
        raise NotImplementedError

    async def teardown(self) -> None:
        """Release per-term resources; must not raise."""

    # -- lifecycle -------------------------------------------------------------------

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
        ready = False
        try:
            while True:
                try:
                    if not ready:
                        await self.setup()
                        ready = True
                    delay = await self.run_once()
                    self.failures = 0
                except (Fenced, LeadershipLost):
                    raise
                except asyncio.CancelledError:
                    raise
                except Exception:
                    if _cancel_requested():
                        raise asyncio.CancelledError from None
                    self.failures += 1
                    DUTY_FAILURES.labels(self.name).inc()
                    delay = bounded_jitter(self.failures, base=0.2, cap=self.max_backoff)
                    self.log.exception(
                        "duty_failed", duty=self.name, failures=self.failures, retry_in=delay
                    )
                    if ready:
                        ready = False
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
        teardown = asyncio.ensure_future(self.teardown())
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


class LeaderDuty(LoopDuty):
    """A duty that writes through fenced transactions (dispatcher, reconciler, planner,
    maintainer): the replica's settings and pool, and the lease check before each write.

    ``_check_leader()`` fails closed: once the lease can no longer be proven alive the
    duty raises ``LeadershipLost`` before it opens a fenced transaction, although the
    fence would refuse a stale commit anyway (an early stop saves a doomed round trip).
    ``fenced_write`` names the write in that error.
    """

    fenced_write = "fenced write"

    def __init__(
        self,
        settings: Settings,
        pool: asyncpg.Pool,
        *,
        clock: Clock = SYSTEM_CLOCK,
        is_leader: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__(clock=clock)
        self.settings = settings
        self.pool = pool
        self._is_leader = is_leader

    @classmethod
    def from_context(cls, ctx: ReplicaContext) -> Self:
        """The duty a replica runs: its settings, pool, clock and lease check."""
        return cls(ctx.settings, ctx.pool, clock=ctx.clock, is_leader=ctx.is_leader)

    def _check_leader(self) -> None:
        if self._is_leader is not None and not self._is_leader():
            raise LeadershipLost(f"lease not provably alive before a {self.fenced_write}")
