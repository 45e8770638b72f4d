"""Cron, pure: what an expression means (:mod:`.expression`) and when it fires in its
time zone (:mod:`.dst`, the DST contract of DESIGN §5b).

Two modules because they change for different reasons: the parser follows croniter and
the error messages users read; the fire-time rules follow the DST contract and tzdata.
Callers import from here.
"""

from scheduler.cron.dst import as_utc, fire_times_between, iter_fire_times, next_fire_after
from scheduler.cron.expression import (
    ALIASES,
    CronSpec,
    ScheduleSpecError,
    did_you_mean,
    parse_cron,
)

__all__ = [
    "ALIASES",
    "CronSpec",
    "ScheduleSpecError",
    "as_utc",
    "did_you_mean",
    "fire_times_between",
    "iter_fire_times",
    "next_fire_after",
    "parse_cron",
]
