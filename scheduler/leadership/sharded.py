"""The sharded replica: one node leading several shards, each with its own fenced duties.

``scheduler.shards.leadership.ShardLeadership`` decides *which* shards this node may
lead (one node lease, one election key per shard, balanced assignment); this module
decides *what runs* for each of them. It is the per-shard counterpart of
``replica.Replica`` and keeps its rules, per shard (architecture.md §5 "Shards", §6)::

    gained(shard, epoch) ──fence advanced──▶ leading (the shard's duties run)
        │ fence ahead / fence error           │ lost(shard): rebalance, lease, key gone
        ▼                                     ▼ a duty task ended (Fenced, crash), stop
    handed over ◀── stepping_down ◀───────────┘

- **Per shard, everything of its own.** A pool on the shard's database (opened at
  start, sized for the duties), a ``FenceStore`` on it, and a ``DutySet`` built once by
  the same duties factory from a ``DutyContext`` whose settings point at the shard's
  database (``database_url``: the duties' LISTEN connections), whose ``is_leader`` is
  ``leadership.is_leader(shard)`` and whose ``shard`` names the shard in every message
  the dispatcher and reconciler publish.
- **Fence first.** On ``gained`` the shard's fence is raised to the epoch
  (``takeover.advance_fence``, as the single replica does) before its duties start with
  ``LeaderTerm(epoch, node_id)``.
- **Stop duties before anything else.** On ``lost`` the shard's duties are stopped and
  their cleanup awaited (bounded, ``DutySet`` semantics) before the handler returns;
  ``ShardLeadership`` deletes a handed-over key only after that, so a standby never
  starts while this node's duties of that shard still run.
- **Fail closed, then hand over.** A fence that is ahead, a fence error, or a duty task
  that ends (``Fenced``, ``LeadershipLost``, a crash) stops that shard's duties and
  hands the shard over (``ShardLeadership.hand_over``); the other shards carry on.
- **No flapping.** A shard handed over for a failure is not campaigned for again by
  this node for ``recampaign_delay(failures, ttl)`` (jittered, from TTL/8 up to 4 TTL),
  where ``failures`` counts that shard's consecutive failed terms shorter than one TTL
  (a failure after a healthy term counts as the first). Another node may take it at
  once; this one waits.
- **Stop.** Every shard's duties are stopped first, then ``leadership.stop()`` revokes
  the lease, so standbys take every shard over at once.

Every transition is logged with ``shard``, ``node_id`` and ``epoch`` and counted in
``duetime_shard_transitions_total{shard,reason}``; ``duetime_shard_is_leader{shard}``
and ``duetime_shard_epoch{shard}`` follow the running duties, and the unlabelled
``duetime_is_leader`` is 1 while this node leads at least one shard.

It lives beside ``replica`` (not in ``scheduler.shards``) because it is the same glue
between an election and the duties: it shares ``duty_set``, ``policy`` and
``takeover`` with the single replica, while ``scheduler.shards`` stays free of duties.
It is one module of ~470 lines because a shard's whole term (gained, fence, duties,
watch, hand-over, lost) must read as one state machine, as ``replica`` reads for one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import structlog

from scheduler import db
from scheduler.clock import SYSTEM_CLOCK, Clock
from scheduler.config import Settings
from scheduler.duties.base import LeaderTerm
from scheduler.duties.context import DutyContext
from scheduler.errors import ConfigError
from scheduler.leadership.duty_set import DUTY_STOP_TIMEOUT, DutiesFactory, DutySet
from scheduler.leadership.etcd_client import etcd_tls
from scheduler.leadership.lifecycle import run_replica
from scheduler.leadership.policy import (
    Transition,
    describe,
    recampaign_delay,
    session_settings,
    term_end_reason,
)
from scheduler.leadership.takeover import advance_fence
from scheduler.log import get_logger
from scheduler.metrics import (
    IS_LEADER,
    SHARD_EPOCH,
    SHARD_IS_LEADER,
    SHARD_TRANSITIONS,
)
from scheduler.shards.leadership import ShardEvent, ShardLeadership
from scheduler.store.fence import FenceStore

__all__ = ["SHARD_POOL_SIZE", "ShardTransition", "ShardedReplica"]

log = get_logger(__name__)

#: Connections per shard: the five default duties hold at most one pooled connection
#: each at a time (claim, plan, reconcile, maintain, heartbeat) and the fence advance
#: one more; LISTEN connections are their own.
SHARD_POOL_SIZE = 6
CLOSE_TIMEOUT = 5.0
#: Step-down reasons after which the shard is handed over and held off (not campaigned
#: for again by this node at once).
FAILURES = frozenset({"fenced", "fence_error", "duty_exited", "error"})


@dataclass(frozen=True, slots=True)
class ShardTransition:
    """One logged state change of one shard, kept in ``ShardedReplica.transitions``."""

    shard: str
    transition: Transition


@dataclass(eq=False)
class _Shard:
    """What this node holds for one shard, for the life of the replica."""

    name: str
    settings: Settings
    pool: asyncpg.Pool
    fence: FenceStore
    duties: DutySet
    term: LeaderTerm | None = None  # set while leading (fence advanced, duties up)
    task: asyncio.Task[None] | None = None  # the current term's lead task
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    lost_reason: str = "lost"  # why ``lost`` was set (a ShardLeadership reason)
    handing_over: bool = False
    failures: int = 0  # consecutive failed short terms: the hold-off grows with them


class ShardedReplica:
    """A scheduler replica that leads its share of ``settings.shards``."""

    def __init__(
        self,
        settings: Settings,
        duties_factory: DutiesFactory,
        *,
        clock: Clock = SYSTEM_CLOCK,
        pool_size: int = SHARD_POOL_SIZE,
        duty_stop_timeout: float = DUTY_STOP_TIMEOUT,
        poll_interval: float = 0.5,
    ) -> None:
        if settings.shards is None:
            raise ConfigError("ShardedReplica needs settings.shards (DUETIME_SHARDS)")
        self.settings = settings
        self.node_id = settings.node_id
        self.clock = clock
        self._duties_factory = duties_factory
        self._pool_size = pool_size
        self._duty_stop_timeout = duty_stop_timeout
        self._poll_interval = min(poll_interval, settings.lease_ttl)
        self._shards: dict[str, _Shard] = {}
        self._leadership: ShardLeadership | None = None
        self._stopping = False
        self.transitions: deque[ShardTransition] = deque(maxlen=500)
        self._log = log.bind(node_id=self.node_id)

    # -- public ----------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """Leading at least one shard (duties up) inside the lease's trust window."""
        return bool(self.leading())

    def leading(self) -> dict[str, int]:
        """Shard -> epoch of every shard this node leads right now (duties up, trusted)."""
        leadership = self._leadership
        if leadership is None:
            return {}
        return {
            name: s.term.epoch
            for name, s in self._shards.items()
            if s.term is not None and leadership.is_leader(name)
        }

    @property
    def leadership(self) -> ShardLeadership | None:
        return self._leadership

    @property
    def pools(self) -> dict[str, asyncpg.Pool]:
        """Shard -> its PostgreSQL pool while the replica runs (empty before and after)."""
        return {name: s.pool for name, s in self._shards.items()}

    async def etcd_check(self) -> bool:
        """Readiness: one bounded etcd read (raises when etcd is away)."""
        if self._leadership is None:
            return False
        await self._leadership.check()
        return True

    async def run_until_stopped(
        self, stop: asyncio.Event, *, on_ready: Callable[[], None] | None = None
    ) -> None:
        """Lead this node's share of the shards until ``stop`` is set; then stop every
        shard's duties, revoke the lease and close everything.

        ``on_ready`` is called once every shard's pool is up and its duties are built.
        PostgreSQL being unreachable at start is retried as ``Replica`` does; etcd
        refusing this node's credentials raises ``ServiceUnavailable``.
        """
        await run_replica(
            node_id=self.node_id,
            stop=stop,
            open_=self._open,
            body=self._lead_shards,
            close=self._close,
            on_ready=on_ready,
        )

    async def _lead_shards(self, stop_waiter: asyncio.Task[Any]) -> None:
        """Start the leadership and act on its events until stop; then stop every
        shard's duties (``_shutdown``) before the lease goes."""
        assert self._leadership is not None
        leadership = self._leadership
        events = asyncio.create_task(self._drain(leadership), name="shards:events")
        try:
            await leadership.start()
            await asyncio.wait({events, stop_waiter}, return_when=asyncio.FIRST_COMPLETED)
            failure = events.exception() if events.done() and not events.cancelled() else None
            if failure is not None:
                raise failure
        finally:
            await self._shutdown()
            events.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await events

    # -- setup and teardown -----------------------------------------------------------

    async def _open(self) -> None:
        settings = self.settings
        try:
            for name, url in settings.shard_urls.items():
                shard_settings = dataclasses.replace(settings, database_url=url)
                pool = await db.pool_from_settings(
                    shard_settings,
                    max_size=self._pool_size,
                    server_settings=session_settings(settings),
                )
                fence = FenceStore(pool, acquire_timeout=settings.db_timeout)
                self._shards[name] = _Shard(
                    name, shard_settings, pool, fence, DutySet([]),
                )  # fmt: skip
            self._leadership = ShardLeadership(
                list(settings.etcd_endpoints),
                settings.etcd_prefix,
                self.node_id,
                list(self._shards),
                ttl=settings.lease_ttl,
                safety_margin=settings.lease_safety_margin,
                call_timeout=settings.etcd_timeout,
                poll_interval=self._poll_interval,
                handler=self._on_event,
                # lost: the handler stops the shard's duties before the key is deleted
                handler_timeout=self._duty_stop_timeout + CLOSE_TIMEOUT,
                clock=self.clock,
                username=settings.etcd_username,
                password=settings.etcd_password,
                tls=etcd_tls(settings),
            )
            leadership = self._leadership
            for name, shard in self._shards.items():
                ctx = DutyContext(
                    settings=shard.settings,
                    pool=shard.pool,
                    fence=shard.fence,
                    clock=self.clock,
                    node_id=self.node_id,
                    is_leader=_lease_check(leadership, name),
                    shard=name,
                )
                shard.duties = DutySet(
                    self._duties_factory(ctx), stop_timeout=self._duty_stop_timeout
                )
        except BaseException:
            await self._close()
            raise
        first = next(iter(self._shards.values()))
        self._log.info(
            "sharded_replica_started",
            shards=list(self._shards),
            duties=first.duties.names,
            election_keys=f"{settings.etcd_prefix.rstrip('/')}/shards/<shard>/leader",
            lease_ttl=settings.lease_ttl,
        )

    async def _shutdown(self) -> None:
        """Stop every shard's duties, then the leadership (which revokes the lease)."""
        self._stopping = True
        leads = []
        for shard in self._shards.values():
            shard.lost.set()
            if shard.task is not None:
                leads.append(shard.task)
        if leads:
            await asyncio.wait(leads, timeout=self._duty_stop_timeout + CLOSE_TIMEOUT)
        leadership = self._leadership
        if leadership is not None:
            await self._close_bounded("leadership", leadership.stop())

    async def _close(self) -> None:
        shards, self._shards = self._shards, {}
        for shard in shards.values():
            if shard.task is not None and not shard.task.done():
                shard.task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await shard.task
            if not await self._close_bounded(f"pool_{shard.name}", shard.pool.close()):
                shard.pool.terminate()
        self._leadership = None
        IS_LEADER.set(0)
        self._log.info("sharded_replica_stopped")

    async def _close_bounded(self, what: str, closing: Awaitable[None]) -> bool:
        try:
            await asyncio.wait_for(closing, CLOSE_TIMEOUT)
        except Exception as exc:
            self._log.warning(f"{what}_close_failed", error=describe(exc))
            return False
        return True

    @staticmethod
    async def _drain(leadership: ShardLeadership) -> None:
        """Consume the event stream (the handler acts on every event); it ends with
        ``stop()``, or raises ``fatal`` when etcd refused this node's credentials."""
        async for _event in leadership.events():
            continue

    # -- events -----------------------------------------------------------------------

    async def _on_event(self, event: ShardEvent) -> None:
        shard = self._shards.get(event.shard)
        if shard is None:
            return
        if event.kind == "gained":
            await self._gained(shard, event)
        else:
            await self._lost(shard, event)

    async def _gained(self, shard: _Shard, event: ShardEvent) -> None:
        previous = shard.task
        if previous is not None and not previous.done():
            shard.lost.set()  # a term this node no longer holds: let it end first
            await asyncio.wait({previous}, timeout=self._duty_stop_timeout + CLOSE_TIMEOUT)
        if self._stopping:
            return
        shard.lost = asyncio.Event()
        shard.lost_reason = "lost"
        shard.handing_over = False
        shard.task = asyncio.create_task(
            self._lead(shard, event.term.epoch), name=f"shard:{shard.name}:{event.term.epoch}"
        )

    async def _lost(self, shard: _Shard, event: ShardEvent) -> None:
        """Stop the shard's duties before returning (ShardLeadership deletes a handed-over
        key only after this)."""
        task = shard.task
        if task is None or task.done():
            return
        if shard.handing_over:
            return  # the lead task itself is handing over: its duties are stopped already
        shard.lost_reason = event.reason
        shard.lost.set()
        await asyncio.wait({task}, timeout=self._duty_stop_timeout + 1.0)

    # -- one term of one shard ----------------------------------------------------------

    async def _lead(self, shard: _Shard, epoch: int) -> None:
        assert self._leadership is not None
        leadership = self._leadership
        name = shard.name
        tlog = self._log.bind(shard=name, epoch=epoch)
        started = self.clock.monotonic()
        lost_waiter = asyncio.create_task(shard.lost.wait(), name=f"shard:{name}:lost")
        reason, detail = "stopped", "cancelled"
        running = False
        with structlog.contextvars.bound_contextvars(shard=name, epoch=epoch):
            tlog.info("shard_elected")
            self._record(name, "elected", epoch, None)
            SHARD_TRANSITIONS.labels(name, "elected").inc()
            try:
                outcome = await advance_fence(
                    shard.fence, epoch, self.node_id, shard.settings,
                    abort={lost_waiter}, log=tlog,
                )  # fmt: skip
                if outcome is None:
                    reason, detail = self._lost_reason(shard), "lost before the fence advanced"
                elif outcome[0]:
                    reason, detail = outcome
                else:
                    term = LeaderTerm(epoch, self.node_id)
                    started_duties = shard.duties.start(term, tlog)
                    running = True
                    shard.term = term
                    SHARD_IS_LEADER.labels(name).set(1)
                    SHARD_EPOCH.labels(name).set(epoch)
                    IS_LEADER.set(1)
                    tlog.info("shard_leading", duties=[d.name for d in started_duties])
                    self._record(name, "leading", epoch, None)
                    reason, detail = await self._watch(shard, lost_waiter)
            except asyncio.CancelledError:
                reason, detail = "stopped", "replica cancelled"
                raise
            except Exception as exc:  # a bug here must still end the term cleanly
                tlog.exception("shard_term_failed")
                reason, detail = "error", describe(exc)
            finally:
                lost_waiter.cancel()
                tlog.info("shard_stepping_down", reason=reason, detail=detail)
                self._record(name, "stepping_down", epoch, reason)
                await shard.duties.stop(tlog)
                if running:
                    tlog.info("shard_duties_stopped", reason=reason)
                shard.term = None
                SHARD_IS_LEADER.labels(name).set(0)
                SHARD_EPOCH.labels(name).set(0)
                if not self.leading():
                    IS_LEADER.set(0)
                SHARD_TRANSITIONS.labels(name, reason).inc()
            # Not in ``finally``: a cancelled lead task (shutdown) leaves the shard to
            # ``leadership.stop()``, which revokes the lease.
            if not shard.lost.is_set():
                await self._hand_over(shard, epoch, reason, started, leadership, tlog)
            else:
                tlog.info("shard_released", reason=reason)
                self._record(name, "released", epoch, reason)

    async def _watch(self, shard: _Shard, lost_waiter: asyncio.Task[Any]) -> tuple[str, str]:
        tasks, missing = shard.duties.tasks()
        if missing is not None:
            return "duty_exited", f"{missing}: not running"
        await asyncio.wait({lost_waiter, *tasks.values()}, return_when=asyncio.FIRST_COMPLETED)
        if lost_waiter.done():
            return self._lost_reason(shard), "stop requested" if self._stopping else "shard lost"
        return term_end_reason(hold=None, duties=tasks, stopped=False)

    def _lost_reason(self, shard: _Shard) -> str:
        return "stopped" if self._stopping else shard.lost_reason

    async def _hand_over(
        self,
        shard: _Shard,
        epoch: int,
        reason: str,
        started: float,
        leadership: ShardLeadership,
        tlog: Any,
    ) -> None:
        """The term ended on this node's side (a failure, or the lease seen lost by a
        duty): give the key up so another node can lead the shard."""
        ttl = self.settings.lease_ttl
        hold_off = 0.0
        if reason in FAILURES:
            lasted = self.clock.monotonic() - started
            shard.failures = shard.failures + 1 if lasted < ttl else 1
            hold_off = recampaign_delay(shard.failures, ttl)
        else:
            shard.failures = 0
        shard.handing_over = True
        await leadership.hand_over(shard.name, reason, hold_off=hold_off)
        tlog.info("shard_handed_over", reason=reason, hold_off=round(hold_off, 3),
                  failures=shard.failures)  # fmt: skip
        self._record(shard.name, "handed_over", epoch, reason)

    def _record(self, shard: str, event: str, epoch: int, reason: str | None) -> None:
        self.transitions.append(
            ShardTransition(shard, Transition(event, epoch, reason, self.clock.monotonic()))
        )


def _lease_check(leadership: ShardLeadership, shard: str) -> Callable[[], bool]:
    """The ``is_leader`` of one shard's duties: its key held, inside the trust window."""
    return lambda: leadership.is_leader(shard)
