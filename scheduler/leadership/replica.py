"""The replica: one node leading its share of the shards, each with its own fenced duties.

``scheduler.leadership.elector.Elector`` decides *which* shards this node may lead (one
node lease, one election key per shard, balanced assignment); this module decides
*what runs* for each of them (architecture.md §5 "Shards", §6). An unsharded cluster
is the one shard ``main`` on the election key ``<prefix>/leader``: the same path, with
the single-leader names of ``report`` for logs and metrics::

    campaigning ──gained(shard, epoch)──▶ elected ──fence advanced──▶ leading (duties run)
         ▲                                   │ fence ahead / error        │ lost: lease, key
         │                                   ▼                            ▼ gone, rebalance;
         └── resigned (handed over/released) ◀── stepping_down ◀──────────┘ a duty ended; stop

Rules, and why:

- **Per shard, everything of its own.** A pool on the shard's database (opened at
  start, sized for the duties), a ``FenceStore`` on it, and a ``DutySet`` built once by
  the duties factory from a ``DutyContext`` whose settings point at the shard's
  database (``database_url``: the duties' LISTEN connections), whose ``is_leader`` is
  ``elector.is_leader(shard)`` and whose ``shard`` names the shard in every message the
  dispatcher and reconciler publish.
- **Fence first.** Duties start only after ``leader_fence`` holds the term's epoch
  (``takeover.advance_fence``). If the fence already holds a newer one, a newer leader
  exists (or the etcd cluster was rebuilt and its revisions restarted: ``fence_ahead``
  says so): the shard is handed over instead of acted for. While the fence update
  waits for a paused predecessor's open transaction (PostgreSQL kills it after
  ``idle_in_transaction_session_timeout`` ≈ TTL, set on our pools), the elector keeps
  renewing the lease.
- **Watch everything, fail closed.** The lost event and every duty's task are awaited
  together; whichever ends first ends the term: a lost lease or key, a duty that saw
  ``Fenced``/``LeadershipLost``, or a duty task that died for any other reason (a duty
  must never be dead while the replica still claims leadership; passes that raise are
  retried inside the duty, with back-off, and never end its task).
- **Stop duties before anything else.** On ``lost`` the shard's duties are stopped and
  their cleanup awaited (bounded, ``DutySet`` semantics) before the handler returns;
  the elector deletes a handed-over key only after that, so a standby never starts
  while this node's duties of that shard still run, and once ``resigned`` is logged
  nothing of that term still runs here.
- **Give the key up whenever possible.** A term that ends on this node's side hands
  the shard over (``Elector.hand_over`` deletes the key's incarnation); a stop revokes
  the lease, which deletes every key at once: a standby takes over in milliseconds
  instead of waiting for the lease to expire (SIGTERM handover relies on it).
- **No flapping.** A shard handed over for a failure is not campaigned for again by
  this node for ``recampaign_delay(failures, ttl)`` (jittered, from TTL/8 up to 4 TTL),
  where ``failures`` counts that shard's consecutive failed terms shorter than one TTL.
  Another node may take it at once; this one waits.

Every transition is logged with ``node_id`` and ``epoch`` (and ``shard`` when sharded)
and kept in ``transitions``; ``report`` names the events and the metrics.
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
from scheduler.config.shards import DEFAULT_SHARD, election_key
from scheduler.duties.base import LeaderTerm
from scheduler.duties.context import DutyContext
from scheduler.errors import describe
from scheduler.leadership.duty_set import DUTY_STOP_TIMEOUT, DutiesFactory, DutySet
from scheduler.leadership.elector import Elector, ShardEvent
from scheduler.leadership.etcd_client import etcd_tls
from scheduler.leadership.lifecycle import run_replica
from scheduler.leadership.policy import (
    recampaign_delay,
    session_settings,
    term_end_reason,
)
from scheduler.leadership.report import Report, Transition
from scheduler.leadership.takeover import advance_fence
from scheduler.log import get_logger
from scheduler.store.fence import FenceStore

__all__ = ["POOL_SIZE", "SHARD_POOL_SIZE", "Replica", "Transition"]

log = get_logger(__name__)

#: Connections of the one pool of an unsharded cluster.
POOL_SIZE = 10
#: Connections per shard when there are several: the five default duties hold at most
#: one pooled connection each at a time (claim, plan, reconcile, maintain, heartbeat)
#: and the fence advance one more; LISTEN connections are their own.
SHARD_POOL_SIZE = 6
CLOSE_TIMEOUT = 5.0
#: Step-down reasons after which the shard is handed over and held off (not campaigned
#: for again by this node at once).
FAILURES = frozenset({"fenced", "fence_error", "duty_exited", "error"})


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
    lost_reason: str = "lost"  # why ``lost`` was set (an Elector reason)
    handing_over: bool = False
    failures: int = 0  # consecutive failed short terms: the hold-off grows with them


class Replica:
    """A scheduler replica that leads its share of ``settings.shard_urls``."""

    def __init__(
        self,
        settings: Settings,
        duties_factory: DutiesFactory,
        *,
        clock: Clock = SYSTEM_CLOCK,
        pool_size: int | None = None,
        duty_stop_timeout: float = DUTY_STOP_TIMEOUT,
        poll_interval: float = 0.5,
    ) -> None:
        self.settings = settings
        self.node_id = settings.node_id
        self.clock = clock
        self.report = Report(sharded=settings.shards is not None)
        self._duties_factory = duties_factory
        if pool_size is None:
            pool_size = SHARD_POOL_SIZE if self.report.sharded else POOL_SIZE
        self._pool_size = pool_size
        self._duty_stop_timeout = duty_stop_timeout
        self._poll_interval = min(poll_interval, settings.lease_ttl)
        self._shards: dict[str, _Shard] = {}
        self._elector: Elector | None = None
        self._stopping = False
        self.transitions: deque[Transition] = deque(maxlen=500)
        self._log = log.bind(node_id=self.node_id, epoch=None)

    # -- public ----------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """Leading at least one shard (duties up) inside the lease's trust window."""
        return bool(self.leading())

    def leading(self) -> dict[str, int]:
        """Shard -> epoch of every shard this node leads right now (duties up, trusted)."""
        elector = self._elector
        if elector is None:
            return {}
        return {
            name: s.term.epoch
            for name, s in self._shards.items()
            if s.term is not None and elector.is_leader(name)
        }

    @property
    def term(self) -> LeaderTerm | None:
        """The current term of an unsharded cluster's one shard (None while not leading
        it, and always None when sharded: ask ``leading()``)."""
        if self.report.sharded:
            return None
        shard = self._shards.get(DEFAULT_SHARD)
        return shard.term if shard is not None else None

    @property
    def elector(self) -> Elector | None:
        """The elector while the replica runs (None before and after)."""
        return self._elector

    @property
    def pools(self) -> dict[str, asyncpg.Pool]:
        """Shard -> its PostgreSQL pool while the replica runs (empty before and after)."""
        return {name: s.pool for name, s in self._shards.items()}

    async def etcd_check(self) -> bool:
        """Readiness: one bounded etcd read (raises when etcd is away)."""
        if self._elector is None:
            return False
        await self._elector.check()
        return True

    async def run_until_stopped(
        self, stop: asyncio.Event, *, on_ready: Callable[[], None] | None = None
    ) -> None:
        """Lead this node's share of the shards until ``stop`` is set; then stop every
        shard's duties, revoke the lease and close everything.

        ``on_ready`` is called once every shard's pool is up and its duties are built
        (systemd ``READY=1``). PostgreSQL being unreachable at start is retried with
        back-off until ``stop`` (``scheduler.startup``); a permanent refusal (bad
        password, no such database) raises ``ServiceUnavailable`` at once, and so does
        etcd refusing this node's credentials.
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
        """Start the elector and act on its events until stop; then stop every shard's
        duties (``_shutdown``) before the lease goes."""
        assert self._elector is not None
        elector = self._elector
        events = asyncio.create_task(self._drain(elector), name="replica:events")
        try:
            self._log.info("campaigning")
            await elector.start()
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
                self._shards[name] = _Shard(name, shard_settings, pool, fence, DutySet([]))
            keys = {
                name: election_key(settings.etcd_prefix, name, sharded=self.report.sharded)
                for name in self._shards
            }
            self._elector = Elector(
                list(settings.etcd_endpoints),
                settings.etcd_prefix,
                self.node_id,
                keys,
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
            elector = self._elector
            for name, shard in self._shards.items():
                ctx = DutyContext(
                    settings=shard.settings,
                    pool=shard.pool,
                    fence=shard.fence,
                    clock=self.clock,
                    node_id=self.node_id,
                    is_leader=_lease_check(elector, name),
                    shard=name,
                )
                shard.duties = DutySet(
                    self._duties_factory(ctx), stop_timeout=self._duty_stop_timeout
                )
        except BaseException:
            await self._close()
            raise
        first = next(iter(self._shards.values()))
        if self.report.sharded:
            self._log.info(
                "sharded_replica_started", shards=list(self._shards), duties=first.duties.names,
                election_keys=list(keys.values()), lease_ttl=settings.lease_ttl,
            )  # fmt: skip
        else:
            self._log.info(
                "replica_started", duties=first.duties.names,
                election_key=keys[DEFAULT_SHARD], lease_ttl=settings.lease_ttl,
            )  # fmt: skip

    async def _shutdown(self) -> None:
        """Stop every shard's duties, then the elector (which revokes the lease)."""
        self._stopping = True
        leads = []
        for shard in self._shards.values():
            shard.lost.set()
            if shard.task is not None:
                leads.append(shard.task)
        if leads:
            await asyncio.wait(leads, timeout=self._duty_stop_timeout + CLOSE_TIMEOUT)
        elector = self._elector
        if elector is not None:
            await self._close_bounded("election", elector.stop())

    async def _close(self) -> None:
        shards, self._shards = self._shards, {}
        for shard in shards.values():
            if shard.task is not None and not shard.task.done():
                shard.task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await shard.task
            what = f"pool_{shard.name}" if self.report.sharded else "pool"
            if not await self._close_bounded(what, shard.pool.close()):
                shard.pool.terminate()
        elector, self._elector = self._elector, None
        if elector is not None:  # never started (a failed open): close its connections
            await self._close_bounded("election", elector.stop())
        self._log.info("sharded_replica_stopped" if self.report.sharded else "replica_stopped")

    async def _close_bounded(self, what: str, closing: Awaitable[None]) -> bool:
        """Await ``closing`` for at most ``CLOSE_TIMEOUT``; False (logged) if it failed."""
        try:
            await asyncio.wait_for(closing, CLOSE_TIMEOUT)
        except Exception as exc:
            self._log.warning(f"{what}_close_failed", error=describe(exc))
            return False
        return True

    @staticmethod
    async def _drain(elector: Elector) -> None:
        """Consume the event stream (the handler acts on every event); it ends with
        ``stop()``, or raises ``fatal`` when etcd refused this node's credentials."""
        async for _event in elector.events():
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
        """Stop the shard's duties before returning (the elector deletes a handed-over
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
        assert self._elector is not None
        elector, report = self._elector, self.report
        name = shard.name
        bound: dict[str, Any] = (
            {"shard": name, "epoch": epoch} if report.sharded else {"epoch": epoch}
        )
        tlog = self._log.bind(**bound)
        started = self.clock.monotonic()
        lost_waiter = asyncio.create_task(shard.lost.wait(), name=f"shard:{name}:lost")
        reason, detail = "stopped", "cancelled"
        running = False
        with structlog.contextvars.bound_contextvars(**bound):
            tlog.info(report.log_event("elected"))
            self._record(name, "elected", epoch, None)
            report.elected(name)
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
                    report.leading(name, epoch)
                    tlog.info(report.log_event("leading"), duties=[d.name for d in started_duties])
                    self._record(name, "leading", epoch, None)
                    reason, detail = await self._watch(shard, lost_waiter)
            except asyncio.CancelledError:
                reason, detail = "stopped", "replica cancelled"
                raise
            except Exception as exc:  # a bug here must still end the term cleanly
                tlog.exception(report.log_event("term_failed"))
                reason, detail = "error", describe(exc)
            finally:
                lost_waiter.cancel()
                raw = reason
                reason, detail = report.reason(reason, detail)
                tlog.info(report.log_event("stepping_down"), reason=reason, detail=detail)
                self._record(name, "stepping_down", epoch, reason)
                await shard.duties.stop(tlog)
                if running:
                    tlog.info(report.log_event("duties_stopped"), reason=reason)
                shard.term = None
                report.stepped_down(name, reason, led=running, leading_any=bool(self.leading()))
            # Not in ``finally``: a cancelled lead task (shutdown) leaves the shard to
            # ``elector.stop()``, which revokes the lease.
            if not shard.lost.is_set():
                await self._hand_over(shard, epoch, raw, reason, started, elector, tlog)
            else:
                tlog.info(report.log_event("released"), reason=reason)
                self._record(name, "released", epoch, reason)
            if not self._stopping:
                tlog.info("campaigning")

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
        raw: str,
        reason: str,
        started: float,
        elector: Elector,
        tlog: Any,
    ) -> None:
        """The term ended on this node's side (a failure, or the lease seen lost by a
        duty): give the key up so another node can lead the shard."""
        ttl = self.settings.lease_ttl
        hold_off = 0.0
        if raw in FAILURES:
            lasted = self.clock.monotonic() - started
            shard.failures = shard.failures + 1 if lasted < ttl else 1
            hold_off = recampaign_delay(shard.failures, ttl)
        else:
            shard.failures = 0
        shard.handing_over = True
        await elector.hand_over(shard.name, reason, hold_off=hold_off)
        tlog.info(self.report.log_event("handed_over"), reason=reason,
                  hold_off=round(hold_off, 3), failures=shard.failures)  # fmt: skip
        self._record(shard.name, "handed_over", epoch, reason)

    def _record(self, shard: str, step: str, epoch: int, reason: str | None) -> None:
        event = self.report.event(step)
        self.transitions.append(Transition(event, epoch, reason, self.clock.monotonic(), shard))


def _lease_check(elector: Elector, shard: str) -> Callable[[], bool]:
    """The ``is_leader`` of one shard's duties: its key held, inside the trust window."""
    return lambda: elector.is_leader(shard)
