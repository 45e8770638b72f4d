"""The replica: the glue between the etcd election and the leader's duties (architecture.md §6).

``election.py`` decides *whether* this process may lead; this module decides *what
runs* while it does. Each transition is logged with ``node_id`` and ``epoch``::

    campaigning ──won──▶ elected ──fence advanced──▶ leading (duties run)
         ▲                  │ fence ahead/error          │ hold() lost the lease, a duty
         │                  ▼                            ▼ ended (Fenced, ...), or stop
         └──── resigned ◀── stepping_down ◀──────────────┘

Rules, and why:

- **Fence first.** Duties start only after ``leader_fence`` holds our epoch. If the
  fence already holds a newer one, a newer leader exists (or the etcd cluster was
  rebuilt and its revisions restarted: ``fence_ahead`` says so): we resign instead of
  acting. While the fence update waits for a paused predecessor's open transaction
  (PostgreSQL kills it after ``idle_in_transaction_session_timeout`` ≈ TTL, set on our
  pool), ``hold()`` already renews the lease.
- **Watch everything, fail closed.** ``hold()`` and every duty's task are awaited
  together; whichever ends first ends the term: a lost lease, a duty that saw
  ``Fenced``/``LeadershipLost``, or a duty task that died for any other reason (a duty
  must never be dead while the replica still claims leadership; passes that raise are
  retried inside the duty, with back-off, and never end its task).
- **Stop duties before anything else.** On every step-down all duties are stopped and
  their cleanup awaited (bounded) before metrics change and before resigning, so once
  ``resigned`` is logged nothing of that term still runs here.
- **Resign whenever possible.** Deleting the key (if still ours) lets a standby win at
  once instead of waiting for the lease to expire; SIGTERM handover relies on it.
- **No flapping.** A term shorter than one TTL counts as a failure; consecutive ones
  delay the next campaign with jittered back-off (e.g. a fence that is ahead).

The duty list comes from a factory called once per replica with a ``DutyContext``
(pool, settings, clock, node id, fence), so ``duetime scheduler`` passes
``scheduler.duties.default_duties`` and tests pass whatever they need. Starting,
watching and stopping them is ``scheduler.leadership.duty_set``; the pure decisions
(why a term ended, the re-campaign delay, the session settings) are
``scheduler.leadership.policy``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import structlog

from scheduler import db
from scheduler.backoff import bounded_jitter
from scheduler.clock import SYSTEM_CLOCK, Clock
from scheduler.config import Settings
from scheduler.duties.base import Duty, LeaderTerm
from scheduler.duties.context import DutyContext
from scheduler.errors import ServiceUnavailable, describe
from scheduler.leadership.duty_set import DutiesFactory, DutySet
from scheduler.leadership.election import Election, Term
from scheduler.leadership.etcd_client import etcd_tls
from scheduler.leadership.lifecycle import run_replica
from scheduler.leadership.policy import (
    Transition,
    recampaign_delay,
    session_settings,
    term_end_reason,
)
from scheduler.leadership.takeover import advance_fence
from scheduler.log import get_logger
from scheduler.metrics import IS_LEADER, LEADER_EPOCH, LEADER_TRANSITIONS
from scheduler.store.fence import FenceStore

__all__ = ["Replica"]

log = get_logger(__name__)

POOL_SIZE = 10
DUTY_STOP_TIMEOUT = 10.0  # a duty whose cleanup takes longer is abandoned (and logged)
CLOSE_TIMEOUT = 5.0


# -- the replica -------------------------------------------------------------------------


class Replica:
    """One scheduler replica: campaigns, leads (duties), steps down, campaigns again."""

    def __init__(
        self,
        settings: Settings,
        duties_factory: DutiesFactory,
        *,
        clock: Clock = SYSTEM_CLOCK,
        pool_size: int = POOL_SIZE,
        duty_stop_timeout: float = DUTY_STOP_TIMEOUT,
    ) -> None:
        self.settings = settings
        self.node_id = settings.node_id
        self.clock = clock
        self._duties_factory = duties_factory
        self._pool_size = pool_size
        self._duty_stop_timeout = duty_stop_timeout
        self._duties = DutySet([])
        self._pool: asyncpg.Pool | None = None
        self._election: Election | None = None
        self._fence: FenceStore | None = None
        self.term: LeaderTerm | None = None  # set while leading (fence advanced, duties up)
        self.transitions: deque[Transition] = deque(maxlen=200)
        self._short_terms = 0
        self._log = log.bind(node_id=self.node_id, epoch=None)

    # -- public ----------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """Leading and still inside the lease's trust window."""
        return self.term is not None and self._election is not None and self._election.is_leader()

    @property
    def election(self) -> Election | None:
        return self._election

    @property
    def pool(self) -> asyncpg.Pool | None:
        """The replica's PostgreSQL pool while it runs (None before and after)."""
        return self._pool

    async def etcd_check(self) -> bool:
        """Readiness: one bounded read of the election key (raises when etcd is away)."""
        if self._election is None:
            return False
        await self._election.current_leader()
        return True

    async def run_until_stopped(
        self, stop: asyncio.Event, *, on_ready: Callable[[], None] | None = None
    ) -> None:
        """Campaign and lead until ``stop`` is set; then resign and close everything.

        ``on_ready`` is called once the database pool is up and the duties are built
        (systemd ``READY=1``). PostgreSQL being unreachable at start is retried with
        back-off until ``stop`` (``scheduler.startup``); a permanent refusal (bad
        password, no such database) raises ``ServiceUnavailable`` at once.
        """
        await run_replica(
            node_id=self.node_id,
            stop=stop,
            open_=self._open,
            body=lambda stop_waiter: self._run(stop, stop_waiter),
            close=self._close,
            on_ready=on_ready,
        )

    # -- setup and teardown -----------------------------------------------------------

    async def _open(self) -> None:
        settings = self.settings
        self._pool = await db.pool_from_settings(
            settings, max_size=self._pool_size, server_settings=session_settings(settings)
        )
        try:
            self._fence = FenceStore(self._pool, acquire_timeout=settings.db_timeout)
            self._election = Election(
                list(settings.etcd_endpoints),
                settings.etcd_prefix,
                self.node_id,
                settings.lease_ttl,
                settings.lease_safety_margin,
                settings.etcd_timeout,
                self.clock,
                settings.etcd_username,
                settings.etcd_password,
                tls=etcd_tls(settings),
            )
            ctx = DutyContext(
                settings=settings,
                pool=self._pool,
                fence=self._fence,
                clock=self.clock,
                node_id=self.node_id,
                is_leader=self._election.is_leader,
            )
            self._duties = DutySet(self._duties_factory(ctx), stop_timeout=self._duty_stop_timeout)
        except BaseException:
            await self._close()
            raise
        self._log.info(
            "replica_started",
            duties=self._duties.names,
            election_key=self._election.key,
            lease_ttl=settings.lease_ttl,
        )

    async def _close(self) -> None:
        election, self._election = self._election, None
        if election is not None:
            await self._close_bounded("election", election.close())
        pool, self._pool = self._pool, None
        if pool is not None and not await self._close_bounded("pool", pool.close()):
            pool.terminate()
        self._log.info("replica_stopped")

    async def _close_bounded(self, what: str, closing: Awaitable[None]) -> bool:
        """Await ``closing`` for at most ``CLOSE_TIMEOUT``; False (logged) if it failed."""
        try:
            await asyncio.wait_for(closing, CLOSE_TIMEOUT)
        except Exception as exc:
            self._log.warning(f"{what}_close_failed", error=describe(exc))
            return False
        return True

    # -- the election loop ------------------------------------------------------------

    async def _run(self, stop: asyncio.Event, stop_waiter: asyncio.Task[Any]) -> None:
        ttl = self.settings.lease_ttl
        while not stop.is_set():
            term = await self._campaign(stop_waiter)
            if term is None:
                return
            started = self.clock.monotonic()
            reason = await self._lead(term, stop_waiter)
            if reason == "stopped" or stop.is_set():
                return
            lasted = self.clock.monotonic() - started
            self._short_terms = 0 if lasted >= ttl else self._short_terms + 1
            delay = recampaign_delay(self._short_terms, ttl)
            if delay > 0:
                self._log.info(
                    "campaign_delayed", delay=round(delay, 3), short_terms=self._short_terms
                )
                await asyncio.wait({stop_waiter}, timeout=delay)

    async def _campaign(self, stop_waiter: asyncio.Task[Any]) -> Term | None:
        """Return the won term, or None once stop is requested (resigning a late win)."""
        assert self._election is not None
        election = self._election
        self._log.info("campaigning")
        failures = 0
        while True:
            task = asyncio.create_task(election.campaign(), name="election:campaign")
            try:
                await asyncio.wait({task, stop_waiter}, return_when=asyncio.FIRST_COMPLETED)
            finally:  # stop requested, or this replica cancelled: the campaign ends too
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
            if task.cancelled():
                return None
            exc = task.exception()
            if exc is None:
                term = task.result()
                if stop_waiter.done():  # won and asked to stop in the same instant
                    await self._resign(term)
                    return None
                return term
            if isinstance(exc, ServiceUnavailable) and not exc.transient:
                raise exc  # etcd refused our credentials: the process exits with this line
            # campaign() retries etcd errors itself: anything else is a bug; retry slowly
            failures += 1
            delay = bounded_jitter(failures, base=0.5, cap=self.settings.lease_ttl * 4)
            self._log.error(
                "campaign_failed", error=describe(exc), retry_in=round(delay, 3), exc_info=exc
            )
            await asyncio.wait({stop_waiter}, timeout=delay)
            if stop_waiter.done():
                return None

    async def _lead(self, term: Term, stop_waiter: asyncio.Task[Any]) -> str:
        """One term, from the won campaign to the resignation. Returns the reason it ended."""
        assert self._election is not None
        epoch = term.epoch
        tlog = self._log.bind(epoch=epoch)
        with structlog.contextvars.bound_contextvars(epoch=epoch):
            tlog.info("elected", lease_id=term.lease_id)
            self._record("elected", epoch, None)
            hold = asyncio.create_task(self._election.hold(term), name=f"election:hold:{epoch}")
            running: list[Duty] = []
            reason, detail = "stopped", "cancelled"
            try:
                reason, detail = await self._advance_fence(term, hold, stop_waiter, tlog)
                if not reason:
                    leader_term = LeaderTerm(epoch, self.node_id)
                    running = self._duties.start(leader_term, tlog)
                    self.term = leader_term
                    IS_LEADER.set(1)
                    LEADER_EPOCH.set(epoch)
                    LEADER_TRANSITIONS.labels("elected").inc()
                    tlog.info("leading", duties=[d.name for d in running])
                    self._record("leading", epoch, None)
                    reason, detail = await self._watch(hold, stop_waiter)
            except asyncio.CancelledError:
                reason, detail = "stopped", "replica cancelled"
                raise
            except Exception as exc:  # a bug here must still end the term cleanly
                tlog.exception("term_failed")
                reason, detail = "error", describe(exc)
                raise
            finally:
                tlog.info("stepping_down", reason=reason, detail=detail)
                self._record("stepping_down", epoch, reason)
                await self._duties.stop(tlog)
                if running:
                    tlog.info("duties_stopped", reason=reason)
                self.term = None
                if running:
                    IS_LEADER.set(0)
                    LEADER_EPOCH.set(0)
                LEADER_TRANSITIONS.labels(reason).inc()
                hold.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await hold
                await self._resign(term)
                tlog.info("resigned", reason=reason)
                self._record("resigned", epoch, reason)
        return reason

    async def _advance_fence(
        self, term: Term, hold: asyncio.Task[Any], stop_waiter: asyncio.Task[Any], tlog: Any
    ) -> tuple[str, str]:
        """Raise the fence to our epoch while ``hold`` keeps the lease; ("", "") on success."""
        assert self._fence is not None
        outcome = await advance_fence(
            self._fence,
            term.epoch,
            self.node_id,
            self.settings,
            abort={hold, stop_waiter},
            log=tlog,
        )
        if outcome is None:
            return term_end_reason(hold=hold, duties={}, stopped=stop_waiter.done())
        return outcome

    async def _watch(
        self, hold: asyncio.Task[Any], stop_waiter: asyncio.Task[Any]
    ) -> tuple[str, str]:
        tasks, missing = self._duties.tasks()
        if missing is not None:
            return "duty_exited", f"{missing}: not running"
        await asyncio.wait(
            {hold, stop_waiter, *tasks.values()}, return_when=asyncio.FIRST_COMPLETED
        )
        return term_end_reason(hold=hold, duties=tasks, stopped=stop_waiter.done())

    async def _resign(self, term: Term) -> None:
        assert self._election is not None
        budget = self.settings.etcd_timeout * 3 + 1.0
        try:
            await asyncio.wait_for(self._election.resign(term), budget)
        except Exception as exc:  # resign never raises on etcd trouble; bugs are logged
            self._log.warning("resign_failed", epoch=term.epoch, error=describe(exc))

    def _record(self, event: str, epoch: int, reason: str | None) -> None:
        self.transitions.append(Transition(event, epoch, reason, self.clock.monotonic()))
