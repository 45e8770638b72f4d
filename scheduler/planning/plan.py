"""The planner's decision for one schedule, pure (DESIGN §5b). No I/O and no clock:
``now`` is an argument, and the store applies the decision in one statement.

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

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from scheduler.cron import ScheduleSpecError
from scheduler.planning.jitter import deterministic_jitter
from scheduler.planning.misfire import misfire_plan
from scheduler.planning.schedule import Schedule
from scheduler.planning.timing import Timing

__all__ = ["Fire", "PlanConfig", "PlanDecision", "fire_key", "invalid_decision", "plan_schedule"]


def fire_key(schedule_id: int, fire_time: datetime) -> str:
    """The job's idempotency key, ``schedule:<id>:<fire time ISO UTC>`` (DESIGN §3)."""
    iso = fire_time.astimezone(UTC).replace(tzinfo=None).isoformat()
    return f"schedule:{schedule_id}:{iso}Z"


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
