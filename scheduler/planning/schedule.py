"""A recurring schedule as a user asks for it (:class:`ScheduleSpec`) and as it is
stored (:class:`Schedule`, a row of ``duetime.schedules``; DESIGN §3 "Schedules").

The spec is validated here, before it reaches the database, so the CLI and API refuse
a bad cron, zone, interval or policy with a message naming it. Rows written by plain
SQL meet the table's CHECK constraints instead, which cannot parse a cron expression or
a zone: the planner pauses such a row with its error (:mod:`scheduler.planning.plan`).
The fields a schedule shares with a one-shot job (task, payload, queue, max_attempts)
are checked by the same functions as a job's (:mod:`scheduler.jobspec`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any

from scheduler.errors import DuetimeError, InvalidInput
from scheduler.jobspec import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_QUEUE,
    EARLIEST_DUE,
    LATEST_DUE,
    validate_max_attempts,
    validate_payload,
    validate_queue,
    validate_task,
)
from scheduler.planning.interval import format_duration, parse_interval
from scheduler.planning.misfire import DEFAULT_MISFIRE_CAP, MAX_MISFIRE_CAP, parse_misfire_policy
from scheduler.planning.timing import MIN_INTERVAL, Timing, cached_cron, timing_for

__all__ = [
    "MAX_JITTER",
    "MAX_NAME_LENGTH",
    "OVERLAP_POLICIES",
    "Schedule",
    "ScheduleNotFound",
    "ScheduleSpec",
    "parse_overlap_policy",
    "upcoming_fire_times",
]


class ScheduleNotFound(DuetimeError):
    """No schedule has this name or id (the CLI and dashboard say so, the API raises)."""

    def __init__(self, ref: str | int) -> None:
        super().__init__(f"schedule {ref!r} not found")
        self.ref = ref


OVERLAP_POLICIES = ("allow", "skip", "buffer_one")


def parse_overlap_policy(policy: str) -> str:
    name = policy.strip().lower().replace("-", "_") if isinstance(policy, str) else ""
    if name not in OVERLAP_POLICIES:
        raise InvalidInput(
            f"unknown overlap policy {policy!r}; accepted: {', '.join(OVERLAP_POLICIES)}"
        )
    return name


# --- what a user asks for ------------------------------------------------------------------


def _aware(value: datetime | None, name: str) -> datetime | None:
    if value is None:
        return None
    if not isinstance(value, datetime) or value.tzinfo is None:
        raise InvalidInput(f"{name} must be a timezone-aware datetime")
    if not EARLIEST_DUE <= value < LATEST_DUE:
        raise InvalidInput(f"{name} {value.isoformat()} is out of range (years 1970 to 9998)")
    return value


MAX_NAME_LENGTH = 200
#: The longest delay ``jitter`` may spread a schedule's fires over: one day.
MAX_JITTER = 86400.0


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
        validate_task(self.task)
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
            set_(self, "cron", cached_cron(self.cron, self.timezone).expr)
        set_(self, "timezone", cached_cron("* * * * *", self.timezone).tz)
        validate_payload(self.payload)
        validate_queue(self.queue)
        validate_max_attempts(self.max_attempts)
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
        return timing_for(self.cron, interval, self.timezone, self.start_at or anchor)


# --- a schedule as stored ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Schedule:
    """A row of ``duetime.schedules`` (the planner's private ``plan_at`` left out).

    Field names are the column names: :meth:`from_record` copies them one to one.
    """

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
    managed_by: str | None = None  # the declaration that owns it (schedules as code)

    @classmethod
    def from_record(cls, record: Any) -> Schedule:
        """From an asyncpg Record (or any mapping) of ``SELECT *, ... AS finished``."""
        optional = ("finished", "managed_by")
        values = {name: record[name] for name in cls.__slots__ if name not in optional}
        return cls(
            **values, finished=bool(record.get("finished")), managed_by=record.get("managed_by")
        )

    @property
    def anchor(self) -> datetime:
        """Origin of an interval schedule's fire times."""
        return self.start_at or self.created_at

    def timing(self) -> Timing:
        """The fire-time source; raises ``ScheduleSpecError`` for a bad cron, zone or
        interval (possible for rows written by plain SQL)."""
        return timing_for(self.cron, self.interval, self.timezone, self.anchor)

    @property
    def every(self) -> str:
        """The timing as a user reads it: the cron expression or ``every 30s``."""
        if self.cron is not None:
            return self.cron
        assert self.interval is not None
        return f"every {format_duration(self.interval)}"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, datetime):
                out[key] = value.isoformat()
            elif isinstance(value, timedelta):
                out[key] = format_duration(value)
        return out


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
