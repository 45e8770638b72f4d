"""A schedule's fire-time source: its cron expression or its interval, one protocol.

The planner and the displays walk fire times without caring which kind a schedule has;
:func:`timing_for` builds the right one and refuses a schedule that has both or
neither, an interval under :data:`MIN_INTERVAL`, or an unknown zone.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import Protocol

from scheduler.cron import CronSpec, ScheduleSpecError, iter_fire_times, parse_cron
from scheduler.planning.interval import next_interval_fire

__all__ = ["MIN_INTERVAL", "CronTiming", "IntervalTiming", "Timing", "cached_cron", "timing_for"]

MIN_INTERVAL = timedelta(seconds=1)
_TINY = timedelta(microseconds=1)


class Timing(Protocol):
    """Where a schedule's fire times come from; equal timings enumerate equal times."""

    def iter_from(self, instant: datetime) -> Iterator[datetime]:
        """Fire times at or after ``instant``, ascending, endless."""


@lru_cache(maxsize=8192)
def cached_cron(expr: str, tz: str) -> CronSpec:
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


def timing_for(
    cron: str | None, interval: timedelta | None, timezone: str, anchor: datetime
) -> Timing:
    """The timing of a schedule with exactly one of ``cron`` and ``interval``; an
    interval counts from ``anchor``. Raises ``ScheduleSpecError`` when invalid."""
    if (cron is None) == (interval is None):
        raise ScheduleSpecError("a schedule needs exactly one of cron and interval")
    if cron is not None:
        return CronTiming(cached_cron(cron, timezone))
    assert interval is not None
    if interval < MIN_INTERVAL:
        raise ScheduleSpecError(f"interval {interval} is shorter than {MIN_INTERVAL}")
    cached_cron("* * * * *", timezone)  # validates the zone, which an interval shows times in
    return IntervalTiming(anchor.astimezone(UTC), interval)
