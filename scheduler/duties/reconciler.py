"""The reconciler: re-publishes dispatched jobs that went silent (architecture.md §3).

A job is *stalled* when it is ``dispatched`` and its last sign of life
(``heartbeat_at``, else ``dispatched_at``) is older than ``visibility_timeout``. Each
pass, in one fenced transaction, it locks a batch of them ``FOR UPDATE SKIP LOCKED``,
re-publishes them (same ``message_id`` ``<job_id>:<attempt>``, confirmed), and for the
confirmed ones bumps ``dispatched_at`` (a new visibility window), clears
``heartbeat_at`` and sets ``dispatch_epoch`` to this term; each is counted
(``RECONCILED``) and logged with its id. Unconfirmed ones are simply looked at again
next pass.

Why a job can be stalled although the dispatcher commits only after the broker
confirmed: the message was dead-lettered after ``x-delivery-limit`` deliveries (workers
crashing on it), its queue was deleted or purged, the broker lost it, or a worker died
after taking it. A job that a worker is *executing* is not stalled, however long it
runs: the worker heartbeats it every ``visibility_timeout / 3``. Only a worker whose
event loop is blocked longer than the timeout lets a running job look stalled; the
re-published copy is then a duplicate delivery, which the ledger absorbs.

Trade-offs (documented, not hidden):

- **Long queue backlogs.** A message can legitimately wait in a queue longer than the
  visibility timeout when workers are behind. Re-publishing it is harmless for
  correctness (the worker reads the row and the ledger, and skips a finished job) but
  it *amplifies* the backlog: every timeout would add another copy of every waiting
  job. So before re-publishing, the reconciler asks RabbitMQ how many messages are
  ready in the job's queue; while that queue has a backlog its stalled jobs are
  deferred (logged, and the queue is skipped for one ``interval``), and they are
  re-published once the queue has drained. The cost: a job whose message really is
  gone, in a queue that never drains, waits until it does.
- **Dead-lettered messages.** A message dead-lettered by ``x-delivery-limit`` leaves the
  job ``dispatched``; re-publishing it is correct (the ledger makes it safe) and gives
  the job another ``delivery_limit`` deliveries. A job that kills every worker that
  touches it would cycle forever, one round per visibility timeout, so each re-publish
  is counted in the row (``republish_count``, reset when the dispatcher dispatches the
  job again, e.g. for a retry): from ``warn_after`` on it is logged, and a stalled job
  already re-published ``max_republishes`` times (a setting, default 10: about ten
  visibility timeouts and 10 × ``delivery_limit`` deliveries) goes ``dead`` with a
  ``last_error`` saying why. The count is in the row, so a new leader continues it.
  Deferral comes first: a job whose queue has a backlog is never given up on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import asyncpg

from scheduler.clock import SYSTEM_CLOCK, Clock
from scheduler.config import Settings
from scheduler.config.shards import DEFAULT_SHARD
from scheduler.duties.base import (
    MAX_IDS_LOGGED,
    GateConfig,
    park_unreadable,
    publishing_parts,
    some_ids,
)
from scheduler.duties.knobs import check_knobs, config_from_settings, knob
from scheduler.metrics import JOBS_PARKED, OLDEST_UNSTARTED, PUBLISH_FAILURES, RECONCILED
from scheduler.publisher import DEFAULT_PUBLISH_TIMEOUT, Publisher, publish_timeout_for
from scheduler.store.conn import Conn
from scheduler.store.rows import UNREADABLE, StalledJob
from scheduler.store.status import StatusStore

#: Seconds between samples of ``duetime_oldest_unstarted_seconds`` (one indexed query).
UNSTARTED_SAMPLE_INTERVAL = 5.0


@dataclass(frozen=True, slots=True)
class ReconcilerConfig:
    """How the reconciler paces itself (``config_from_settings`` fills it)."""

    visibility_timeout: float = knob(60.0, setting="visibility_timeout", gt=0)
    """Seconds a dispatched job may go without a sign of life before it is re-published."""
    interval: float = knob(5.0, setting="reconcile_interval", gt=0)
    """Seconds between passes (a full batch is followed by another pass at once)."""
    batch_size: int = knob(500, setting="claim_batch_size", ge=1)
    """Stalled jobs locked and re-published per transaction."""
    publish_timeout: float = knob(DEFAULT_PUBLISH_TIMEOUT, setting=publish_timeout_for, gt=0)
    """Deadline for one batch's confirms."""
    defer_backlogged_queues: bool = True
    """Skip queues that still hold ready messages (see the module doc)."""
    warn_after: int = knob(3, ge=1)
    """Log a warning when a job is re-published this many times since its dispatch."""
    max_republishes: int = knob(10, setting="max_republishes", ge=1)
    """A stalled job re-published this many times since its dispatch goes dead."""
    ready_timeout: float = knob(1.0, gt=0)
    """How long one pass waits for a reconnecting broker before backing off."""

    def __post_init__(self) -> None:
        check_knobs(self)


@dataclass(frozen=True, slots=True)
class ReconcileReport:
    stalled: int = 0
    republished: int = 0
    deferred: int = 0
    failed: int = 0
    given_up: int = 0  # re-published max_republishes times already: now dead


class Reconciler:
    name = "reconciler"

    def __init__(
        self,
        settings: Settings,
        pool: asyncpg.Pool,
        *,
        config: ReconcilerConfig | None = None,
        publisher: Publisher | None = None,
        clock: Clock = SYSTEM_CLOCK,
        is_leader: Callable[[], bool] | None = None,
        shard: str = DEFAULT_SHARD,
    ) -> None:
        self.config = config = config or config_from_settings(ReconcilerConfig, settings)
        self.shard = shard  # the database ``pool`` is: its messages and metrics name it
        self.clock = clock
        # a 0 sample from the start, so the first re-publish or failure shows as an increase
        RECONCILED.labels(shard)
        PUBLISH_FAILURES.labels(shard)
        self.loop, self.writes, self.out = publishing_parts(
            self,
            settings,
            pool,
            publish_timeout=config.publish_timeout,
            publisher=publisher,
            gate=GateConfig(config.ready_timeout, base=0.5, cap=config.interval),
            is_leader=is_leader,
            shard=shard,
        )
        self.store, self.publisher = self.out.store, self.out.publisher
        self._deferred_until: dict[str, float] = {}
        self._status = StatusStore(pool, acquire_timeout=settings.db_timeout)
        self._unstarted_sampled_at: float | None = None

    async def setup(self) -> None:
        await self.out.open()

    async def teardown(self) -> None:
        await self.out.close()

    async def run_once(self) -> float:
        delay = await self.out.gate.delay()
        if delay:
            return delay
        report = await self.reconcile_batch()
        await self.sample_unstarted()
        if report.stalled >= self.config.batch_size and (
            report.republished or report.deferred or report.given_up
        ):
            return 0.0
        return self.config.interval

    async def sample_unstarted(self) -> None:
        """Set ``duetime_oldest_unstarted_seconds`` (at most every
        ``UNSTARTED_SAMPLE_INTERVAL``): the jobs this duty would re-publish once silent for
        the visibility timeout, seen before they are, so an alert can fire while no worker
        consumes."""
        now = self.clock.monotonic()
        last = self._unstarted_sampled_at
        if last is not None and now - last < UNSTARTED_SAMPLE_INTERVAL:
            return
        self._unstarted_sampled_at = now
        ages = [u.oldest_age for u in await self._status.unstarted() if u.oldest_age is not None]
        OLDEST_UNSTARTED.labels(self.shard).set(max(ages, default=0.0))

    async def reconcile_batch(self) -> ReconcileReport:
        """One fenced transaction: lock stalled jobs, re-publish, start new windows."""
        epoch = self.loop.term.epoch
        now = self.clock.monotonic()
        skip = sorted(q for q, until in self._deferred_until.items() if until > now)
        async with self.writes.transaction(epoch) as conn:
            stalled = await self._lock_stalled(conn, skip)
            if not stalled:
                return ReconcileReport()
            due, deferred = await self._split_backlogged(stalled)
            exhausted = [s for s in due if s.republish_count >= self.config.max_republishes]
            due = [s for s in due if s.republish_count < self.config.max_republishes]
            given_up = await self.store.give_up(
                conn, [s.job for s in exhausted], self.give_up_error()
            )
            result = await self.publisher.publish([s.job for s in due], epoch)
            marked = await self.store.mark_redispatched(conn, result.confirmed, epoch)
        self._account(due, marked, result.failures_by_reason())
        self._account_given_up(exhausted, given_up)
        return ReconcileReport(
            len(stalled), len(marked), len(deferred), len(result.failed), len(given_up)
        )

    async def _lock_stalled(self, conn: Conn, skip: list[str]) -> list[StalledJob]:
        """The batch's stalled jobs; row by row, parking what cannot be read, if it must."""
        timeout, limit = self.config.visibility_timeout, self.config.batch_size
        try:
            return await self.store.lock_stalled(conn, timeout, limit, skip_queues=skip)
        except UNREADABLE as exc:
            self.loop.log.warning("lock_stalled_unreadable", error=f"{type(exc).__name__}: {exc}")
        stalled, unreadable = await self.store.lock_stalled_isolated(
            conn, timeout, limit, skip_queues=skip
        )
        await park_unreadable(
            self.store, conn, unreadable, duty=self.name, shard=self.shard, log=self.loop.log
        )
        return stalled

    def give_up_error(self) -> str:
        """The last_error of a job the reconciler gives up on."""
        return (
            f"re-published {self.config.max_republishes} times (max_republishes) and silent "
            f"again each time: its message is probably dead-lettered by every worker that "
            f"takes it (delivery_limit deliveries per publish); look at the dead-letter "
            f"queue, fix the cause, then `duetime jobs retry`"
        )

    async def _split_backlogged(
        self, stalled: list[StalledJob]
    ) -> tuple[list[StalledJob], list[StalledJob]]:
        if not self.config.defer_backlogged_queues:
            return stalled, []
        backlogged: dict[str, int] = {}
        for queue in sorted({s.job.queue for s in stalled}):
            ready = await self.publisher.ready_messages(queue)
            if ready:
                backlogged[queue] = ready
        if not backlogged:
            return stalled, []
        until = self.clock.monotonic() + self.config.interval
        due: list[StalledJob] = []
        deferred: list[StalledJob] = []
        for s in stalled:
            (deferred if s.job.queue in backlogged else due).append(s)
        for queue, ready in backlogged.items():
            self._deferred_until[queue] = until
            ids = [s.job.id for s in deferred if s.job.queue == queue]
            self.loop.log.info(
                "reconcile_deferred",
                queue=queue,
                ready_messages=ready,
                **some_ids(ids),
                reason="queue has a backlog; its messages are probably still waiting",
            )
        return due, deferred

    def _account(
        self,
        due: list[StalledJob],
        marked: set[int],
        failures: dict[tuple[str, str], list[int]],
    ) -> None:
        done = [s for s in due if s.job.id in marked]
        if done:
            RECONCILED.labels(self.shard).inc(len(done))
            repeats = [
                (s.job.id, s.republish_count + 1)
                for s in done
                if s.republish_count + 1 >= self.config.warn_after
            ]
            self.loop.log.warning(
                "jobs_reconciled",
                **some_ids([s.job.id for s in done]),
                oldest_silence=round(max(s.silent_for for s in done), 3),
                previous_epochs=sorted(
                    {s.dispatch_epoch for s in done if s.dispatch_epoch is not None}
                ),
            )
            if repeats:
                self.loop.log.warning(
                    "jobs_reconciled_repeatedly",
                    count=len(repeats),
                    jobs=repeats[:MAX_IDS_LOGGED],
                    hint="dead-lettered again and again? look at the dead-letter queue",
                    max_republishes=self.config.max_republishes,
                )
        for (reason, queue), ids in failures.items():
            PUBLISH_FAILURES.labels(self.shard).inc(len(ids))
            self.loop.log.error(
                "reconcile_publish_failed",
                reason=reason,
                queue=queue,
                **some_ids(ids),
                outcome="still dispatched; retried next pass",
            )

    def _account_given_up(self, exhausted: Sequence[StalledJob], given_up: set[int]) -> None:
        if not given_up:
            return
        JOBS_PARKED.labels(self.shard, "republish_cap").inc(len(given_up))
        ids = sorted(given_up)
        self.loop.log.error(
            "jobs_given_up",
            **some_ids(ids),
            tasks=sorted({s.job.task for s in exhausted if s.job.id in given_up}),
            max_republishes=self.config.max_republishes,
            outcome="dead",
        )
