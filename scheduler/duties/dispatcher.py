"""The dispatcher: moves due jobs from PostgreSQL into RabbitMQ (DESIGN §5).

Ordering (issue 4, option a): one fenced transaction per batch —

1. lock the fence row and check the epoch (``fenced_transaction``), then claim up to
   ``batch_size`` due pending jobs ``FOR UPDATE SKIP LOCKED``, earliest run time first;
2. publish them all with their confirms in flight at once (``Publisher``);
3. mark only the confirmed ones ``dispatched`` (``dispatch_epoch`` = this term);
   the others simply stay ``pending`` and are counted in ``PUBLISH_FAILURES``;
4. commit.

So there is no limbo: a crash or a lost connection before the commit leaves every
row ``pending`` and the next claim publishes it again. What a crash can leave is a
*duplicate* message (confirmed, then the commit failed); a worker that receives it
reads the row ``FOR KEY SHARE`` — which waits for this transaction's row locks — sees
it is not dispatched, and acks it without running, and the ledger absorbs any other
duplicate. The transaction stays short because the batch's confirms share one
deadline (``publish_timeout``, a few seconds); the replica's connections carry
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
under a backlog, full batches run back to back without probing. If the LISTEN
connection dies it is re-established; nothing else changes.

One row must not stop dispatch: a row the client cannot decode (a date outside years
1-9999, JSON nested deeper than Python's parser goes) makes the batch's claim raise in
asyncpg. The database transaction is intact, so the same pass reads the locked rows one
at a time (``DispatchStore.claim_isolated``), parks each unreadable one as ``dead`` with
``last_error`` (under a savepoint: a park the database refuses leaves the row pending
and the batch intact) and dispatches the others. Migration 0006 keeps such dates out;
this is the backstop for what a CHECK cannot see.

Pipelining (claiming the next batch while the previous commits) was measured as not
worth it: the commit is ~1-2 % of a batch's time (bench/dispatch_rate.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import asyncpg

from scheduler.backoff import bounded_jitter
from scheduler.clock import SYSTEM_CLOCK, Clock
from scheduler.config import Settings
from scheduler.duties.publishing import PublishingDuty
from scheduler.fence import fenced_transaction
from scheduler.metrics import (
    BACKLOG,
    DISPATCH_LAG,
    JOBS_CLAIMED,
    JOBS_PUBLISHED,
    PUBLISH_FAILURES,
)
from scheduler.publisher import (
    DEFAULT_PUBLISH_TIMEOUT,
    Publisher,
    PublishResult,
    publish_timeout_for,
)
from scheduler.store.conn import Conn
from scheduler.store.dispatch import NOTIFY_CHANNEL as JOBS_CHANNEL
from scheduler.store.listener import KeptListener
from scheduler.store.rows import UNREADABLE, ClaimedJob

#: Errors after which a claim is simply tried again (another transaction won a race).
RETRYABLE = (
    asyncpg.exceptions.SerializationError,
    asyncpg.exceptions.DeadlockDetectedError,
    asyncpg.exceptions.LockNotAvailableError,
)
#: At most this many job ids are written into one log line (the count is always there).
MAX_IDS_LOGGED = 100


@dataclass(frozen=True, slots=True)
class DispatcherConfig:
    """How the dispatcher paces itself; ``from_settings`` fills it from ``Settings``."""

    batch_size: int = 500
    """Jobs claimed (and published with confirms in flight) per transaction."""
    probe_interval: float = 0.05
    """Longest idle sleep between probes of the earliest run time (finds rows inserted by
    plain SQL), and the pause when due rows are all locked."""
    publish_timeout: float = DEFAULT_PUBLISH_TIMEOUT
    """Deadline for one batch's confirms; bounds how long the claim transaction lasts."""
    ready_timeout: float = 1.0
    """How long one pass waits for a reconnecting broker before backing off."""
    backlog_interval: float = 5.0
    """How often the BACKLOG gauge is sampled (a count over the pending index)."""
    listen_check_interval: float = 10.0
    """How often the LISTEN connection is pinged (a half-open socket is silent)."""

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 (got {self.batch_size})")
        for name in (
            "probe_interval",
            "publish_timeout",
            "ready_timeout",
            "backlog_interval",
            "listen_check_interval",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 (got {getattr(self, name)})")

    @classmethod
    def from_settings(cls, settings: Settings, **overrides: object) -> DispatcherConfig:
        values: dict[str, object] = {
            "batch_size": settings.claim_batch_size,
            "probe_interval": settings.probe_interval,
            "publish_timeout": publish_timeout_for(settings),
        }
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class BatchReport:
    """What one claim transaction did."""

    claimed: int = 0
    published: int = 0
    failed: int = 0


class Dispatcher(PublishingDuty):
    name = "dispatcher"

    def __init__(
        self,
        settings: Settings,
        pool: asyncpg.Pool,
        *,
        config: DispatcherConfig | None = None,
        publisher: Publisher | None = None,
        clock: Clock = SYSTEM_CLOCK,
        is_leader: Callable[[], bool] | None = None,
    ) -> None:
        config = config or DispatcherConfig.from_settings(settings)
        super().__init__(
            settings,
            pool,
            publish_timeout=config.publish_timeout,
            publisher=publisher,
            clock=clock,
            is_leader=is_leader,
        )
        self.config = config
        self._wakeups = KeptListener(
            settings.database_url,
            JOBS_CHANNEL,
            self.wake,
            timeout=settings.db_timeout,
            application_name=f"duetime:{settings.node_id}:listen",
            check_interval=self.config.listen_check_interval,
            log=lambda: self.log,
        )
        self._backlog_sampled_at = float("-inf")
        self._in_backlog = False
        self._due_timer: float | None = None  # monotonic time the last probe slept until
        self._broker_failures = 0
        self._failed_passes = 0
        self._throttled = False

    # -- lifecycle -------------------------------------------------------------------

    async def setup(self) -> None:
        await super().setup()
        await self._ensure_listener()

    async def teardown(self) -> None:
        await self._wakeups.close()
        await super().teardown()
        self._in_backlog = False

    @property
    def listening(self) -> bool:
        return self._wakeups.alive

    # -- one pass --------------------------------------------------------------------

    async def run_once(self) -> float:
        """Dispatch what is due; return how long to sleep (wake() cuts it short)."""
        await self._ensure_listener()
        await self._sample_backlog()
        throttle = self.publisher.throttle_delay()
        if throttle > 0:
            if not self._throttled:  # log transitions, not every pause
                self.log.warning(
                    "dispatch_throttled",
                    blocked=self.publisher.blocked,
                    pressure=round(self.publisher.pressure, 3),
                    delay=round(throttle, 3),
                )
            self._throttled = True
            return throttle
        if self._throttled:
            self._throttled = False
            self.log.info("dispatch_unthrottled", pressure=round(self.publisher.pressure, 3))
        if not await self.publisher.wait_ready(self.config.ready_timeout):
            self._broker_failures += 1
            delay = bounded_jitter(self._broker_failures, base=0.1, cap=5.0)
            self.log.warning(
                "broker_not_ready", failures=self._broker_failures, retry_in=round(delay, 3)
            )
            return delay
        self._broker_failures = 0

        # skip the probe under a backlog, and when the timer the last probe set is up
        # (a job is due now: claim at once, one round trip sooner)
        probed = not self._in_backlog and not self._timer_fired()
        if probed:
            wait = await self.store.next_run_in()
            if wait is None or wait > 0:
                return self._idle_delay(wait)
        try:
            report = await self.dispatch_batch()
        except RETRYABLE as exc:
            self._in_backlog = False
            self.log.warning("claim_retry", error=f"{type(exc).__name__}: {exc}")
            return bounded_jitter(1, base=0.02)

        full = report.claimed >= self.config.batch_size
        if report.failed:
            self._failed_passes += 1
            self._in_backlog = full and report.published > 0
            if self._in_backlog:
                return 0.0
            return bounded_jitter(self._failed_passes, base=0.1, cap=5.0)
        self._failed_passes = 0
        self._in_backlog = full
        if full:
            return 0.0
        if report.claimed == 0 and probed:
            # the probe said a job is due, yet nothing could be locked: every due row is
            # held by another transaction (a cancel, a worker's read) — look again soon
            return self.config.probe_interval
        return self._idle_delay(await self.store.next_run_in())

    def _idle_delay(self, wait: float | None) -> float:
        """Sleep until the next run time ``wait`` seconds away, at most the cap."""
        cap = self.config.probe_interval
        self._due_timer = None
        if wait is None:
            return cap
        if 0 < wait <= cap:
            self._due_timer = time.monotonic() + wait
        return max(0.0, min(wait, cap))

    def _timer_fired(self) -> bool:
        due, self._due_timer = self._due_timer, None
        return due is not None and time.monotonic() >= due

    async def dispatch_batch(self) -> BatchReport:
        """One claim transaction: claim, publish with confirms, mark confirmed, commit."""
        epoch = self.term.epoch
        self._check_leader()
        started = time.perf_counter()
        jobs: list[ClaimedJob] = []
        result: PublishResult | None = None
        lags: dict[int, float] = {}
        try:
            async with (
                self.pool.acquire(timeout=self.settings.db_timeout) as conn,
                fenced_transaction(conn, epoch),
            ):
                jobs = await self._claim(conn)
                if not jobs:
                    return BatchReport()
                claimed_at = time.perf_counter()
                result = await self.publisher.publish(jobs, epoch)
                published_at = time.perf_counter()
                lags = await self.store.mark_dispatched(conn, result.confirmed, epoch)
        except BaseException as exc:
            if result is not None and result.confirmed:
                # published but not committed: the rows stay pending and are claimed
                # again; workers skip these copies (row not dispatched) or the ledger
                # absorbs them
                ids = [job.id for job in result.confirmed]
                cancelled = isinstance(exc, asyncio.CancelledError)  # stop() mid-batch
                (self.log.warning if cancelled else self.log.error)(
                    "dispatch_interrupted" if cancelled else "dispatch_commit_failed",
                    error=f"{type(exc).__name__}: {exc}",
                    published=len(ids),
                    job_ids=ids[:MAX_IDS_LOGGED],
                )
            raise
        committed_at = time.perf_counter()
        assert result is not None
        self._account(jobs, result, lags)
        self.log.debug(
            "dispatch_batch",
            claimed=len(jobs),
            published=len(result.confirmed),
            failed=len(result.failed),
            claim_ms=round((claimed_at - started) * 1000, 2),
            publish_ms=round((published_at - claimed_at) * 1000, 2),
            commit_ms=round((committed_at - published_at) * 1000, 2),
        )
        return BatchReport(len(jobs), len(result.confirmed), len(result.failed))

    async def _claim(self, conn: Conn) -> list[ClaimedJob]:
        """The batch's claim; row by row, parking what cannot be read, if it must be."""
        try:
            return await self.store.claim(conn, self.config.batch_size)
        except UNREADABLE as exc:
            self.log.warning(
                "claim_unreadable",
                error=f"{type(exc).__name__}: {exc}",
                next_step="read the batch row by row and park the unreadable rows",
            )
        jobs, unreadable = await self.store.claim_isolated(conn, self.config.batch_size)
        await self.park_unreadable(conn, unreadable)
        return jobs

    def _account(
        self, jobs: list[ClaimedJob], result: PublishResult, lags: dict[int, float]
    ) -> None:
        for queue, count in Counter(job.queue for job in jobs).items():
            JOBS_CLAIMED.labels(queue).inc(count)
        for queue, count in Counter(job.queue for job in result.confirmed).items():
            JOBS_PUBLISHED.labels(queue).inc(count)
        for lag in lags.values():
            DISPATCH_LAG.observe(max(0.0, lag))
        if len(lags) != len(result.confirmed):
            missing = sorted({job.id for job in result.confirmed} - set(lags))
            self.log.error(
                "dispatch_mark_mismatch", missing=len(missing), job_ids=missing[:MAX_IDS_LOGGED]
            )
        if not result.failed:
            return
        PUBLISH_FAILURES.inc(len(result.failed))
        details = {f.job.id: f.detail for f in result.failed}
        for (reason, queue), ids in result.failures_by_reason().items():
            self.log.error(
                "publish_failed",
                reason=reason,
                queue=queue,
                count=len(ids),
                job_ids=ids[:MAX_IDS_LOGGED],
                detail=details[ids[0]],
                outcome="kept pending",
            )

    # -- wake-ups --------------------------------------------------------------------

    async def _ensure_listener(self) -> None:
        """Keep the LISTEN connection; while it is down the loop runs on probes."""
        if await self._wakeups.ensure():
            # a NOTIFY sent while we were not listening is lost: make this pass probe
            self._in_backlog = False

    async def _sample_backlog(self) -> None:
        now = time.monotonic()
        if now - self._backlog_sampled_at < self.config.backlog_interval:
            return
        self._backlog_sampled_at = now
        with contextlib.suppress(asyncpg.PostgresError, TimeoutError):
            BACKLOG.set(await self.store.backlog())
