"""The planner: turns recurring schedules into jobs, a short horizon ahead (architecture.md §3).

One pass = batches of one fenced transaction each, until nothing is due:

1. lock the fence row and check the epoch (``fenced_transaction``), then claim up to
   ``batch_size`` schedules whose ``plan_at`` has come, ``FOR UPDATE SKIP LOCKED``;
2. decide each one with the pure :func:`scheduler.planning.plan_schedule` (fire times
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
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import asyncpg

from scheduler.backoff import bounded_jitter
from scheduler.duties.base import DutyLoop
from scheduler.duties.context import DutyContext, FencedWrites, duty_listener
from scheduler.duties.knobs import check_knobs, config_from_settings, knob
from scheduler.duties.plan_report import PlanReport, account_batch
from scheduler.metrics import SCHEDULE_FIRES
from scheduler.planning import PlanConfig, PlanDecision, invalid_decision, plan_schedule
from scheduler.store.conn import Conn
from scheduler.store.fenced import fenced_transaction
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


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """How the planner paces itself (``config_from_settings`` fills it)."""

    horizon: float = knob(10.0, setting="planner_horizon")
    """Seconds ahead that fire times of ``allow`` schedules become jobs."""
    lead: float | None = None
    """Revisit a schedule when its next fire time is this close (default horizon / 2)."""
    misfire_grace: float = 1.0
    """A fire time at most this late still fires normally (not a misfire)."""
    batch_size: int = knob(1000, ge=1)
    """Schedules claimed (and written in one statement) per transaction."""
    max_batches_per_pass: int = knob(100, ge=1)
    """Batches in one ``run_once`` before the loop yields (and comes straight back)."""
    poll_interval: float = knob(1.0, setting="poll_interval", gt=0)
    """Longest sleep while the LISTEN connection is healthy (backstop)."""
    probe_interval: float = knob(0.25, gt=0)
    """Longest sleep while it is not."""
    buffer_poll: float = knob(1.0, gt=0)
    """``buffer_one``: how often a waiting fire time checks the running job."""
    listen_check_interval: float = knob(10.0, gt=0)
    """How often the LISTEN connection is pinged (a half-open socket is silent)."""
    decide_budget: float = knob(0.5, gt=0)
    """Seconds of planning per batch, while its transaction waits idle: far below the
    replica's ``idle_in_transaction_session_timeout`` (≈ lease TTL), whatever the batch
    holds (a long catch-up can cost tens of ms per schedule). The rest waits for the
    next batch."""
    max_fires_per_batch: int = knob(20_000, ge=1)
    """Fire times written by one statement, at most (plus one schedule's worth)."""

    def __post_init__(self) -> None:
        check_knobs(self)
        self.plan_config()  # validates horizon, lead, grace

    def plan_config(self) -> PlanConfig:
        return PlanConfig(
            horizon=timedelta(seconds=self.horizon),
            lead=None if self.lead is None else timedelta(seconds=self.lead),
            misfire_grace=timedelta(seconds=self.misfire_grace),
            buffer_poll=timedelta(seconds=self.buffer_poll),
        )


class Planner:
    """Built from its ``DutyContext``, whose clock also decides what is due."""

    name = "planner"

    def __init__(self, ctx: DutyContext, *, config: PlannerConfig | None = None) -> None:
        self.config = config = config or config_from_settings(PlannerConfig, ctx.settings)
        self.settings = ctx.settings
        self.pool = ctx.pool
        self.shard = shard = ctx.shard  # its schedules are planned here
        self.clock = ctx.clock
        # a 0 sample from the start, so the first fire shows as an increase
        SCHEDULE_FIRES.labels(shard)
        self.loop = DutyLoop(self, shard=shard)
        self.writes = FencedWrites(ctx, write="fenced planner batch")
        self.store = ScheduleStore(ctx.pool, acquire_timeout=ctx.settings.db_timeout)
        self._plan_config = config.plan_config()
        self._wakeups = duty_listener(
            ctx,
            SCHEDULES_CHANNEL,
            self.loop.wake,
            role="planner-listen",
            check_interval=config.listen_check_interval,
            log=lambda: self.loop.log,
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
            self.loop.log.warning("plan_retry", error=f"{type(exc).__name__}: {exc}")
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
        epoch = self.loop.term.epoch
        self.writes.check_lease()
        now = now or self.clock.now()
        isolate = self._isolate
        started = self.clock.monotonic()
        try:
            async with fenced_transaction(conn, epoch):
                claimed = await self._claim(conn, now)
                if not claimed:
                    return PlanReport()
                claimed_at = self.clock.monotonic()
                if len(claimed) > INLINE_BATCH:
                    decisions = await asyncio.to_thread(self._decide, claimed, now)
                else:
                    decisions = self._decide(claimed, now)
                decided_at = self.clock.monotonic()
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
            self.loop.log.warning(
                "plan_batch_refused",
                error=f"{type(exc).__name__}: {exc}",
                next_step="apply the batch one schedule at a time",
            )
            return PlanReport(revisit=True)
        self._isolate = False
        committed_at = self.clock.monotonic()
        report = account_batch(claimed, decisions, fired, now, self.loop.log, shard=self.shard)
        self.invalid_total += report.invalid
        report.revisit = report.revisit or deferred > 0
        report.claim_seconds = claimed_at - started
        report.decide_seconds = decided_at - claimed_at
        report.write_seconds = committed_at - decided_at
        self.loop.log.debug(
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
            self.loop.log.warning(
                "claim_unreadable",
                error=f"{type(exc).__name__}: {exc}",
                next_step="read the batch row by row and pause the unreadable schedules",
            )
        claimed, unreadable = await self.store.claim_due_isolated(conn, now, self.config.batch_size)
        for schedule_id, error in unreadable:
            reason = f"the planner cannot read this schedule ({error}); paused"
            try:
                async with conn.transaction():  # a savepoint
                    paused = await self.store.pause_unreadable(conn, schedule_id, reason)
            except ROW_ERRORS as exc:
                paused = False
                reason = f"{reason}; the pause was refused: {type(exc).__name__}: {exc}"
            self.invalid_total += paused
            self.loop.log.error(
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
        deadline = self.clock.monotonic() + self.config.decide_budget
        fires = 0
        for item in claimed:
            if decisions and (
                fires >= self.config.max_fires_per_batch or self.clock.monotonic() > deadline
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
                self.loop.log.exception("plan_schedule_failed", schedule_id=item.schedule.id)
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

    # -- wake-ups --------------------------------------------------------------------

    async def _ensure_listener(self) -> None:
        """Keep the LISTEN connection; while it is down the loop runs on probes."""
        await self._wakeups.ensure()
