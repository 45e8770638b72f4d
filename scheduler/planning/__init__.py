"""Fire planning, pure: turning a schedule into the jobs of one planner pass.

No I/O and no clock (``now`` is an argument); the planner duty
(:mod:`scheduler.duties.planner`) reads the schedules and applies the decisions through
the store. One module per concern, so each can be read and tested alone:

- :mod:`.schedule` -- the schedule as asked for (``ScheduleSpec``, validated) and stored
  (``Schedule``);
- :mod:`.timing` -- its fire-time source, cron (:mod:`scheduler.cron`) or interval;
- :mod:`.interval` -- interval periods and their drift-free fire times;
- :mod:`.misfire` -- what the misfire policies do with missed fire times;
- :mod:`.jitter` -- the deterministic delay spreading a schedule's fires;
- :mod:`.plan` -- the decision for one schedule in one pass (``plan_schedule``).

Callers import from here.
"""

from scheduler.planning.interval import format_duration, next_interval_fire, parse_interval
from scheduler.planning.jitter import deterministic_jitter
from scheduler.planning.misfire import (
    DEFAULT_MISFIRE_CAP,
    MAX_MISFIRE_CAP,
    MISFIRE_POLICIES,
    MisfirePlan,
    misfire_plan,
    parse_misfire_policy,
)
from scheduler.planning.plan import (
    Fire,
    PlanConfig,
    PlanDecision,
    fire_key,
    invalid_decision,
    plan_schedule,
)
from scheduler.planning.schedule import (
    MAX_JITTER,
    MAX_NAME_LENGTH,
    OVERLAP_POLICIES,
    Schedule,
    ScheduleNotFound,
    ScheduleSpec,
    parse_overlap_policy,
    upcoming_fire_times,
)
from scheduler.planning.timing import (
    MIN_INTERVAL,
    CronTiming,
    IntervalTiming,
    Timing,
)

__all__ = [
    "DEFAULT_MISFIRE_CAP",
    "MAX_JITTER",
    "MAX_MISFIRE_CAP",
    "MAX_NAME_LENGTH",
    "MIN_INTERVAL",
    "MISFIRE_POLICIES",
    "OVERLAP_POLICIES",
    "CronTiming",
    "Fire",
    "IntervalTiming",
    "MisfirePlan",
    "PlanConfig",
    "PlanDecision",
    "Schedule",
    "ScheduleNotFound",
    "ScheduleSpec",
    "Timing",
    "deterministic_jitter",
    "fire_key",
    "format_duration",
    "invalid_decision",
    "misfire_plan",
    "next_interval_fire",
    "parse_interval",
    "parse_misfire_policy",
    "parse_overlap_policy",
    "plan_schedule",
    "upcoming_fire_times",
]
