"""The dispatcher: moves due jobs from PostgreSQL into RabbitMQ (architecture.md §3).

Publish before commit: one fenced transaction per batch —

1. lock the fence row and check the epoch (``fenced_transaction``), then claim up to
   ``batch_size`` due pending jobs ``FOR UPDATE SKIP LOCKED`` (fewer when the broker's
   buffer is nearly full), in the order described below;
2. publish them all with their confirms in flight at once (``Publisher``);
3. mark only the confirmed ones ``dispatched`` (``dispatch_epoch`` = this term);
   the others simply stay ``pending`` and are counted in ``PUBLISH_FAILURES``;
4. commit.

So there is no limbo: a crash or a lost connection before the commit leaves every
row ``pending`` and the next claim publishes it again. What a crash can leave is a
*duplicate* message (confirmed, then the commit failed); a worker that receives it
reads the row ``FOR KEY SHARE`` — which waits for this transaction's row locks — sees
it is not dispatched, and acks it without running, and the ledger absorbs any other
duplicate. Such copies are bounded: a job published by a claim that did not commit is
remembered (``scheduler.duties.unsettled``), and when it is claimed again at the same
attempt it is marked with the others but published only after the commit, so a storm of
failed commits cannot publish it over and over.

The transaction stays short because the batch's confirms share one deadline
(``publish_timeout``, a few seconds); the replica's connections carry
``idle_in_transaction_session_timeout`` so a frozen zombie cannot hold locks forever,
and a newer leader's ``advance`` waits for an in-flight claim before fencing.

Wake-ups instead of polling: a dedicated connection LISTENs on ``duetime_jobs`` (the
client API and CLI NOTIFY for jobs due within a second; retries by an operator too)
and wakes the loop at once. Otherwise the loop sleeps until the earliest pending run
time, read by a prepared probe on the database clock (0.2 ms), at most
``probe_interval`` (tens of ms): that short re-probe is what finds rows inserted by
plain SQL — there is deliberately no insert trigger, because a NOTIFY in every
producer's commit serialises concurrent producers on PostgreSQL's notify lock
(measured 1.4-3.4x slower with 8 producers; migrations/0004_wakeups.sql). Jobs
inserted ahead of their due time are therefore seen ahead and fire on the timer, within
milliseconds; a job inserted by plain SQL already due waits at most ``probe_interval``.
When the timer set from the probe fires, the pass claims at once without probing again;
under a backlog, full batches run back to back without probing (the pure decisions are
``scheduler.duties.pacing``). If the LISTEN connection dies it is re-established;
nothing else changes.

One row must not stop dispatch: a row the client cannot decode (a date outside years
1-9999, JSON nested deeper than Python's parser goes) makes the batch's claim raise in
asyncpg. The database transaction is intact, so the same pass reads the locked rows one
at a time (``DispatchStore.claim_isolated``), parks each unreadable one as ``dead`` with
``last_error`` (under a savepoint: a park the database refuses leaves the row pending
and the batch intact) and dispatches the others. Migration 0006 keeps such dates out;
this is the backstop for what a CHECK cannot see.

Pipelining (claiming the next batch while the previous commits) was measured as not
worth it: the commit is ~1-2 % of a batch's time (bench/dispatch_rate.py).

The order of starting is decided here, not in RabbitMQ (docs/architecture.md, "Who
decides the order"): the claim takes jobs due longer than ``max_wait`` first, then by
priority, and a queue is published to only while its broker buffer has room
(``scheduler.duties.credit``: ready count by passive declare, before the claims that
rely on it). A queue without room is skipped by the claim and its jobs stay pending; the
loop then reads its ready count again every ``credit_interval``.

Concurrency limits (``duetime.limits``, migration 0016; docs/architecture.md, "Limits")
are enforced here too, exactly, because this fenced transaction is the only writer that
makes jobs ``dispatched``: the limits are read at most every ``limits_interval``, and
while any exist each claim transaction counts the dispatched jobs of the limited targets
(``LimitStore.counts``), takes their due jobs first with a claim of its own, kept only as
far as the remaining allowance goes (``scheduler.duties.limits``), and the general claim
skips the limited tasks and queues. A job held by a limit stays ``pending``; while a
limit holds jobs the loop re-counts every ``limits_poll``, or sooner: an outcome that
frees a ``max_running`` slot NOTIFYs ``duetime_jobs`` from the worker's settling
transaction (migration 0024), and a rate's next start is known to the millisecond.

Rate limits (``--rate N/s``, migration 0018) are decided in the same transaction: the
starts of each rate's sliding window are summed from the start log
(``LimitStore.starts``) with the counts, the allowance keeps no more than the rest, and
the starts of the jobs marked dispatched are logged (``record_starts``) before the
commit, so a dispatch and its start become visible together or not at all, and a new
leader reads the same window (docs/architecture.md, "Rate limits"). Within the window a
token bucket per rate (``scheduler.duties.rate_buckets``, in memory, ``rate_burst``)
spreads the starts over the period instead of one burst when the window frees.

Only declared queues (``duetime.queues``, migration 0008) are claimed, probed and so
published: a producer's new ``queue`` value cannot make the broker create a queue. Jobs
of other names stay pending, *held*: sampled with the backlog into ``JOBS_HELD`` and
logged once per name (``queue_undeclared``), dispatched as soon as the name is declared.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from dataclasses import dataclass

import asyncpg

from scheduler.broker_gate import GateConfig, PublisherAndGate
from scheduler.clock import Clock
from scheduler.duties.base import DutyLoop
from scheduler.duties.context import DutyContext, FencedWrites, duty_listener
from scheduler.duties.credit import DispatchCredit
from scheduler.duties.knobs import check_knobs, config_from_settings, knob
from scheduler.duties.limits import Allowance, RunningBound
from scheduler.duties.pacing import BatchReport, DispatchPacing
from scheduler.duties.rate_buckets import RateBuckets
from scheduler.duties.report import MAX_IDS_LOGGED, report_parked, some_ids
from scheduler.duties.unsettled import Unsettled
from scheduler.metrics import (
    BACKLOG,
    DISPATCH_AFTER_COMMIT,
    DISPATCH_CREDIT,
    DISPATCH_LAG,
    DISPATCH_UNCOMMITTED,
    JOBS_CLAIMED,
    JOBS_HELD,
    JOBS_PUBLISHED,
    JOBS_STAGED,
    LIMIT_HELD,
    LIMIT_STARTS,
    PUBLISH_FAILURES,
    QUEUE_PAUSED,
    WAITING,
)
from scheduler.publisher import (
    DEFAULT_PUBLISH_TIMEOUT,
    Publisher,
    PublishResult,
    publish_timeout_for,
)
from scheduler.store.conn import Conn
from scheduler.store.dispatch import NOTIFY_CHANNEL as JOBS_CHANNEL
from scheduler.store.dispatch import DispatchStore
from scheduler.store.limits import SLOT_PAYLOAD, Limit, LimitedJob, LimitStore
from scheduler.store.rows import UNREADABLE, ClaimedJob, HeldQueues

__all__ = ["RETRYABLE", "BatchReport", "Dispatcher", "DispatcherConfig"]

#: Undeclared queue names remembered as already logged (a producer may write many).
MAX_HELD_LOGGED = 1000

#: Seconds between samples of a staged queue that had no consumer (is one back?).
UNCONSUMED_RESAMPLE = 1.0

#: Errors after which a claim is simply tried again (another transaction won a race).
RETRYABLE = (
    asyncpg.exceptions.SerializationError,
    asyncpg.exceptions.DeadlockDetectedError,
    asyncpg.exceptions.LockNotAvailableError,
)


@dataclass(frozen=True, slots=True)
class DispatcherConfig:
    """How the dispatcher paces itself (``config_from_settings`` fills it)."""

    batch_size: int = knob(500, setting="claim_batch_size", ge=1)
    """Jobs claimed (and published with confirms in flight) per transaction."""
    probe_interval: float = knob(0.05, setting="probe_interval", gt=0)
    """Longest idle sleep between probes of the earliest run time (finds rows inserted by
    plain SQL), and the pause when due rows are all locked."""
    publish_timeout: float = knob(DEFAULT_PUBLISH_TIMEOUT, setting=publish_timeout_for, gt=0)
    """Deadline for one batch's confirms; bounds how long the claim transaction lasts."""
    ready_timeout: float = knob(1.0, gt=0)
    """How long one pass waits for a reconnecting broker before backing off."""
    backlog_interval: float = knob(5.0, gt=0)
    """How often the BACKLOG gauge is sampled (a count over the pending index)."""
    listen_check_interval: float = knob(10.0, gt=0)
    """How often the LISTEN connection is pinged (a half-open socket is silent)."""
    buffer: int = knob(500, setting="dispatch_buffer", ge=1)
    """Ready messages a queue may hold at least (``scheduler.duties.credit``)."""
    buffer_per_consumer: int = knob(64, setting="dispatch_buffer_per_consumer", ge=0)
    """A queue's buffer target per consumer RabbitMQ reports on it."""
    buffer_refill: float = knob(0.25, ge=0)
    """Share of a queue's buffer target that must be free before it is refilled (at
    most 1): a few large claims instead of one small claim per sample."""
    max_wait: float = knob(300.0, setting="priority_max_wait", ge=0)
    """Seconds a due job waits behind higher priorities at most."""
    credit_interval: float = knob(0.02, gt=0)
    """How often a queue's ready count is read again while the dispatcher relies on it
    (the pause, too, while every queue with due jobs has a full buffer)."""
    sample_timeout: float = knob(1.0, gt=0)
    """Deadline for one passive declare (a failed one makes the queue blind)."""
    limits_interval: float = knob(1.0, gt=0)
    """How often the limits are read again (a new or changed limit applies after it)."""
    limits_poll: float = knob(0.05, gt=0)
    """The longest pause between claims while a limit holds due jobs back (an outcome
    that frees a slot wakes the loop sooner)."""
    stage_ahead: float = knob(2.0, setting="stage_ahead", ge=0)
    """Seconds before their run time jobs are handed to workers, which start them from
    their own timers (DESIGN §14; 0: off)."""
    rate_burst: float = knob(0.1, gt=0)
    """Share of a rate's count that may start at once (its token bucket, at least 1 job);
    the rest of a period's starts are spread evenly over the period."""

    def __post_init__(self) -> None:
        check_knobs(self)


def _credit(config: DispatcherConfig, clock: Clock) -> DispatchCredit:
    """A queue's broker buffer bound as the knobs say (``scheduler.duties.credit``)."""
    return DispatchCredit(
        buffer=config.buffer,
        per_consumer=config.buffer_per_consumer,
        refresh=config.credit_interval,
        clock=clock,
        refill=config.buffer_refill,
    )


class Dispatcher:
    """Built from its ``DutyContext``; ``publisher``: one to share instead of its own."""

    name = "dispatcher"

    def __init__(
        self,
        ctx: DutyContext,
        *,
        config: DispatcherConfig | None = None,
        publisher: Publisher | None = None,
    ) -> None:
        self.config = config = config or config_from_settings(DispatcherConfig, ctx.settings)
        self.shard = shard = ctx.shard  # its messages and metrics name it
        self.clock = clock = ctx.clock
        # a 0 sample from the start, so the first failure shows as an increase
        PUBLISH_FAILURES.labels(shard)
        DISPATCH_UNCOMMITTED.labels(shard)
        self.loop = DutyLoop(self, shard=shard)
        self.writes = FencedWrites(ctx, write="fenced claim")
        self.store = DispatchStore(ctx.pool, acquire_timeout=ctx.settings.db_timeout)
        self.limits = LimitStore(ctx.pool, acquire_timeout=ctx.settings.db_timeout)
        self._limits: list[Limit] = []
        self._limits_read_at = float("-inf")
        self._limits_holding = False  # the last claim left jobs pending for a limit
        self._rate_free_in: float | None = None  # when a full rate's window frees a start
        # the last limited claim's allowance and kept jobs: their starts are logged
        self._rated: tuple[Allowance, list[LimitedJob]] | None = None
        self._limit_series: set[str] = set()  # targets LIMIT_HELD has a series for
        self._paused_series: set[str] = set()  # queues QUEUE_PAUSED has a series for
        self.buckets = RateBuckets(burst=config.rate_burst, clock=clock)
        self._rated_at: float | None = None  # when the logged starts' buckets were read
        self._slack = False  # no limit can bind this claim (``Allowance.slack``)
        # dispatched jobs per limited target at most, between counts (skips the count)
        self.running_bound = RunningBound(max_age=config.limits_interval)
        self._rated_exhausted: set[tuple[str, str]] = set()  # their slots left with no room
        self.out = PublisherAndGate(
            ctx.settings,
            name=self.name,
            shard=shard,
            publish_timeout=config.publish_timeout,
            gate=GateConfig(config.ready_timeout, base=0.1, cap=5.0),
            log=lambda: self.loop.log,
            publisher=publisher,
            clock=ctx.clock,
        )
        self.publisher = self.out.publisher
        self._held_logged: set[str] = set()  # undeclared queues already logged
        self.pacing = DispatchPacing(
            batch_size=config.batch_size,
            probe_interval=config.probe_interval,
            backlog_interval=config.backlog_interval,
            clock=clock,
        )
        self.unsettled = Unsettled(clock=clock)
        self.credit = _credit(config, clock)
        # staging ahead: the staged queues' own credit (the same bound as the due
        # queues'), when to look for jobs to stage next, and whether the due claims left
        # room for it
        self.stage_credit = _credit(config, clock)
        self._stage_at = float("-inf")  # no look before (a throttle of probe_interval)
        self._stage_wake = float("inf")  # when staging needs the loop again
        self._unconsumed_logged: set[str] = set()  # staged queues logged as unconsumed
        self._unconsumed_sampled_at = float("-inf")
        self._may_stage = False
        self._slot_heard = False  # the notification being delivered frees a slot
        # the last finished limited claim held jobs back: a freed slot should wake us
        self._slots_wanted = False
        self._wakeups = duty_listener(
            ctx,
            JOBS_CHANNEL,
            self._woken,
            role="listen",
            check_interval=config.listen_check_interval,
            log=lambda: self.loop.log,
            on_payload=self._heard,
        )

    # -- lifecycle -------------------------------------------------------------------

    async def setup(self) -> None:
        await self.out.open()
        await self._ensure_listener()

    async def teardown(self) -> None:
        await self._wakeups.close()
        await self.out.close()
        self.pacing.reset()  # ``unsettled`` is kept: a failed pass tears down too
        self.credit.reset()  # the next term reads the broker's buffers again
        self.stage_credit.reset()
        self._stage_at = float("-inf")
        self.buckets.reset()  # the window, read from the rows, bounds a new term's start
        self._limits_read_at = float("-inf")
        self.running_bound.reset()  # another leader may dispatch before our next term

    @property
    def listening(self) -> bool:
        return self._wakeups.alive

    # -- one pass --------------------------------------------------------------------

    async def run_once(self) -> float:
        """Dispatch what is due, then stage what is due soon (when the due claims left
        room); return how long to sleep (wake() cuts it short)."""
        self._may_stage = False
        delay = await self._dispatch_due()
        if self.config.stage_ahead <= 0 or not self._may_stage:
            return delay
        return min(delay, await self._stage_due_soon())

    async def _dispatch_due(self) -> float:
        """The due jobs' pass; sets ``_may_stage`` when it ended with room to spare."""
        await self._ensure_listener()
        if not await self.read_limits():
            return self.config.limits_poll  # fail closed: a limit must not be skipped
        if self.pacing.backlog_sample_due():
            with contextlib.suppress(asyncpg.PostgresError, TimeoutError):
                BACKLOG.labels(self.shard).set(await self.store.backlog())
                WAITING.labels(self.shard).set(await self.store.waiting())
                self._report_held(await self.store.held())
                await self._report_limit_held()
                self._report_paused(await self.store.queue_flags())
        delay: float | None = await self.out.gate.delay()
        if delay:
            return delay
        probed = self.pacing.should_probe()
        self._may_stage = True
        if probed:
            delay = self.pacing.after_probe(await self.store.next_run_in())
            if delay is not None:
                return delay
        await self._sample_credit()
        if self.credit.skip_claim(self.credit.held()):
            return self.config.credit_interval
        try:
            report = await self.dispatch_batch()
        except RETRYABLE as exc:
            self.loop.log.warning("claim_retry", error=f"{type(exc).__name__}: {exc}")
            return self.pacing.after_conflict()
        delay = self.pacing.after_batch(report, probed=probed)
        # a full batch means more is due: no staging until the due backlog is gone
        self._may_stage = not report.failed and report.claimed < report.limit
        if self._limits_holding and not report.failed and report.claimed < report.limit:
            # due jobs wait for a slot, which a worker's outcome frees without a wake-up,
            # or for a start to leave a rate's window (known to the millisecond)
            if self._rate_free_in is not None:
                return max(0.001, min(self.config.limits_poll, self._rate_free_in))
            return self.config.limits_poll
        if report.held and not report.failed and report.claimed < report.limit:
            # queues with due jobs may be waiting for room in their broker buffer: read
            # their ready counts again soon, not at the next probe's due time
            wait = await self.store.next_run_in()
            if wait is not None and wait <= 0:
                return self.config.credit_interval
            return self.pacing.idle(wait)
        if delay is not None:
            return delay
        return self.pacing.idle(await self.store.next_run_in())

    # -- staging ahead (DESIGN §14) ---------------------------------------------------

    def _stage_filters(self) -> tuple[list[str], list[str]]:
        """What staging skips: (queues, tasks). Every target of a limit (a limit is
        decided when its job starts, from the dispatched jobs and the window's starts
        then, so a job under a limit is never handed out early), the queues whose
        staged buffer has no room, and those whose staged queue had no consumer at its
        last sample (workers with ``worker_stage_limit`` 0, or of a version without
        staging: what is staged there would wait for the reconciler)."""
        tasks = sorted({lim.name for lim in self._limits if lim.kind == "task"})
        queues = {lim.name for lim in self._limits if lim.kind == "queue"}
        unconsumed = self.stage_credit.without_consumers()
        for queue in set(unconsumed) - self._unconsumed_logged:
            self.loop.log.warning(
                "staged_queue_without_consumer",
                queue=queue,
                outcome="not staged until a worker consumes its staged queue; its jobs "
                "are dispatched when due, and those staged already start after the "
                "visibility timeout (the reconciler)",
                fix="DUETIME_WORKER_STAGE_LIMIT > 0 on this queue's workers, or "
                "DUETIME_STAGE_AHEAD=0 here",
            )
        self._unconsumed_logged = set(unconsumed)
        return sorted(queues | set(self.stage_credit.held()) | set(unconsumed)), tasks

    async def _stage_due_soon(self) -> float:
        """Stage the jobs whose run time is within ``stage_ahead`` when it is time to look
        (at most every ``probe_interval``, at once after a NOTIFY or a full batch); one
        probe when nothing is. Returns how long until staging needs the loop again: the
        time until the earliest stageable job enters the horizon, or ``inf`` when none
        is known (then the due pass's own pacing decides, and staging looks again at its
        next pass, as the due probe finds jobs inserted by plain SQL)."""
        now = self.clock.monotonic()
        if now < self._stage_at:
            return max(0.0, self._stage_wake - now)
        self._stage_wake = now + await self._stage_once()
        return self._stage_wake - now

    async def _stage_once(self) -> float:
        """One look: stage what is within the horizon; how long until the next look is
        needed (``_stage_due_soon``)."""
        config = self.config
        now = self.clock.monotonic()
        to_sample = set(self.stage_credit.to_sample())
        if now - self._unconsumed_sampled_at >= UNCONSUMED_RESAMPLE:
            # an empty staged queue without consumers is not sampled for its credit:
            # look again now and then whether a worker consumes it
            self._unconsumed_sampled_at = now
            to_sample.update(self.stage_credit.without_consumers())
        for queue in sorted(to_sample):
            state = await self.publisher.queue_state(queue, config.sample_timeout, staged=True)
            if state is None:
                self.stage_credit.observe_failed(queue)
            else:
                self.stage_credit.observe(queue, state.ready, state.consumers)
        held, skip_tasks = self._stage_filters()
        wait = await self.store.next_stage_in(held=held, skip_tasks=skip_tasks)
        self._stage_at = self.clock.monotonic() + config.probe_interval
        if wait is None:
            return float("inf")
        if wait > config.stage_ahead:
            return wait - config.stage_ahead
        limit = self.stage_credit.limit(config.batch_size)
        try:
            staged = await self.stage_batch(limit, held, skip_tasks)
        except RETRYABLE as exc:
            self.loop.log.warning("stage_retry", error=f"{type(exc).__name__}: {exc}")
            staged = 0
        if staged >= limit:
            self._stage_at = float("-inf")  # more may be within the horizon: at once
            return 0.0
        return config.probe_interval

    async def stage_batch(self, limit: int, held: list[str], skip_tasks: list[str]) -> int:
        """One staging transaction: claim the jobs due within ``stage_ahead``, publish
        them to their staged queues with confirms, mark the confirmed ones dispatched
        (heartbeat_at = their run time), commit. Returns how many were claimed."""
        epoch = self.loop.term.epoch
        result: PublishResult | None = None
        later: list[ClaimedJob] = []
        marked: set[int] = set()
        try:
            async with self.writes.transaction(epoch) as conn:
                try:
                    jobs = await self.store.claim_staged(
                        conn,
                        limit,
                        ahead=self.config.stage_ahead,
                        held=held,
                        skip_tasks=skip_tasks,
                    )
                except UNREADABLE as exc:
                    # left to the due claim, which parks what it cannot read
                    self.loop.log.warning(
                        "stage_unreadable",
                        error=f"{type(exc).__name__}: {exc}",
                        outcome="not staged: dispatched when due",
                    )
                    return 0
                if not jobs:
                    return 0
                claimed = len(jobs)
                jobs, _over = self.stage_credit.trim(jobs)
                fresh, later = self.unsettled.split(jobs)
                result = await self.publisher.publish(fresh, epoch, staged=True)
                marked = await self.store.mark_staged(conn, [*result.confirmed, *later], epoch)
        except BaseException as exc:
            self._interrupted(exc, result)
            raise
        assert result is not None
        later = [job for job in later if job.id in marked]
        if later:
            result = await self._publish_after_commit(later, result, epoch, staged=True)
        self.stage_credit.spend(job.queue for job in result.confirmed)
        for queue, count in Counter(job.queue for job in result.confirmed).items():
            JOBS_STAGED.labels(self.shard, queue).inc(count)
        self._report_failures(result)
        self.loop.log.debug(
            "stage_batch",
            claimed=claimed,
            staged=len(result.confirmed),
            failed=len(result.failed),
        )
        return claimed

    async def _sample_credit(self) -> None:
        """Read the ready count and consumers of each queue whose credit rests on an old
        sample (``DispatchCredit.to_sample``): one passive declare each, bounded."""
        for queue in self.credit.to_sample():
            state = await self.publisher.queue_state(queue, self.config.sample_timeout)
            if state is None:
                self.credit.observe_failed(queue)
            else:
                self.credit.observe(queue, state.ready, state.consumers)
            DISPATCH_CREDIT.labels(self.shard, queue).set(self.credit.credit(queue))

    async def dispatch_batch(self) -> BatchReport:
        """One claim transaction: claim, publish with confirms, mark confirmed, commit;
        then publish the jobs an uncommitted claim had published already."""
        epoch = self.loop.term.epoch
        started = self.clock.monotonic()
        jobs: list[ClaimedJob] = []
        later: list[ClaimedJob] = []
        result: PublishResult | None = None
        lags: dict[int, float] = {}
        starts: dict[tuple[str, str], int] = {}
        self._rated_at = None
        held = self.credit.held()
        limit = self.credit.limit(self.config.batch_size)
        try:
            async with self.writes.transaction(epoch) as conn:
                jobs = await self._claim_limited(conn, limit, held)
                self._slots_wanted = self._limits_holding  # not while it was deciding
                if len(jobs) < limit:
                    jobs += await self._claim(conn, limit - len(jobs), held)
                self.credit.claimed(len(jobs), held)
                if not jobs:
                    return BatchReport(limit=limit, held=len(held))
                claimed_at = self.clock.monotonic()
                # rows over a queue's credit stay pending (their locks end at commit)
                jobs, _over = self.credit.trim(jobs)
                fresh, later = self.unsettled.split(jobs)
                result = await self.publisher.publish(fresh, epoch)
                published_at = self.clock.monotonic()
                lags = await self.store.mark_dispatched(conn, [*result.confirmed, *later], epoch)
                # before the commit: one whose answer is lost may still have committed
                self.running_bound.charge(epoch, (job for job in jobs if job.id in lags))
                starts = await self._record_starts(conn, lags)
        except BaseException as exc:
            self._interrupted(exc, result)
            raise
        committed_at = self.clock.monotonic()
        assert result is not None
        for (target, _key), count in starts.items():
            LIMIT_STARTS.labels(self.shard, target).inc(count)
        if starts and self._rated_at is not None:
            limits = {lim.target: lim for lim in self._limits}
            self.buckets.charge(limits, starts, self._rated_at, self._rated_exhausted)
        later = [job for job in later if job.id in lags]  # marked by this commit
        if later:
            result = await self._publish_after_commit(later, result, epoch)
        self.credit.spend(job.queue for job in result.confirmed)
        self._account(jobs, result, lags)
        self.loop.log.debug(
            "dispatch_batch",
            claimed=len(jobs),
            published=len(result.confirmed),
            failed=len(result.failed),
            after_commit=len(later),
            claim_ms=round((claimed_at - started) * 1000, 2),
            publish_ms=round((published_at - claimed_at) * 1000, 2),
            commit_ms=round((committed_at - published_at) * 1000, 2),
        )
        return BatchReport(
            len(jobs), len(result.confirmed), len(result.failed), limit=limit, held=len(held)
        )

    def _interrupted(self, exc: BaseException, result: PublishResult | None) -> None:
        """A claim transaction that did not commit after publishing: remember what was
        confirmed. The rows stay pending and are claimed again; workers skip these
        copies (row not dispatched) or the ledger absorbs them, and the next claim of
        these jobs publishes after its commit (``unsettled``)."""
        if result is None or not result.confirmed:
            return
        self.unsettled.remember(result.confirmed)
        DISPATCH_UNCOMMITTED.labels(self.shard).inc(len(result.confirmed))
        ids = [job.id for job in result.confirmed]
        cancelled = isinstance(exc, asyncio.CancelledError)  # stop() mid-batch
        (self.loop.log.warning if cancelled else self.loop.log.error)(
            "dispatch_interrupted" if cancelled else "dispatch_commit_failed",
            error=f"{type(exc).__name__}: {exc}",
            published=len(ids),
            job_ids=ids[:MAX_IDS_LOGGED],
            remembered=len(self.unsettled),
            next_step="publish these jobs after the commit of their next claim",
        )

    async def _publish_after_commit(
        self, jobs: list[ClaimedJob], result: PublishResult, epoch: int, *, staged: bool = False
    ) -> PublishResult:
        """Publish ``jobs`` (committed ``dispatched`` just now, published once before by a
        claim that did not commit); returns ``result`` with their outcomes added. One
        that is not confirmed stays dispatched for the reconciler: its row is no longer
        ``pending``, so nothing else would send it."""
        self.unsettled.forget(jobs)
        after = await self.publisher.publish(jobs, epoch, staged=staged)
        counter = DISPATCH_AFTER_COMMIT.labels(self.shard, "confirmed")
        counter.inc(len(after.confirmed))
        if after.failed:
            DISPATCH_AFTER_COMMIT.labels(self.shard, "failed").inc(len(after.failed))
            self.loop.log.error(
                "dispatch_after_commit_unconfirmed",
                **some_ids([f.job.id for f in after.failed]),
                detail=after.failed[0].detail,
                outcome="left dispatched: the reconciler re-publishes after visibility_timeout",
            )
        self.loop.log.info(
            "dispatch_after_commit",
            published=len(after.confirmed),
            failed=len(after.failed),
            reason="an earlier claim of these attempts published them and did not commit",
        )
        return PublishResult(
            confirmed=[*result.confirmed, *after.confirmed],
            failed=result.failed,
            seconds=result.seconds + after.seconds,
        )

    async def read_limits(self) -> bool:
        """Refresh the cached limits every ``limits_interval`` (a failed read keeps the
        last ones: the counts, not this list, are what keeps a limit exact). False while
        they have not been read once in this term: then nothing may be claimed, since
        an empty list would let the general claim start every limited job at once (a
        new leader whose first read meets a full connection table did exactly that)."""
        now = self.clock.monotonic()
        if now - self._limits_read_at < self.config.limits_interval:
            return True
        try:
            self._limits = await self.limits.all()
        except (asyncpg.PostgresError, TimeoutError) as exc:
            if self._limits_read_at == float("-inf"):
                self.loop.log.warning(
                    "limits_unread",
                    error=f"{type(exc).__name__}: {exc}",
                    outcome="nothing claimed until the limits are read",
                )
                return False
            return True
        self._limits_read_at = now
        return True

    async def _claim_limited(self, conn: Conn, limit: int, held: list[str]) -> list[ClaimedJob]:
        """The due jobs of limited targets that their limits admit now (none without
        limits: then this costs nothing)."""
        self._limits_holding = False
        self._rate_free_in = None
        self._rated = None
        self._slack = False
        if not self._limits:
            return []
        epoch = self.loop.term.epoch
        now = self.clock.monotonic()
        if self.running_bound.slack(epoch, self._limits, limit, now):
            # the bound on the dispatched jobs leaves room for the whole claim: no count
            self._slack = True
            return []
        async with self.limits.generic_plans(conn):
            allowance = await self._allowance(conn, epoch, now)
            self._rate_free_in = allowance.free_in()
            if allowance.slack(limit):
                # no limit can bind this claim: the general claim takes every due job
                self._slack = True
                return []
            if allowance.all_closed():
                # every target is full: its claim would only step over their due rows
                self._limits_holding = True
                return []
            capped = [lim for lim in self._limits if not lim.fair]
            fair = [lim.name for lim in self._limits if lim.fair]  # the fair claim's
            found = []
            bound = allowance.bound(capped)
            if capped and bound != 0:
                # lock only as many candidates as the limits may admit (a 50/s rate
                # takes 50, not a batch of 500 row locks to leave 450 pending)
                found = await self.limits.claim(
                    conn,
                    capped,
                    allowance.closed(),
                    limit if bound is None else min(limit, bound),
                    held=[*held, *fair],
                )
        seen = {job.job.id for job in found}
        for queue in allowance.fair_queues:
            if queue not in held:
                more = await self.limits.claim_fair(conn, queue, limit)
                found += [job for job in more if job.job.id not in seen]
                seen.update(job.job.id for job in more)
        kept, left = allowance.take(found, limit)  # the others stay pending
        self._limits_holding = allowance.holding() or bool(left)
        self._rate_free_in = allowance.free_in()  # after take: its slices are spent
        if allowance.rated and kept:
            self._rated = (allowance, kept)
        return [job.job for job in kept]

    async def _allowance(self, conn: Conn, epoch: int, now: float) -> Allowance:
        """Count the dispatched jobs and the window's starts of the limited targets (an
        exact count, which the running bound starts again from)."""
        running = await self.limits.counts(conn, self._limits)
        self.running_bound.observe(epoch, self._limits, running, now)
        started = await self.limits.starts(conn, self._limits)
        return Allowance(self._limits, running, started, self.buckets)

    async def _record_starts(
        self, conn: Conn, lags: dict[int, float]
    ) -> dict[tuple[str, str], int]:
        """Log the starts the rate-limited jobs marked dispatched by this transaction
        make (``lags``: the marked ids), before its commit; returns them."""
        if self._rated is None:
            return {}
        allowance, kept = self._rated
        self._rated = None
        self._rated_at = allowance.read_at
        self._rated_exhausted = allowance.exhausted()
        starts = allowance.rate_starts(job for job in kept if job.job.id in lags)
        await self.limits.record_starts(conn, starts)
        return starts

    async def _claim(self, conn: Conn, limit: int, held: list[str]) -> list[ClaimedJob]:
        """The batch's general claim (without the limited tasks and queues); row by row,
        parking what cannot be read, if it must be."""
        max_wait = self.config.max_wait
        skipped = [] if self._slack else self._limits
        skip_tasks = sorted({lim.name for lim in skipped if lim.kind == "task"})
        held = [*held, *(lim.name for lim in skipped if lim.kind == "queue")]
        try:
            return await self.store.claim(
                conn, limit, max_wait=max_wait, held=held, skip_tasks=skip_tasks
            )
        except UNREADABLE as exc:
            self.loop.log.warning(
                "claim_unreadable",
                error=f"{type(exc).__name__}: {exc}",
                next_step="read the batch row by row and park the unreadable rows",
            )
        jobs, unreadable = await self.store.claim_isolated(
            conn, limit, max_wait=max_wait, held=held, skip_tasks=skip_tasks
        )
        parked = await self.store.park_unreadable(conn, unreadable, reader=self.name)
        report_parked(parked, shard=self.shard, log=self.loop.log)
        return jobs

    def _account(
        self, jobs: list[ClaimedJob], result: PublishResult, lags: dict[int, float]
    ) -> None:
        for queue, count in Counter(job.queue for job in jobs).items():
            JOBS_CLAIMED.labels(self.shard, queue).inc(count)
        for queue, count in Counter(job.queue for job in result.confirmed).items():
            JOBS_PUBLISHED.labels(self.shard, queue).inc(count)
        dispatch_lag = DISPATCH_LAG.labels(self.shard)
        for lag in lags.values():
            dispatch_lag.observe(max(0.0, lag))
        missing = sorted({job.id for job in result.confirmed} - set(lags))
        if missing:
            self.loop.log.error(
                "dispatch_mark_mismatch", missing=len(missing), job_ids=missing[:MAX_IDS_LOGGED]
            )
        self._report_failures(result)

    def _report_failures(self, result: PublishResult) -> None:
        """Count and log the publishes RabbitMQ did not confirm (their jobs stay
        pending)."""
        if not result.failed:
            return
        PUBLISH_FAILURES.labels(self.shard).inc(len(result.failed))
        details = {f.job.id: f.detail for f in result.failed}
        for (reason, queue), ids in result.failures_by_reason().items():
            self.loop.log.error(
                "publish_failed",
                reason=reason,
                queue=queue,
                **some_ids(ids),
                detail=details[ids[0]],
                outcome="kept pending",
            )

    async def _report_limit_held(self) -> None:
        """Gauge the due jobs each limit holds back; a removed limit's series goes."""
        held = await self.limits.held(self._limits) if self._limits else {}
        for target, jobs in held.items():
            LIMIT_HELD.labels(self.shard, target).set(jobs)
        for target in self._limit_series - held.keys():
            with contextlib.suppress(KeyError):
                LIMIT_HELD.remove(self.shard, target)
        self._limit_series = set(held)

    def _report_paused(self, flags: dict[str, bool]) -> None:
        """Gauge each declared queue's pause (1 paused, 0 not); an undeclared queue's
        series goes."""
        for queue, paused in flags.items():
            QUEUE_PAUSED.labels(self.shard, queue).set(1 if paused else 0)
        for queue in self._paused_series - flags.keys():
            with contextlib.suppress(KeyError):
                QUEUE_PAUSED.remove(self.shard, queue)
        self._paused_series = set(flags)

    def _report_held(self, held: HeldQueues) -> None:
        """Gauge the jobs held for undeclared queues; log each such queue once (while
        it stays held), never per job."""
        JOBS_HELD.labels(self.shard, "queue_undeclared").set(held.total_jobs)
        current = {name for name, _ in held.queues}
        if held.total_queues <= len(held.queues):  # every held name is in the sample
            self._held_logged &= current
        for name, count in held.queues:
            if name in self._held_logged or len(self._held_logged) >= MAX_HELD_LOGGED:
                continue
            self._held_logged.add(name)
            self.loop.log.warning(
                "queue_undeclared",
                queue=name,
                held=count,
                held_total=held.total_jobs,
                undeclared_queues=held.total_queues,
                outcome="held pending, not published",
                fix=f"duetime queues add {name}",
            )

    # -- wake-ups --------------------------------------------------------------------

    def _heard(self, payload: str) -> None:
        self._slot_heard = payload == SLOT_PAYLOAD

    def _woken(self) -> None:
        """Wake the loop on a notification (or a lost LISTEN connection), except for a
        freed slot while the last claim held no job back for a limit: then no job waits
        for that slot, and every outcome of a job under a limit that does not bind
        (``--max-running 1000000``) made a pass of its own (issue 23's target 6, the
        storm: docs/benchmarks.md). A job held since is found by the pass that holds
        it, which then re-counts every ``limits_poll`` and hears the slots. The flag
        is the last *finished* limited claim's: ``_limits_holding`` is cleared while a
        claim decides, and a slot freed meanwhile must still wake the next pass."""
        slot, self._slot_heard = self._slot_heard, False
        if slot and not self._slots_wanted:
            return
        if not slot:
            self._stage_at = float("-inf")  # a job due within a second: stage it at once
        self.loop.wake()

    async def _ensure_listener(self) -> None:
        """Keep the LISTEN connection; while it is down the loop runs on probes."""
        if await self._wakeups.ensure():
            # a NOTIFY sent while we were not listening is lost: make this pass probe
            self.pacing.reset()
