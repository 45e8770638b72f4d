"""Recurring schedules, pure: the model, its validation, and the planner's decision for
one schedule (DESIGN §3 "Schedules", §5b). No I/O and no clock: ``now`` is an argument.

The planner materializes *fire times* (nominal instants from the cron expression or the
interval) as jobs a short horizon ahead. :func:`plan_schedule` decides, for one schedule
at ``now``, which fire times become jobs in this pass, which were missed and what the
misfire and overlap policies make of them, and where the schedule stands afterwards::

    next_fire_at ──▶ fire times ≤ now + horizon (allow) or ≤ now (skip / buffer_one)
        │              ├─ earlier than now - misfire_grace: missed → misfire policy
        │              │     skip: none fire · fire_once: the last fires · fire_all: the last cap
        │              └─ on time: fire (overlap policy: skip / buffer while one runs)
        └──▶ new next_fire_at (first fire time not handled), plan_at (when to look again)

Why overlap policies plan "just in time": whether the previous run is still going can
only be known when the next fire time arrives, so a schedule with ``overlap_policy``
``skip`` or ``buffer_one`` is looked at exactly at its fire time (``plan_at =
next_fire_at``), while ``allow`` schedules are planned ``horizon`` ahead and revisited
when their next fire time is ``lead`` away, so their jobs exist before they are due
and a failover shorter than ``lead`` misses nothing.

Bounded work: a schedule that missed very many fire times (a long outage) is worked off
``max_catchup_scan`` fire times per pass, with exact counts; a fire time is never
skipped that the policy would have fired (see :func:`plan_schedule`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import Any, Protocol

from scheduler.cron import (
    CronSpec,
    ScheduleSpecError,
    deterministic_jitter,
    iter_fire_times,
    misfire_plan,
    next_interval_fire,
    parse_cron,
    parse_interval,
    parse_misfire_policy,
)
from scheduler.errors import DuetimeError, InvalidInput
from scheduler.jobspec import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_QUEUE,
    MAX_ATTEMPTS_LIMIT,
    MAX_TASK_LENGTH,
    validate_queue,
)

__all__ = [
    "DEFAULT_MISFIRE_CAP",
    "MAX_JITTER",
    "MAX_MISFIRE_CAP",
    "MIN_INTERVAL",
    "OVERLAP_POLICIES",
    "Fire",
    "PlanConfig",
    "PlanDecision",
    "Schedule",
    "ScheduleNotFound",
    "ScheduleSpec",
    "Timing",
    "fire_key",
    "invalid_decision",
    "parse_overlap_policy",
    "plan_schedule",
    "upcoming_fire_times",
]

OVERLAP_POLICIES = ("allow", "skip", "buffer_one")
DEFAULT_MISFIRE_CAP = 100
MAX_MISFIRE_CAP = 1000
MAX_JITTER = 86400.0
MAX_NAME_LENGTH = 200
MIN_INTERVAL = timedelta(seconds=1)
_TINY = timedelta(microseconds=1)


class ScheduleNotFound(DuetimeError):
    def __init__(self, ref: str | int) -> None:
        super().__init__(f"schedule {ref!r} not found")
        self.ref = ref


def parse_overlap_policy(policy: str) -> str:
    name = policy.strip().lower().replace("-", "_") if isinstance(policy, str) else ""
    if name not in OVERLAP_POLICIES:
        raise InvalidInput(
            f"unknown overlap policy {policy!r}; accepted: {', '.join(OVERLAP_POLICIES)}"
        )
    return name


def fire_key(schedule_id: int, fire_time: datetime) -> str:
    """The job's idempotency key, ``schedule:<id>:<fire time ISO UTC>`` (DESIGN §3)."""
    iso = fire_time.astimezone(UTC).replace(tzinfo=None).isoformat()
    return f"schedule:{schedule_id}:{iso}Z"


# --- timing: cron or interval ------------------------------------------------------------


class Timing(Protocol):
    def iter_from(self, instant: datetime) -> Iterator[datetime]:
        """Fire times at or after ``instant``, ascending, endless."""


@lru_cache(maxsize=8192)
def _cron(expr: str, tz: str) -> CronSpec:
    """parse_cron, cached: the planner sees the same few expressions again and again."""
    return parse_cron(expr, tz)


@dataclass(frozen=True, slots=True)
class CronTiming:
    spec: CronSpec

    def iter_from(self, instant: datetime) -> Iterator[datetime]:
        return iter_fire_times(self.spec, instant - _TINY)


@dataclass(frozen=True, slots=True)
class IntervalTiming:
    """``anchor + k * every``: elapsed time, blind to DST (a cron expression is not)."""

    anchor: datetime
    every: timedelta

    def iter_from(self, instant: datetime) -> Iterator[datetime]:
        current = next_interval_fire(self.anchor, self.every, instant - _TINY)
        while True:
            yield current
            current += self.every


def _timing(
    cron: str | None, interval: timedelta | None, timezone: str, anchor: datetime
) -> Timing:
    if (cron is None) == (interval is None):
        raise ScheduleSpecError("a schedule needs exactly one of cron and interval")
    if cron is not None:
        return CronTiming(_cron(cron, timezone))
    assert interval is not None
    if interval < MIN_INTERVAL:
        raise ScheduleSpecError(f"interval {interval} is shorter than {MIN_INTERVAL}")
    _cron("* * * * *", timezone)  # validates the zone, which an interval shows times in
    return IntervalTiming(anchor.astimezone(UTC), interval)


# --- what a user asks for ------------------------------------------------------------------


def _aware(value: datetime | None, name: str) -> datetime | None:
    if value is None:
        return None
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise InvalidInput(f"{name} must be a timezone-aware datetime")
    if not datetime(1970, 1, 1, tzinfo=UTC) <= value < datetime(9999, 1, 1, tzinfo=UTC):
        raise InvalidInput(f"{name} {value.isoformat()} is out of range (years 1970 to 9998)")
    return value


@dataclass(frozen=True, slots=True)
class ScheduleSpec:
    """A schedule as a user asks for it, validated before it reaches the database (the
    CLI and API refuse a bad cron, zone or interval with a message naming it)."""

    name: str
    task: str
    cron: str | None = None
    interval: timedelta | str | None = None
    timezone: str = "UTC"
    payload: dict[str, Any] = field(default_factory=dict)
    queue: str = DEFAULT_QUEUE
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    start_at: datetime | None = None
    end_at: datetime | None = None
    paused: bool = False
    misfire_policy: str = "skip"
    misfire_cap: int = DEFAULT_MISFIRE_CAP
    overlap_policy: str = "allow"
    jitter: float = 0.0

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalize in place once
        if not isinstance(self.name, str) or not self.name.strip():
            raise InvalidInput("schedule name must be a non-empty string")
        if len(self.name) > MAX_NAME_LENGTH:
            raise InvalidInput(f"schedule name is longer than {MAX_NAME_LENGTH} characters")
        if not isinstance(self.task, str) or not self.task.strip():
            raise InvalidInput("task name must be a non-empty string")
        if len(self.task) > MAX_TASK_LENGTH:
            raise InvalidInput(f"task name is longer than {MAX_TASK_LENGTH} characters")
        if (self.cron is None) == (self.interval is None):
            raise InvalidInput("give exactly one of a cron expression and an interval")
        if isinstance(self.interval, str):
            set_(self, "interval", parse_interval(self.interval))
        if self.interval is not None:
            if not isinstance(self.interval, timedelta):
                raise InvalidInput("interval must be a duration such as '30s'")
            if self.interval < MIN_INTERVAL:
                raise InvalidInput(
                    f"interval {self.interval.total_seconds():g}s is shorter than 1 second, "
                    "the finest a schedule fires"
                )
        if self.cron is not None:
            set_(self, "cron", _cron(self.cron, self.timezone).expr)
        set_(self, "timezone", _cron("* * * * *", self.timezone).tz)
        if not isinstance(self.payload, dict):
            raise InvalidInput(
                f"payload must be a JSON object (a dict), not {type(self.payload).__name__}"
            )
        validate_queue(self.queue)
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int):
            raise InvalidInput("max_attempts must be an integer")
        if not 1 <= self.max_attempts <= MAX_ATTEMPTS_LIMIT:
            raise InvalidInput(f"max_attempts must be between 1 and {MAX_ATTEMPTS_LIMIT}")
        _aware(self.start_at, "start_at")
        _aware(self.end_at, "end_at")
        if self.start_at and self.end_at and self.start_at >= self.end_at:
            raise InvalidInput("start_at must be earlier than end_at")
        set_(self, "misfire_policy", parse_misfire_policy(self.misfire_policy))
        if isinstance(self.misfire_cap, bool) or not isinstance(self.misfire_cap, int):
            raise InvalidInput("misfire_cap must be an integer")
        if not 1 <= self.misfire_cap <= MAX_MISFIRE_CAP:
            raise InvalidInput(f"misfire_cap must be between 1 and {MAX_MISFIRE_CAP}")
        set_(self, "overlap_policy", parse_overlap_policy(self.overlap_policy))
        if isinstance(self.jitter, bool) or not isinstance(self.jitter, int | float):
            raise InvalidInput("jitter must be a number of seconds")
        if not (math.isfinite(self.jitter) and 0 <= self.jitter <= MAX_JITTER):
            raise InvalidInput(f"jitter must be between 0 and {MAX_JITTER:g} seconds")
        set_(self, "jitter", float(self.jitter))

    def timing(self, anchor: datetime) -> Timing:
        """``anchor`` is the interval's origin when there is no ``start_at`` (now, for
        a schedule about to be created: the database uses its ``created_at``)."""
        interval = self.interval if isinstance(self.interval, timedelta) else None
        return _timing(self.cron, interval, self.timezone, self.start_at or anchor)


# --- a schedule as stored ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Schedule:
    """A row of ``duetime.schedules`` (the planner's private ``plan_at`` left out)."""

    id: int
    name: str
    task: str
    payload: dict[str, Any]
    queue: str
    max_attempts: int
    cron: str | None
    interval: timedelta | None
    timezone: str
    start_at: datetime | None
    end_at: datetime | None
    paused: bool
    misfire_policy: str
    misfire_cap: int
    overlap_policy: str
    jitter: float
    next_fire_at: datetime | None
    buffered_fire_at: datetime | None
    last_fired_at: datetime | None
    last_job_id: int | None
    fired_count: int
    skipped_count: int
    missed_count: int
    last_error: str | None
    created_at: datetime
    updated_at: datetime
    finished: bool = False  # no fire time left before end_at

    @classmethod
    def from_record(cls, record: Any) -> Schedule:
        """From an asyncpg Record (or any mapping) of ``SELECT *, ... AS finished``."""
        values = {name: record[name] for name in cls.__slots__ if name != "finished"}
        return cls(**values, finished=bool(record.get("finished")))

    @property
    def anchor(self) -> datetime:
        """Origin of an interval schedule's fire times."""
        return self.start_at or self.created_at

    def timing(self) -> Timing:
        """The fire-time source; raises ``ScheduleSpecError`` for a bad cron, zone or
        interval (possible for rows written by plain SQL)."""
        return _timing(self.cron, self.interval, self.timezone, self.anchor)

    @property
    def every(self) -> str:
        """The timing as a user reads it: the cron expression or ``every 30s``."""
        if self.cron is not None:
            return self.cron
        assert self.interval is not None
        return f"every {_format_duration(self.interval)}"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, datetime):
                out[key] = value.isoformat()
            elif isinstance(value, timedelta):
                out[key] = _format_duration(value)
        return out


def _format_duration(value: timedelta) -> str:
    micros = value // timedelta(microseconds=1)
    parts = []
    for unit, size in (("d", 86_400_000_000), ("h", 3_600_000_000), ("m", 60_000_000)):
        if micros >= size:
            parts.append(f"{micros // size}{unit}")
            micros %= size
    if micros or not parts:
        seconds = micros / 1_000_000
        parts.append(f"{seconds:g}s")
    return "".join(parts)


def upcoming_fire_times(schedule: Schedule, now: datetime, count: int) -> list[datetime]:
    """The next ``count`` fire times at or after ``now`` (within start/end), for display."""
    start = max(now, schedule.start_at) if schedule.start_at else now
    out: list[datetime] = []
    for instant in schedule.timing().iter_from(start):
        if schedule.end_at is not None and instant > schedule.end_at:
            break
        out.append(instant)
        if len(out) >= count:
            break
    return out


# --- the planning decision -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlanConfig:
    """How far ahead and how much per pass the planner works."""

    horizon: timedelta = timedelta(seconds=10)
    """``allow`` schedules: fire times up to now + horizon become jobs."""
    lead: timedelta | None = None
    """Revisit an ``allow`` schedule when its next fire time is this close (default
    horizon / 2): its jobs always exist at least ``lead`` before they are due."""
    misfire_grace: timedelta = timedelta(seconds=1)
    """A fire time at most this late is fired normally, not counted as missed."""
    buffer_poll: timedelta = timedelta(seconds=1)
    """``buffer_one``: how often a waiting fire time checks whether the run finished."""
    max_catchup_scan: int = 1000
    """Missed fire times worked off per schedule per pass (a long outage takes several)."""
    max_fires_per_pass: int = 1000
    """On-time fire times materialized per schedule per pass."""

    def __post_init__(self) -> None:
        if self.horizon < timedelta(0):
            raise ValueError("horizon must be >= 0")
        lead = self.lead if self.lead is not None else self.horizon / 2
        if not timedelta(0) <= lead <= self.horizon:
            raise ValueError("lead must be between 0 and horizon")
        object.__setattr__(self, "lead", lead)
        if self.misfire_grace < timedelta(0) or self.buffer_poll <= timedelta(0):
            raise ValueError("misfire_grace must be >= 0 and buffer_poll > 0")
        if self.max_catchup_scan < 1 or self.max_fires_per_pass < 1:
            raise ValueError("max_catchup_scan and max_fires_per_pass must be >= 1")


@dataclass(frozen=True, slots=True)
class Fire:
    """One fire time to materialize as a job."""

    fire_time: datetime
    due_at: datetime  # fire_time + deterministic jitter
    key: str  # the job's idempotency key


@dataclass(frozen=True, slots=True)
class PlanDecision:
    """What one pass does to one schedule; the store applies it in one statement."""

    schedule_id: int
    fires: tuple[Fire, ...] = ()
    next_fire_at: datetime | None = None  # None: no fire time left (or invalid: unchanged)
    plan_at: datetime | None = None  # None: never again (finished)
    buffered_fire_at: datetime | None = None
    missed: int = 0  # fire times found late this pass
    skipped_misfire: int = 0  # ... of which the misfire policy fired none
    skipped_overlap: int = 0  # on time, but the previous run had not finished
    error: str | None = None  # set: the schedule is paused with this last_error
    first_missed: datetime | None = None
    last_missed: datetime | None = None

    @property
    def skipped(self) -> int:
        return self.skipped_misfire + self.skipped_overlap

    @property
    def invalid(self) -> bool:
        return self.error is not None


def invalid_decision(schedule: Schedule, error: str) -> PlanDecision:
    """Pause the schedule with ``error``; leave its planning state as it was."""
    return PlanDecision(
        schedule.id,
        next_fire_at=schedule.next_fire_at,
        buffered_fire_at=schedule.buffered_fire_at,
        error=error,
    )


def plan_schedule(
    schedule: Schedule,
    now: datetime,
    config: PlanConfig = PlanConfig(),
    *,
    previous_active: bool = False,
    memo: dict[tuple[Any, ...], _Scan] | None = None,
) -> PlanDecision:
    """Decide one planner pass for ``schedule`` at ``now``.

    ``previous_active``: the schedule's last materialized job is not terminal yet (only
    read for ``overlap_policy`` ``skip`` / ``buffer_one``). A bad cron, zone or interval
    yields a decision with ``error`` set (the store pauses the schedule), never raises.

    ``memo``: pass one dict for a whole batch. Schedules with the same timing and the same
    next fire time (common: thousands of ``0 * * * *``) share one enumeration of their fire
    times, which is most of the cost of a decision.

    Long outages: the missed fire times are enumerated ``max_catchup_scan`` at a time.
    While at least ``keep`` more (1, or the cap for ``fire_all``) follow a chunk, none
    of the chunk can be among the ones the policy fires (always the most recent), so
    the chunk is counted as skipped and the schedule is revisited at once.
    """
    try:
        timing = schedule.timing()
        return _plan(schedule, timing, now, config, previous_active, memo)
    except ScheduleSpecError as exc:
        return invalid_decision(schedule, str(exc))


@dataclass(frozen=True, slots=True)
class _Scan:
    """The fire times of one pass, classified (shared by schedules with the same key)."""

    missed: tuple[datetime, ...]  # earlier than now - misfire_grace
    on_time: tuple[datetime, ...]
    following: datetime | None  # first fire time not handled in this pass
    revisit: bool  # stopped at max_fires_per_pass: look again at once
    chunked: bool  # stopped at max_catchup_scan + keep missed times


def _scan(
    timing: Timing,
    cursor: datetime,
    until: datetime,
    late_before: datetime,
    end_at: datetime | None,
    stop_missed: int,
    max_on_time: int,
) -> _Scan:
    missed: list[datetime] = []
    on_time: list[datetime] = []
    for instant in timing.iter_from(cursor):
        if end_at is not None and instant > end_at:
            break
        if instant > until:
            return _Scan(tuple(missed), tuple(on_time), instant, False, False)
        if instant < late_before:
            missed.append(instant)
            if len(missed) >= stop_missed:
                return _Scan(tuple(missed), (), None, False, True)
            continue
        if len(on_time) >= max_on_time:
            return _Scan(tuple(missed), tuple(on_time), instant, True, False)
        on_time.append(instant)
    return _Scan(tuple(missed), tuple(on_time), None, False, False)


def _plan(
    s: Schedule,
    timing: Timing,
    now: datetime,
    config: PlanConfig,
    previous_active: bool,
    memo: dict[tuple[Any, ...], _Scan] | None,
) -> PlanDecision:
    ahead = s.overlap_policy == "allow"
    until = now + config.horizon if ahead else now
    late_before = now - config.misfire_grace
    if s.next_fire_at is None:  # new, resumed or re-timed: start from now, nothing missed
        cursor = now
    else:
        cursor = s.next_fire_at
    if s.start_at is not None and cursor < s.start_at:
        cursor = s.start_at
    keep = s.misfire_cap if s.misfire_policy == "fire_all" else 1
    key = (
        timing, cursor, until, late_before, s.end_at, config.max_catchup_scan + keep,
        config.max_fires_per_pass,
    )  # fmt: skip
    scan = memo.get(key) if memo is not None else None
    if scan is None:
        scan = _scan(*key)
        if memo is not None:
            memo[key] = scan
    if scan.chunked:
        return _catchup_chunk(s, list(scan.missed), config.max_catchup_scan, now)
    missed, on_time = list(scan.missed), list(scan.on_time)
    following, revisit = scan.following, scan.revisit

    plan = misfire_plan(s.misfire_policy, missed, s.misfire_cap)
    candidates = [*plan.fire, *on_time]
    fire_times: list[datetime] = []
    buffered = s.buffered_fire_at
    skipped_overlap = 0
    if ahead:
        fire_times = candidates
    else:
        active = previous_active
        if buffered is not None and not active:
            fire_times.append(buffered)
            buffered, active = None, True
        for instant in candidates:
            if not active:
                fire_times.append(instant)
                active = True
            elif s.overlap_policy == "buffer_one" and buffered is None:
                buffered = instant
            else:
                skipped_overlap += 1

    if revisit:
        plan_at: datetime | None = now
    elif following is None:
        plan_at = None
    elif ahead:
        assert config.lead is not None
        plan_at = following - config.lead
    else:
        plan_at = following
    if buffered is not None:
        poll = now + config.buffer_poll
        plan_at = poll if plan_at is None else min(plan_at, poll)
    return PlanDecision(
        s.id,
        fires=tuple(_fire(s, instant) for instant in fire_times),
        next_fire_at=following,
        plan_at=plan_at,
        buffered_fire_at=buffered,
        missed=len(missed),
        skipped_misfire=plan.skipped,
        skipped_overlap=skipped_overlap,
        first_missed=missed[0] if missed else None,
        last_missed=missed[-1] if missed else None,
    )


def _catchup_chunk(s: Schedule, missed: list[datetime], chunk: int, now: datetime) -> PlanDecision:
    return PlanDecision(
        s.id,
        next_fire_at=missed[chunk],
        plan_at=now,
        buffered_fire_at=s.buffered_fire_at,
        missed=chunk,
        skipped_misfire=chunk,
        first_missed=missed[0],
        last_missed=missed[chunk - 1],
    )


def _fire(s: Schedule, instant: datetime) -> Fire:
    due = instant + deterministic_jitter(str(s.id), instant, s.jitter) if s.jitter else instant
    return Fire(instant, due, fire_key(s.id, instant))
