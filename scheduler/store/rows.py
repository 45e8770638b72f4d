"""Every typed row the stores return (never a raw asyncpg Record past a store).

Grouped by who reads them: jobs (producers, CLI, dashboard), the leader's dispatch path,
the worker's execution path, maintenance, ``duetime status`` and the dashboard. A row
type whose fields are the columns its statement returns is built with ``from_record``;
the others say how they are put together.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import date, datetime
from typing import Any, Literal, TypeVar

from scheduler.messages import effective_key
from scheduler.planning import Schedule

JobStatus = Literal["pending", "dispatched", "succeeded", "dead", "cancelled", "waiting"]
#: ``waiting`` (migration 0025): a job whose dependencies have not all ended yet
JOB_STATUSES: tuple[str, ...] = (
    "pending",
    "dispatched",
    "succeeded",
    "dead",
    "cancelled",
    "waiting",
)
TERMINAL_STATUSES: frozenset[str] = frozenset({"succeeded", "dead", "cancelled"})
#: What decoding a row can raise in the client (asyncpg's codecs, scheduler/db.py's jsonb
#: decoder) as opposed to the database refusing a statement: a date outside Python's
#: years 1-9999 (OverflowError), JSON nested deeper than its parser goes (RecursionError).
UNREADABLE: tuple[type[Exception], ...] = (OverflowError, RecursionError, ValueError)

T = TypeVar("T")


def from_record(cls: type[T], record: Any) -> T:
    """A ``cls`` (a slotted dataclass) from the same-named columns of ``record``. Fields
    are passed by position (``__slots__`` lists them in order): the claim builds 500 rows
    a batch, and this is quicker than keywords or a lookup per field written out."""
    return cls(*map(record.__getitem__, cls.__slots__))  # type: ignore[attr-defined]


# -- jobs --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Job:
    id: int
    task: str
    payload: dict[str, Any]
    queue: str
    due_at: datetime
    run_at: datetime | None
    status: str
    attempt: int
    max_attempts: int
    idempotency_key: str | None
    created_at: datetime
    dispatched_at: datetime | None
    heartbeat_at: datetime | None
    finished_at: datetime | None
    dispatch_epoch: int | None
    last_error: str | None
    schedule_id: int | None
    #: the role that inserted the row (migration 0005): scopes its idempotency key
    created_by: str | None
    #: the key this job holds in its queue while live (migration 0014), if any
    unique_key: str | None = None
    #: -100..100, higher first among the due jobs of its queue (migration 0015)
    priority: int = 0
    #: what per-key limits and fair queues count this job under (migration 0016), if any
    limit_key: str | None = None
    #: what the handler returned, once succeeded (migration 0019); None: nothing
    result: Any = None
    #: who cancelled the job (migration 0019)
    cancelled_by: str | None = None
    #: times a handler snoozed it, and the bound (migration 0019)
    snoozes: int = 0
    max_snoozes: int = 100
    #: the handler's time limit for this job, overriding the task's (migration 0019)
    timeout_s: float | None = None
    #: how far the handler got (0..1), its note, and when it said so (ctx.progress)
    progress: float | None = None
    progress_note: str | None = None
    progress_at: datetime | None = None
    #: what the job is about (migration 0022): ``JobFilter(tags=...)``
    tags: list[str] = field(default_factory=list)
    #: the producer's own data kept with the job (migration 0022)
    meta: dict[str, Any] = field(default_factory=dict)
    #: the ids of the jobs it waits for (migration 0025: workflows); None: none
    depends_on: list[int] | None = None
    #: ``cancel`` or ``run`` when a dependency ends dead or cancelled (migration 0025)
    on_dependency_failure: str = "cancel"
    #: the workflow it belongs to (migration 0025), if any
    workflow_id: int | None = None

    @property
    def effective_key(self) -> str:
        """The ledger key (``scheduler.messages.effective_key``)."""
        return effective_key(
            self.id,
            self.idempotency_key,
            schedule_id=self.schedule_id,
            created_by=self.created_by,
        )

    @property
    def next_run_at(self) -> datetime:
        return self.run_at or self.due_at

    @classmethod
    def from_record(cls, record: Any) -> Job:
        return from_record(cls, record)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, datetime):
                out[key] = value.isoformat()
        return out


@dataclass(frozen=True, slots=True)
class BulkPreview:
    """What a bulk action would touch: ``count`` jobs, none newer than ``up_to_id``.

    ``as_of`` is the database time of the preview. Together the three pin the set the
    confirmation may change: at most ``count`` jobs, ids up to ``up_to_id``, each at most
    once, and for a retry only jobs that were already dead at ``as_of``."""

    action: str
    count: int
    up_to_id: int
    as_of: datetime | None = None


# -- the leader: dispatch, reconcile, plan, fence ----------------------------------------


@dataclass(frozen=True, slots=True)
class ClaimedJob:
    """What the dispatcher needs to publish a job: the message is a pointer at the row
    (scheduler/messages.py), so neither the payload nor the idempotency key is read."""

    id: int
    task: str
    queue: str
    due_at: datetime
    attempt: int
    run_at: datetime | None = None

    @classmethod
    def from_record(cls, record: Any) -> ClaimedJob:
        return from_record(cls, record)


@dataclass(frozen=True, slots=True)
class StalledJob:
    """A dispatched job with no sign of life past the visibility timeout."""

    job: ClaimedJob
    silent_for: float  # seconds since dispatched_at / heartbeat_at
    dispatch_epoch: int | None
    republish_count: int = 0  # re-publishes since it was dispatched

    @classmethod
    def from_record(cls, record: Any) -> StalledJob:
        return cls(
            ClaimedJob.from_record(record),
            record["silent_for"],
            record["dispatch_epoch"],
            record["republish_count"],
        )


@dataclass(frozen=True, slots=True)
class UnreadableRow:
    """A claimed row the client could not decode, and why."""

    job_id: int
    error: str


@dataclass(frozen=True, slots=True)
class ParkedRow:
    """What ``DispatchStore.park_unreadable`` did with one unreadable row."""

    job_id: int
    parked: bool
    """Made ``dead``; False when the database refused the update (the row is left as it is)."""
    reason: str
    """The ``last_error`` written, or what was to be written and why it was refused."""


@dataclass(frozen=True, slots=True)
class ClaimedSchedule:
    """A schedule locked by the planner, with what the overlap policies need to know."""

    schedule: Schedule
    previous_active: bool


@dataclass(frozen=True, slots=True)
class FenceState:
    epoch: int
    leader_node: str | None
    elected_at: datetime | None
    renewed_at: datetime | None


@dataclass(frozen=True, slots=True)
class ExpiredBucket:
    """A bucket whose whole range is older than the retention."""

    day: date
    live: bool  # holds a pending or dispatched row (as of the unlocked look)


# -- the worker --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class JobRef:
    """Which attempt of which job a delivery is about (what the message points at)."""

    job_id: int
    due_at: datetime
    attempt: int


@dataclass(frozen=True, slots=True)
class LockedJob:
    """The job row as ``begin`` read it, after waiting for any in-flight claim."""

    status: str
    attempt: int
    max_attempts: int
    queue: str
    task: str
    payload: dict[str, Any]
    key: str  # the ledger key: duetime.effective_key() of the row (migration 0007)
    run_time: datetime  # coalesce(run_at, due_at): when this attempt was meant to run
    done: bool  # the ledger already holds the key: the effect was applied before
    epoch: int | None = None  # dispatch_epoch: the dispatch whose message may run it
    #: this read took the attempt's guard lock (True), another session holds it (False:
    #: a copy of an attempt running elsewhere), or no lock was tried (None: not the
    #: message's to run). Migration 0012; ``scheduler.store.execution_guard``.
    started: bool | None = None
    #: the job's own handler time limit (migration 0019); None: the task's
    timeout_s: float | None = None
    #: the enqueuing code's W3C traceparent and when the job was inserted (migration
    #: 0023; ``scheduler.tracing``)
    traceparent: str | None = None
    enqueued_at: datetime | None = None
    #: the outcomes of the jobs it depends on (migration 0025), a list of
    #: ``{id, task, status, result, error}``; None for a job without ``depends_on``
    dependencies: list[dict[str, Any]] | None = None


@dataclass(frozen=True, slots=True)
class Completion:
    """A successful attempt to settle in a batch (``complete``)."""

    ref: JobRef
    key: str
    task: str
    #: the handler's result as JSON text (``workers.results``); None stores nothing
    result: str | None = None


@dataclass(frozen=True, slots=True)
class Finish:
    """What ``finish`` found: ``settled`` (the row was this attempt's and is now
    succeeded) and ``recorded`` (this attempt inserted the ledger row)."""

    settled: bool
    recorded: bool


# -- duetime status ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FenceView:
    """The fence row with its ages (seconds, by the database clock)."""

    epoch: int
    leader_node: str | None
    elected_at: datetime | None
    renewed_at: datetime | None
    elected_age: float | None
    renewed_age: float | None

    @classmethod
    def from_record(cls, record: Any) -> FenceView:
        """The migration inserts the row; a missing one reads as "never fenced"."""
        if record is None:
            return cls(0, None, None, None, None, None)
        return from_record(cls, record)


@dataclass(frozen=True, slots=True)
class QueueStatus:
    queue: str
    pending: int = 0
    due_now: int = 0
    oldest_overdue: float | None = None  # seconds the oldest due pending job is late
    dispatched: int = 0
    dead_last_hour: int = 0
    unstarted: int = 0  # dispatched jobs no worker has shown a sign of life for
    oldest_unstarted: float | None = None  # seconds since the oldest of them was dispatched
    #: False: not in duetime.queues, so its pending jobs are held, never dispatched
    declared: bool = True
    #: paused by an operator (duetime queues pause): nothing new is dispatched
    paused: bool = False

    @property
    def held(self) -> int:
        """Due pending jobs the dispatcher holds back because the queue is undeclared."""
        return 0 if self.declared else self.due_now


@dataclass(frozen=True, slots=True)
class UnstartedJobs:
    """Dispatched jobs of one queue without a sign of life from a worker (``heartbeat_at``
    unset), and the seconds since the oldest of them was (last) dispatched."""

    queue: str
    count: int
    oldest_age: float | None


@dataclass(frozen=True, slots=True)
class HeldQueues:
    """Due pending jobs held because their queue is not declared (``DispatchStore.held``):
    the first few queue names with their counts, and the totals over every name."""

    queues: tuple[tuple[str, int], ...] = ()
    total_jobs: int = 0
    total_queues: int = 0


@dataclass(frozen=True, slots=True)
class UpcomingFire:
    name: str
    next_fire_at: datetime
    fires_in: float


@dataclass(frozen=True, slots=True)
class ScheduleSummary:
    total: int
    paused: int
    next_fire_at: datetime | None
    upcoming: tuple[UpcomingFire, ...] = ()


@dataclass(frozen=True, slots=True)
class DbSnapshot:
    db_now: datetime
    fence: FenceView
    queues: tuple[QueueStatus, ...]
    schedules: ScheduleSummary | None  # None: no duetime.schedules table (before 0002)
    #: jobs waiting for their dependencies (workflows, migration 0025); None before it
    waiting: int | None = None


# -- the dashboard -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MinuteSample:
    """Up to ``MINUTE_SAMPLE`` of one minute's latest completions."""

    minutes_ago: int
    sampled: int
    span: float  # seconds between the oldest and newest sampled completion
    lags: list[float]


@dataclass(frozen=True, slots=True)
class JobPage:
    jobs: list[Job]
    next_cursor: str | None


@dataclass(frozen=True, slots=True)
class WorkerSeen:
    worker: str
    completed: int
    last_seen: datetime
    age: float


@dataclass(frozen=True, slots=True)
class LedgerRow:
    idempotency_key: str
    job_id: int
    attempt: int
    task: str
    worker: str | None
    completed_at: datetime


@dataclass(frozen=True, slots=True)
class OverviewData:
    snapshot: DbSnapshot
    #: None: pending counts in ``snapshot`` are exact; else at least this many pending
    pending_at_least: int | None
    #: (queue, status) -> count for terminal states when exact; else queue is "*"
    terminal: dict[tuple[str, str], int]
    terminal_exact: bool
    oldest_overdue: Job | None
    oldest_late: float | None
    latest_dead: list[Job]
    minutes: list[MinuteSample]
    workers: list[WorkerSeen] = field(default_factory=list)

    @property
    def lag_samples(self) -> list[tuple[int, float]]:
        return [(m.minutes_ago, lag) for m in self.minutes for lag in m.lags]


@dataclass(frozen=True, slots=True)
class JobDetail:
    job: Job
    ledger: LedgerRow | None
    schedule_name: str | None
