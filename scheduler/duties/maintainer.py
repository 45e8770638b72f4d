"""The maintainer: keeps ``duetime.jobs``' daily buckets and the retention (architecture.md §4).

One pass (every ``interval``, 10 min by default; the first at once on leadership):

1. **Create ahead.** A bucket for every day from today to today + ``days_ahead`` (UTC)
   that has none, via ``duetime.ensure_partition``: it moves the day's rows out of
   DEFAULT into the new table, then ATTACHes it (so they stay claimable: the claim reads
   whichever partition holds them).
2. **Retire.** A bucket whose whole range ended more than ``retention_days`` ago and
   that holds no ``pending``/``dispatched`` row (two probes on the partial indexes) is
   detached — after taking its locks and checking again, since ``jobs retry`` can revive a
   dead row — then dropped in a second transaction. A bucket with a live row is kept
   (counted as ``kept_live``) and looked at again next pass. Days in the past are never
   created again: a job inserted later with ``due_at`` in a dropped range lands in
   DEFAULT, which every claim scans (the claim cannot prune DEFAULT once a hole exists;
   it is small and has its own partial index). Its terminal rows are pruned like the
   rest (``default_pruned``), its live rows never.
3. **Prune** rows older than the retention in bounded batches (``batch_size`` per
   transaction, at most ``max_batches`` per table per pass; a pass that stops early
   comes back in ``resume_interval``): ``job_ledger`` by ``completed_at``,
   ``schedule_fires`` by ``fire_time`` (only once the schedule's ``next_fire_at`` is past
   it, so deduplication keeps what it still needs), terminal rows in DEFAULT, and the
   rate limits' start log past each rate's window (migration 0018).

Every write runs in a fenced transaction (``Fenced`` ends the duty and the term) after a
fail-closed lease check. One ``maintenance_pass`` event per pass with the same keys
whatever happened (``created``, ``dropped``, ``kept_live``, ``deferred``,
``ledger_pruned``, ``fires_pruned``, ``default_pruned``, ``starts_pruned``,
``duration_ms``, ``error``).

**Claims are never stalled for long.** Claims (and producers, and workers holding a
job ``FOR KEY SHARE``) lock the parent and every partition; ATTACH needs ACCESS
EXCLUSIVE on DEFAULT, DETACH on the parent. A DDL request waiting for such a lock makes
every *later* claim queue behind it, so each DDL transaction sets ``lock_timeout``
(500 ms) and ``statement_timeout``: when it cannot get its locks in time it gives up,
the pass skips its remaining DDL (counted in ``deferred``) and the next pass comes in
``retry_interval`` (30 s). Once granted, the locks are held for a catalog change and
an index probe (detach), or for ATTACH's scan of DEFAULT (create: proportional to
DEFAULT's size, which is why it is kept small). DETACH CONCURRENTLY is no way out: it
cannot run in a transaction block and PostgreSQL 15 refuses it while a DEFAULT
partition exists. Measured in bench/maintainer_claim_latency.py.

Limits (said, not hidden):

- Retention counts from a bucket's *range* (``due_at``), not from ``finished_at``: a
  job due 8 days ago that finished a minute ago goes with its bucket (the check under
  the lock reads two small indexes; reading ``finished_at`` would scan the bucket).
- DDL needs a moment, longer than ``lock_timeout``, with no transaction open on
  ``jobs``. Handlers that always run longer (the worker holds its row for the
  handler's duration) make every attempt time out; the maintainer keeps retrying every
  ``retry_interval`` and logs ``deferred``. Creating ahead has ``days_ahead`` days of
  slack, retiring has none to lose but disk.
- ATTACH scans DEFAULT under ACCESS EXCLUSIVE: millions of rows due beyond
  ``days_ahead`` sitting in DEFAULT make each creation stall claims for the scan.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import date
from functools import partial
from typing import Any, TypeVar

import asyncpg

from scheduler.config import MIN_RETENTION_DAYS
from scheduler.duties.base import DutyLoop
from scheduler.duties.context import DutyContext, FencedWrites
from scheduler.duties.knobs import check_knobs, config_from_settings, knob
from scheduler.store.conn import Conn
from scheduler.store.maintenance import MaintenanceStore

T = TypeVar("T")

#: A DDL transaction that fails with one of these is deferred to a later pass.
LOCK_ERRORS = (
    asyncpg.exceptions.LockNotAvailableError,  # lock_timeout
    asyncpg.exceptions.QueryCanceledError,  # statement_timeout
    asyncpg.exceptions.DeadlockDetectedError,
)
DAY = 86400.0
#: The furthest day ``duetime.create_bucket`` creates (migration 0010).
MAX_DAYS_AHEAD = 100


@dataclass(frozen=True, slots=True)
class MaintainerConfig:
    """How the maintainer paces itself (``config_from_settings`` fills it)."""

    days_ahead: int = knob(14, setting="partition_days_ahead", ge=0)
    """Buckets exist from today to today + this many days (UTC)."""
    retention_days: float = knob(7.0, setting="retention_days", ge=MIN_RETENTION_DAYS)
    """Buckets, ledger and fire rows older than this many days are removed (at least one
    day: ``scheduler.config.MIN_RETENTION_DAYS``)."""
    interval: float = knob(600.0, gt=0)
    """Seconds between passes."""
    retry_interval: float = knob(30.0, gt=0)
    """Seconds to the next pass when DDL gave up on a lock."""
    resume_interval: float = knob(1.0, gt=0)
    """Seconds to the next pass when pruning stopped at ``max_batches``."""
    lock_timeout: float = knob(0.5, gt=0)
    """Longest wait for a lock in a maintenance transaction (claims queue behind it)."""
    ddl_timeout: float = knob(2.0, gt=0)
    """statement_timeout of a detach or drop: bounds waits for several locks in a row."""
    create_timeout: float = knob(60.0, gt=0)
    """statement_timeout of a creation (it may move many rows out of DEFAULT first)."""
    batch_size: int = knob(5000, ge=1)
    """Rows deleted per pruning transaction."""
    max_batches: int = knob(50, ge=1)
    """Pruning transactions per table per pass."""
    prune_timeout: float = knob(30.0, gt=0)
    """statement_timeout of one pruning batch."""

    def __post_init__(self) -> None:
        check_knobs(self)
        if self.days_ahead > MAX_DAYS_AHEAD:
            raise ValueError(
                f"days_ahead must be <= {MAX_DAYS_AHEAD} (duetime.create_bucket refuses "
                "days further ahead)"
            )
        if self.ddl_timeout < self.lock_timeout:
            raise ValueError("ddl_timeout must be >= lock_timeout")

    @property
    def retention(self) -> float:
        """The retention in seconds."""
        return self.retention_days * DAY


@dataclass(slots=True)
class MaintenanceReport:
    """What one pass did (the keys of its ``maintenance_pass`` event)."""

    created: list[date] = field(default_factory=list)
    dropped: list[date] = field(default_factory=list)
    kept_live: int = 0
    deferred: int = 0
    deferred_reason: str | None = None
    leftovers_dropped: int = 0
    ledger_pruned: int = 0
    fires_pruned: int = 0
    default_pruned: int = 0
    starts_pruned: int = 0
    more: bool = False  # pruning stopped at max_batches

    def fields(self) -> dict[str, object]:
        return {
            "created": len(self.created),
            "created_days": [d.isoformat() for d in self.created],
            "dropped": len(self.dropped),
            "dropped_days": [d.isoformat() for d in self.dropped],
            "kept_live": self.kept_live,
            "deferred": self.deferred,
            "deferred_reason": self.deferred_reason,
            "leftovers_dropped": self.leftovers_dropped,
            "ledger_pruned": self.ledger_pruned,
            "fires_pruned": self.fires_pruned,
            "default_pruned": self.default_pruned,
            "starts_pruned": self.starts_pruned,
            "more": self.more,
        }


class Maintainer:
    """Built from its ``DutyContext``."""

    name = "maintainer"

    def __init__(self, ctx: DutyContext, *, config: MaintainerConfig | None = None) -> None:
        self.config = config or config_from_settings(MaintainerConfig, ctx.settings)
        self.shard = ctx.shard  # its partitions are kept here
        self.clock = ctx.clock
        self.loop = DutyLoop(self, shard=ctx.shard)
        self.writes = FencedWrites(ctx, write="fenced maintenance write")
        self.store = MaintenanceStore(ctx.pool, acquire_timeout=ctx.settings.db_timeout)
        self.last_report: MaintenanceReport | None = None

    # -- one pass --------------------------------------------------------------------

    async def run_once(self) -> float:
        started = self.clock.monotonic()
        report = MaintenanceReport()
        error: str | None = None
        try:
            await self.maintain(report)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self.last_report = report
            self._log_pass(report, self.clock.monotonic() - started, error)
        if report.deferred:
            return self.config.retry_interval
        if report.more:
            return self.config.resume_interval
        return self.config.interval

    async def maintain(self, report: MaintenanceReport) -> MaintenanceReport:
        """Create ahead, retire expired buckets, prune; fills and returns ``report``."""
        await self._create_ahead(report)
        await self._retire(report)
        await self._prune(report)
        return report

    def _log_pass(self, report: MaintenanceReport, seconds: float, error: str | None) -> None:
        log = self.loop.log
        level = log.error if error else log.warning if report.deferred else log.info
        level(
            "maintenance_pass",
            **report.fields(),
            duration_ms=round(seconds * 1000, 1),
            error=error,
        )

    # -- steps -----------------------------------------------------------------------

    async def _create_ahead(self, report: MaintenanceReport) -> None:
        cfg = self.config
        for day in await self.store.missing_days(cfg.days_ahead):
            created = await self._ddl(report, cfg.create_timeout, self.store.create_bucket, day=day)
            if created is None:
                return
            if created:
                report.created.append(day)

    async def _retire(self, report: MaintenanceReport) -> None:
        if report.deferred:
            return  # the locks were not to be had a moment ago: do not queue again
        cfg = self.config
        for name in await self.store.detached_leftovers():
            dropped = await self._ddl(report, cfg.ddl_timeout, self.store.drop_detached, name=name)
            if dropped is None:
                return
            report.leftovers_dropped += int(dropped)
        for bucket in await self.store.expired_buckets(cfg.retention):
            day = bucket.day
            if bucket.live:
                report.kept_live += 1
                continue
            outcome = await self._ddl(report, cfg.ddl_timeout, self.store.detach_bucket, day=day)
            if outcome is None:
                return
            if outcome == "live":
                report.kept_live += 1
                continue
            if outcome != "detached":
                continue
            name = f"jobs_p{day:%Y%m%d}_detached"
            dropped = await self._ddl(report, cfg.ddl_timeout, self.store.drop_detached, name=name)
            if dropped is None:
                return  # detached: its rows are out of jobs; the next pass drops it
            report.dropped.append(day)

    async def _prune(self, report: MaintenanceReport) -> None:
        retention, limit = self.config.retention, self.config.batch_size
        report.ledger_pruned = await self._batches(
            report, partial(self.store.prune_ledger, retention=retention, limit=limit)
        )
        report.fires_pruned = await self._batches(
            report, partial(self.store.prune_fires, retention=retention, limit=limit)
        )
        report.default_pruned = await self._batches(
            report, partial(self.store.prune_default, retention=retention, limit=limit)
        )
        report.starts_pruned = await self._batches(
            report, partial(self.store.prune_limit_starts, limit=limit)
        )

    # -- transactions ----------------------------------------------------------------

    async def _fenced(self, statement_timeout: float, action: Callable[[Conn], Awaitable[T]]) -> T:
        """``action`` in a fenced transaction with this duty's lock/statement limits."""
        async with self.writes.transaction(self.loop.term.epoch) as conn:
            await self.store.set_limits(
                conn, lock_timeout=self.config.lock_timeout, statement_timeout=statement_timeout
            )
            return await action(conn)

    async def _ddl(
        self,
        report: MaintenanceReport,
        statement_timeout: float,
        step: Callable[..., Awaitable[T]],
        **arguments: Any,
    ) -> T | None:
        """``step(conn, **arguments)`` in a DDL transaction; None (and counted as
        deferred) when it gave up on a lock."""
        try:
            return await self._fenced(statement_timeout, partial(step, **arguments))
        except LOCK_ERRORS as exc:
            report.deferred += 1
            report.deferred_reason = f"{type(exc).__name__}: {exc}"
            return None

    async def _batches(
        self, report: MaintenanceReport, action: Callable[[Conn], Awaitable[int]]
    ) -> int:
        total = 0
        for _ in range(self.config.max_batches):
            try:
                count = await self._fenced(self.config.prune_timeout, action)
            except LOCK_ERRORS as exc:
                report.more = True
                report.deferred_reason = report.deferred_reason or f"{type(exc).__name__}: {exc}"
                return total
            total += count
            if count < self.config.batch_size:
                return total
        report.more = True
        return total
