"""The planner: turns recurring schedules into jobs, a short horizon ahead (DESIGN §5b).

One pass = batches of one fenced transaction each, until nothing is due:

1. lock the fence row and check the epoch (``fenced_transaction``), then claim up to
   ``batch_size`` schedules whose ``plan_at`` has come, ``FOR UPDATE SKIP LOCKED``;
2. decide each one with the pure :func:`scheduler.schedules.plan_schedule` (fire times
   up to now + horizon, misfire / overlap policies, deterministic jitter, new
   ``next_fire_at``), in a worker thread when the batch is large so the event loop —
   and the lease renewal that shares it — keeps running. Schedules with the same
   timing share one enumeration; a batch stops deciding after ``decide_budget``
   seconds or ``max_fires_per_batch`` fire times (the rest stays due for the next
   batch), so its transaction never idles long enough for PostgreSQL to end it;
3. write the whole batch in ONE statement (``apply_plan``: arrays, ``unnest``): fire
   times into ``schedule_fires`` ``ON CONFLICT DO NOTHING``, jobs for the new ones only,
   the schedules' new state; commit.

So a batch costs five round trips (BEGIN, fence, claim, apply, COMMIT) whatever its
size (bench/planner_rate.py counts them), six when it created jobs due within a second
(catch-ups, overlap schedules): a NOTIFY then wakes the dispatcher at once. A fire time
becomes a job at most once: the dedupe row and the advanced ``next_fire_at`` commit
together, under the fence, so a newer leader either sees both or neither, and a
zombie's batch cannot commit at all.

``allow`` schedules are planned ``horizon`` ahead and revisited ``lead`` before their
next fire time, so their jobs exist before they are due (the dispatcher's probe of the
earliest pending run time learns them in advance and wakes for them) and a failover
shorter than ``lead`` misses nothing; ``skip`` / ``buffer_one`` schedules are planned at
their fire time, when whether the previous run finished can be known.

Robustness: a schedule whose cron, zone or interval is invalid (written by plain SQL) is
paused with ``last_error`` and logged; when the database refuses a batch's rows, the
next batch applies each schedule under its own savepoint and pauses the refused ones; a
bug in planning one schedule pauses that schedule; a row the client cannot even decode
(JSON nested deeper than Python's parser goes, a date migration 0006 did not yet bound)
makes the claim read the batch one row at a time and pause the unreadable ones. None of
them stops the others.

Wake-ups: the loop sleeps until the earliest ``plan_at`` (a prepared probe on an index),
capped by ``poll_interval``; a dedicated connection LISTENs on ``duetime_schedules``
(insert/update trigger) and wakes it when schedules change. While that connection is
down the cap is ``probe_interval`` and it is re-established with back-off.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import asyncpg

from scheduler.backoff import bounded_jitter
from scheduler.clock import SYSTEM_CLOCK, Clock
from scheduler.config import Settings
from scheduler.duty import LeaderDuty
from scheduler.fence import fenced_transaction
from scheduler.metrics import SCHEDULE_FIRES, SCHEDULE_MISFIRES
from scheduler.schedules import PlanConfig, PlanDecision, invalid_decision, plan_schedule
from scheduler.store.conn import Conn
from scheduler.store.listener import KeptListener
from scheduler.store.rows import UNREADABLE, ClaimedSchedule
from scheduler.store.schedules import NOTIFY_CHANNEL as SCHEDULES_CHANNEL
from scheduler.store.schedules import ScheduleStore

#: Errors after which a batch is simply tried again.
RETRYABLE = (
    asyncpg.exceptions.SerializationError,
    asyncpg.exceptions.DeadlockDetectedError,
    asyncpg.exceptions.LockNotAvailableError,
)
#: The database refused a row (a CHECK, a bad value): find it, pause its schedule.
ROW_ERRORS = (asyncpg.exceptions.DataError, asyncpg.exceptions.IntegrityConstraintViolationError)
#: Batches planned inline; larger ones go to a worker thread.
INLINE_BATCH = 32
#: At most this many schedules are named in one log line (the totals are always there).
MAX_LOGGED = 50


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """How the planner paces itself; ``from_settings`` fills it from ``Settings``."""

    horizon: float = 10.0
    """Seconds ahead that fire times of ``allow`` schedules become jobs."""
    lead: float | None = None
    """Revisit a schedule when its next fire time is this close (default horizon / 2)."""
    misfire_grace: float = 1.0
    """A fire time at most this late still fires normally (not a misfire)."""
    batch_size: int = 1000
    """Schedules claimed (and written in one statement) per transaction."""
    max_batches_per_pass: int = 100
    """Batches in one ``run_once`` before the loop yields (and comes straight back)."""
    poll_interval: float = 1.0
    """Longest sleep while the LISTEN connection is healthy (backstop)."""
    probe_interval: float = 0.25
    """Longest sleep while it is not."""
    buffer_poll: float = 1.0
    """``buffer_one``: how often a waiting fire time checks the running job."""
    listen_check_interval: float = 10.0
    """How often the LISTEN connection is pinged (a half-open socket is silent)."""
    decide_budget: float = 0.5
    """Seconds of planning per batch, while its transaction waits idle: far below the
    replica's ``idle_in_transaction_session_timeout`` (≈ lease TTL), whatever the batch
    holds (a long catch-up can cost tens of ms per schedule). The rest waits for the
    next batch."""
    max_fires_per_batch: int = 20_000
    """Fire times written by one statement, at most (plus one schedule's worth)."""

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.max_batches_per_pass < 1:
            raise ValueError("batch_size and max_batches_per_pass must be >= 1")
        if self.max_fires_per_batch < 1:
            raise ValueError("max_fires_per_batch must be >= 1")
        for name in (
            "poll_interval",
            "probe_interval",
            "buffer_poll",
            "listen_check_interval",
            "decide_budget",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 (got {getattr(self, name)})")
        self.plan_config()  # validates horizon, lead, grace

    def plan_config(self) -> PlanConfig:
        return PlanConfig(
            horizon=timedelta(seconds=self.horizon),
            lead=None if self.lead is None else timedelta(seconds=self.lead),
            misfire_grace=timedelta(seconds=self.misfire_grace),
            buffer_poll=timedelta(seconds=self.buffer_poll),
        )

    @classmethod
    def from_settings(cls, settings: Settings, **overrides: object) -> PlannerConfig:
        values: dict[str, object] = {
            "horizon": settings.planner_horizon,
            "poll_interval": settings.poll_interval,
        }
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]


@dataclass(slots=True)
class PlanReport:
    """What one batch (or, summed, one pass) did."""

    claimed: int = 0
    fired: int = 0
    duplicates: int = 0  # fire times already materialized (dedupe hits)
    missed: int = 0
    skipped: int = 0
    invalid: int = 0
    revisit: bool = False  # some schedule must be looked at again at once
    batches: int = 0
    missed_by_policy: Counter[str] = field(default_factory=Counter)
    claim_seconds: float = 0.0  # BEGIN + fence + claim
    decide_seconds: float = 0.0  # pure planning
    write_seconds: float = 0.0  # apply_plan + COMMIT

    def add(self, other: PlanReport) -> None:
        self.claimed += other.claimed
        self.fired += other.fired
        self.duplicates += other.duplicates
        self.missed += other.missed
        self.skipped += other.skipped
        self.invalid += other.invalid
        self.revisit = other.revisit
        self.batches += other.batches
        self.missed_by_policy.update(other.missed_by_policy)
        self.claim_seconds += other.claim_seconds
        self.decide_seconds += other.decide_seconds
        self.write_seconds += other.write_seconds


class Planner(LeaderDuty):
    name = "planner"
    fenced_write = "fenced planner batch"

    def __init__(
        self,
        settings: Settings,
        pool: asyncpg.Pool,
        *,
        config: PlannerConfig | None = None,
        clock: Clock = SYSTEM_CLOCK,
        is_leader: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__(settings, pool, clock=clock, is_leader=is_leader)
        self.store = ScheduleStore(pool, acquire_timeout=settings.db_timeout)
        self.config = config or PlannerConfig.from_settings(settings)
        self._plan_config = self.config.plan_config()
        self._wakeups = KeptListener(
            settings.database_url,
            SCHEDULES_CHANNEL,
            self.wake,
            timeout=settings.db_timeout,
            application_name=f"duetime:{settings.node_id}:planner-listen",
            check_interval=self.config.listen_check_interval,
            log=lambda: self.log,
        )
        self._isolate = False  # the last batch was refused: apply the next one row by row
        self.invalid_total = 0  # schedules paused for an error, since start

    # -- lifecycle -------------------------------------------------------------------

    async def setup(self) -> None:
        await self._ensure_listener()

    async def teardown(self) -> None:
        await self._wakeups.close()

    @property
    def listening(self) -> bool:
        return self._wakeups.alive

    # -- one pass --------------------------------------------------------------------

    async def run_once(self) -> float:
        await self._ensure_listener()
        nxt = await self.store.next_plan_at()
        if nxt is not None and nxt > self.clock.now().timestamp():
            return self._delay_until(nxt)
        try:
            report = await self.plan_pass()
        except RETRYABLE as exc:
            self.log.warning("plan_retry", error=f"{type(exc).__name__}: {exc}")
            return bounded_jitter(1, base=0.05)
        if report.revisit:  # max_batches_per_pass reached with work left
            return 0.0
        return self._delay_until(await self.store.next_plan_at())

    def _delay_until(self, epoch: float | None) -> float:
        cap = self.config.poll_interval if self.listening else self.config.probe_interval
        if epoch is None:
            return cap
        delay = epoch - self.clock.now().timestamp()
        if delay <= 0:
            # due, yet nothing could be claimed: the rows are locked by a user's
            # pause/remove, which takes milliseconds — look again soon
            return min(self.config.probe_interval, cap)
        return min(delay, cap)

    async def plan_pass(self) -> PlanReport:
        """Batches until nothing is due (or ``max_batches_per_pass``); tests call this.

        One pooled connection serves the whole pass (a release costs a round trip)."""
        total = PlanReport()
        async with self.pool.acquire(timeout=self.settings.db_timeout) as conn:
            for _ in range(self.config.max_batches_per_pass):
                report = await self.plan_batch(conn)
                total.add(report)
                if report.claimed < self.config.batch_size and not report.revisit:
                    total.revisit = False
                    return total
        total.revisit = True  # stopped with work left: the loop comes straight back
        return total

    async def plan_batch(self, conn: Conn, now: datetime | None = None) -> PlanReport:
        """One fenced transaction: claim, decide, apply, commit.

        The database refusing a row (``ROW_ERRORS``) rolls the batch back; the next one
        (the same schedules: they are still the oldest due) then applies each schedule
        under its own savepoint and pauses the ones refused. The normal path has no
        savepoints: five round trips per batch.
        """
        epoch = self.term.epoch
        self._check_leader()
        now = now or self.clock.now()
        isolate = self._isolate
        started = time.perf_counter()
        try:
            async with fenced_transaction(conn, epoch):
                claimed = await self._claim(conn, now)
                if not claimed:
                    return PlanReport()
                claimed_at = time.perf_counter()
                if len(claimed) > INLINE_BATCH:
                    decisions = await asyncio.to_thread(self._decide, claimed, now)
                else:
                    decisions = self._decide(claimed, now)
                decided_at = time.perf_counter()
                # schedules left undecided (budget spent) stay as they are and due
                deferred = len(claimed) - len(decisions)
                claimed = claimed[: len(decisions)]
                if isolate:
                    fired = await self._apply_isolated(conn, claimed, decisions, now)
                else:
                    fired = await self.store.apply_plan(conn, decisions, now=now)
        except ROW_ERRORS as exc:
            if isolate:  # not a row's fault after all: let the duty back off and retry
                raise
            self._isolate = True
            self.log.warning(
                "plan_batch_refused",
                error=f"{type(exc).__name__}: {exc}",
                next_step="apply the batch one schedule at a time",
            )
            return PlanReport(revisit=True)
        self._isolate = False
        committed_at = time.perf_counter()
        report = self._account(claimed, decisions, fired, now)
        report.revisit = report.revisit or deferred > 0
        report.claim_seconds = claimed_at - started
        report.decide_seconds = decided_at - claimed_at
        report.write_seconds = committed_at - decided_at
        self.log.debug(
            "plan_batch",
            claimed=report.claimed,
            fired=report.fired,
            missed=report.missed,
            skipped=report.skipped,
            claim_ms=round(report.claim_seconds * 1000, 2),
            decide_ms=round(report.decide_seconds * 1000, 2),
            write_ms=round(report.write_seconds * 1000, 2),
        )
        return report

    async def _claim(self, conn: Conn, now: datetime) -> list[ClaimedSchedule]:
        """The batch's claim; row by row, pausing what cannot be read, if it must be."""
        try:
            return await self.store.claim_due(conn, now, self.config.batch_size)
        except UNREADABLE as exc:
            self.log.warning(
                "claim_unreadable",
                error=f"{type(exc).__name__}: {exc}",
                next_step="read the batch row by row and pause the unreadable schedules",
            )
        claimed, unreadable = await self.store.claim_due_isolated(
            conn, now, self.config.batch_size
        )
        for schedule_id, error in unreadable:
            reason = f"the planner cannot read this schedule ({error}); paused"
            try:
                async with conn.transaction():  # a savepoint
                    paused = await self.store.pause_unreadable(conn, schedule_id, reason)
            except ROW_ERRORS as exc:
                paused = False
                reason = f"{reason}; the pause was refused: {type(exc).__name__}: {exc}"
            self.invalid_total += paused
            self.log.error(
                "schedule_unreadable",
                schedule_id=schedule_id,
                error=reason,
                outcome="paused" if paused else "left as it is",
            )
        return claimed

    def _decide(self, claimed: Sequence[ClaimedSchedule], now: datetime) -> list[PlanDecision]:
        """Decisions for a prefix of ``claimed``: the batch stops early once it has spent
        ``decide_budget`` seconds or produced ``max_fires_per_batch`` fire times."""
        decisions: list[PlanDecision] = []
        memo: dict[tuple[Any, ...], Any] = {}  # schedules with the same timing share work
        deadline = time.perf_counter() + self.config.decide_budget
        fires = 0
        for item in claimed:
            if decisions and (
                fires >= self.config.max_fires_per_batch or time.perf_counter() > deadline
            ):
                break
            try:
                decision = plan_schedule(
                    item.schedule,
                    now,
                    self._plan_config,
                    previous_active=item.previous_active,
                    memo=memo,
                )
            except Exception as exc:  # a bug must not stall every other schedule
                self.log.exception("plan_schedule_failed", schedule_id=item.schedule.id)
                decision = invalid_decision(
                    item.schedule, f"planning failed: {type(exc).__name__}: {exc}"
                )
            decisions.append(decision)
            fires += len(decision.fires)
        return decisions

    async def _apply_isolated(
        self,
        conn: Conn,
        claimed: Sequence[ClaimedSchedule],
        decisions: list[PlanDecision],
        now: datetime,
    ) -> dict[int, int]:
        """Apply one schedule per savepoint; pause the ones the database refuses."""
        fired: dict[int, int] = {}
        for index, (item, decision) in enumerate(zip(claimed, decisions, strict=True)):
            try:
                async with conn.transaction():  # a savepoint
                    fired.update(await self.store.apply_plan(conn, [decision], now=now))
            except ROW_ERRORS as exc:
                bad = invalid_decision(
                    item.schedule, f"the database refused its jobs: {type(exc).__name__}: {exc}"
                )
                decisions[index] = bad
                fired.update(await self.store.apply_plan(conn, [bad]))
        return fired

    def _account(
        self,
        claimed: Sequence[ClaimedSchedule],
        decisions: Sequence[PlanDecision],
        fired: dict[int, int],
        now: datetime,
    ) -> PlanReport:
        report = PlanReport(claimed=len(claimed), batches=1)
        missed_log: list[dict[str, object]] = []
        overlap_log: list[dict[str, object]] = []
        for item, d in zip(claimed, decisions, strict=True):
            s = item.schedule
            created = fired.get(d.schedule_id, 0)
            report.fired += created
            report.duplicates += len(d.fires) - created
            report.skipped += d.skipped
            if d.plan_at is not None and d.plan_at <= now:
                report.revisit = True
            if d.invalid:
                report.invalid += 1
                self.invalid_total += 1
                self.log.error(
                    "schedule_invalid",
                    schedule_id=s.id,
                    schedule=s.name,
                    error=d.error,
                    outcome="paused",
                )
                continue
            if d.missed:
                report.missed += d.missed
                report.missed_by_policy[s.misfire_policy] += d.missed
                if len(missed_log) < MAX_LOGGED:
                    missed_log.append(
                        {
                            "id": s.id,
                            "name": s.name,
                            "missed": d.missed,
                            "skipped": d.skipped_misfire,
                            "first": d.first_missed.isoformat() if d.first_missed else None,
                            "last": d.last_missed.isoformat() if d.last_missed else None,
                        }
                    )
            if d.skipped_overlap and len(overlap_log) < MAX_LOGGED:
                overlap_log.append({"id": s.id, "name": s.name, "skipped": d.skipped_overlap})
        SCHEDULE_FIRES.inc(report.fired)
        for policy, count in report.missed_by_policy.items():
            SCHEDULE_MISFIRES.labels(policy).inc(count)
        if report.missed:
            self.log.warning(
                "schedules_misfired",
                missed=report.missed,
                by_policy=dict(report.missed_by_policy),
                schedules=missed_log,
            )
        if overlap_log:
            self.log.info(
                "schedules_overlap_skipped",
                skipped=sum(d.skipped_overlap for d in decisions),
                schedules=overlap_log,
            )
        if report.duplicates:
            self.log.warning("schedule_fires_deduplicated", duplicates=report.duplicates)
        return report

    # -- wake-ups --------------------------------------------------------------------

    async def _ensure_listener(self) -> None:
        """Keep the LISTEN connection; while it is down the loop runs on probes."""
        await self._wakeups.ensure()

