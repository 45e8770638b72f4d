"""When a cron expression fires, in its time zone: the DST rules (DESIGN §5b).

Nothing here reads a clock or does I/O (beyond zoneinfo loading zone data): every
function takes its reference instant as an argument, takes aware datetimes and returns
UTC ones. The planner owns time.

Why the time-zone mapping is done here and not by croniter
---------------------------------------------------------
croniter 7 parses the expression (5 fields, or 6 with seconds first) and finds the next
matching *wall-clock* time; we only ever give it naive datetimes, where it is plain
calendar arithmetic with no DST. Turning wall times into instants is done here, because
the DST rules are our contract and croniter's own aware-datetime mode resolves them
relative to its start time (ambiguous times, shifted gap times), which is not ours.
Every expression follows one of two rules:

* **Fixed-hour expressions** (the hour field names hours: ``30 2 * * *``, ``0 1-3 * * *``,
  ``*/15 2 * * *``). Each matching wall time is a nominal fire time, mapped to ONE instant:
  a wall time that exists once fires then; one that happens twice (fall back) fires at
  its FIRST occurrence; one that does not exist (spring forward) fires at the first
  instant after the gap -- Berlin ``30 2 * * *`` on 2026-03-29 fires at 03:00 CEST.
  The mapping never decreases as wall time grows, so the first wall time after ``after``
  whose instant is later than ``after`` is the answer. Nominal times that map to the same
  instant (several in one gap, or a gap time and the wall time right after the gap)
  fire once: outputs are instants and strictly increase.
* **Hour-wildcard expressions** (an hour item starting with ``*`` -- ``*``, ``*/2`` -- or
  items covering all 24 hours: Vixie cron's definition). They fire at every real instant
  whose local wall clock matches: the repeated hour fires twice, times inside a gap do
  not exist and do not fire. So ``0 * * * *`` fires every 3600 s across both transitions
  (23 fires on the spring day, 25 on the fall day) and ``*/15 * * * * *`` every 15 real
  seconds. Time is walked in segments of constant UTC offset; inside one, wall time and
  UTC differ by a constant, so croniter's naive answer converts exactly. Where a shift is
  not a whole hour (Australia/Lord_Howe, 30 min) the wall clock still decides:
  ``0 * * * *`` fires 01:00 and then 03:00 on its spring day, 1.5 real hours apart.

zoneinfo publishes no transition table, so a transition is found by probing the UTC
offset every 6 hours and bisecting on whole seconds (TZif transitions are whole
seconds). This assumes a zone never changes its offset twice within 6 hours: true of
every zone in tzdata since 1970 (checked against tzdata 2026).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

from croniter import CroniterError, croniter

from scheduler.cron.expression import CronSpec, ScheduleSpecError

__all__ = ["as_utc", "fire_times_between", "iter_fire_times", "next_fire_after"]

_ONE_SECOND = timedelta(seconds=1)
_PROBE_STEP = timedelta(hours=6)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def next_fire_after(spec: CronSpec, after: datetime) -> datetime:
    """The first fire time strictly after ``after`` (aware), as an aware UTC datetime."""
    return _Firing(spec).next_after(as_utc(after, "after"))


def fire_times_between(
    spec: CronSpec, after: datetime, until: datetime, limit: int
) -> list[datetime]:
    """Fire times in ``(after, until]``, ascending, at most ``limit`` of them."""
    until = as_utc(until, "until")
    out: list[datetime] = []
    if limit <= 0:
        return out
    for instant in iter_fire_times(spec, after):
        if instant > until:
            break
        out.append(instant)
        if len(out) >= limit:
            break
    return out


def iter_fire_times(spec: CronSpec, after: datetime) -> Iterator[datetime]:
    """Endless ascending fire times strictly after ``after``; the caller stops it."""
    firing = _Firing(spec)
    instant = as_utc(after, "after")
    while True:
        instant = firing.next_after(instant)
        yield instant


class _Firing:
    """croniter over naive wall time plus the DST rules of the module docstring."""

    def __init__(self, spec: CronSpec) -> None:
        self._spec = spec
        self._zone = spec.zone
        self._walls = croniter(
            " ".join(spec.fields), datetime(2000, 1, 1), second_at_beginning=spec.has_seconds
        )

    def next_after(self, after: datetime) -> datetime:
        if self._spec.hour_wildcard:
            return self._next_real(after)
        return self._next_nominal(after)

    def _next_wall(self, wall: datetime) -> datetime:
        """First matching wall time strictly after naive ``wall`` (whole seconds matter)."""
        try:
            result: datetime = self._walls.get_next(
                datetime, start_time=wall.replace(microsecond=0)
            )
        except CroniterError as exc:
            raise ScheduleSpecError(
                f"cron expression {self._spec.expr!r} has no fire time after {wall}: {exc}"
            ) from None
        return result

    def _next_nominal(self, after: datetime) -> datetime:
        wall = after.astimezone(self._zone).replace(tzinfo=None)
        while True:
            wall = self._next_wall(wall)
            instant, repeat_end = _first_instant(self._zone, wall)
            if instant > after:
                return instant
            # Only an ambiguous wall time whose first occurrence is past gets here (``after``
            # lies in the repeated stretch): skip the rest of that stretch at once.
            if repeat_end is not None and repeat_end - _ONE_SECOND > wall:
                wall = repeat_end - _ONE_SECOND

    def _next_real(self, after: datetime) -> datetime:
        start = after.replace(microsecond=0) + _ONE_SECOND  # first whole second > after
        while True:
            offset = _offset(self._zone, start)
            wall = self._next_wall((start + offset).replace(tzinfo=None) - _ONE_SECOND)
            candidate = (wall - offset).replace(tzinfo=UTC)
            change = _first_change(self._zone, start, candidate, offset)
            if change is None:
                return candidate
            start = change  # the offset changed before the candidate: redo from there


def _first_instant(zone: ZoneInfo, wall: datetime) -> tuple[datetime, datetime | None]:
    """The instant nominal ``wall`` fires at under the fixed-hour rule and, when ``wall``
    is ambiguous, the wall time at which the repeated stretch ends."""
    first = wall.replace(tzinfo=zone).astimezone(UTC)  # fold=0: the earlier offset
    if first.astimezone(zone).replace(tzinfo=None) != wall:
        # In a gap. fold=1 reads it with the later offset, which lands before the
        # transition; the transition itself is the first instant after the gap.
        before = wall.replace(tzinfo=zone, fold=1).astimezone(UTC)
        change = _first_change(zone, before, first, _offset(zone, before))
        if change is None:  # pragma: no cover - zoneinfo guarantees a change here
            raise AssertionError(f"no transition around nonexistent {wall} in {zone}")
        return change, None
    second = wall.replace(tzinfo=zone, fold=1).astimezone(UTC)
    if second == first:
        return first, None
    old_offset = _offset(zone, first)
    change = _first_change(zone, first, second, old_offset)
    if change is None:  # pragma: no cover
        raise AssertionError(f"no transition around ambiguous {wall} in {zone}")
    return first, (change + old_offset).replace(tzinfo=None)


def _offset(zone: ZoneInfo, instant: datetime) -> timedelta:
    offset = instant.astimezone(zone).utcoffset()
    assert offset is not None
    return offset


def _first_change(
    zone: ZoneInfo, start: datetime, end: datetime, offset: timedelta
) -> datetime | None:
    """Earliest whole second in (start, end] whose UTC offset is not ``offset``, or None.

    ``start`` is a whole second with that offset. Probes every 6 h, then bisects.
    """
    good = start
    while good < end:
        probe = min(good + _PROBE_STEP, end)
        if _offset(zone, probe) != offset:
            lo, hi = (good - _EPOCH) // _ONE_SECOND, -((_EPOCH - probe) // _ONE_SECOND)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if _offset(zone, _EPOCH + mid * _ONE_SECOND) != offset:
                    hi = mid
                else:
                    lo = mid
            return _EPOCH + hi * _ONE_SECOND
        good = probe
    return None


def as_utc(value: datetime, name: str) -> datetime:
    """``value`` in UTC; a naive or non-datetime ``value`` is refused, naming ``name``.

    Every pure schedule function (here and in :mod:`scheduler.planning`) takes its
    instants through this, so a naive datetime never passes as UTC by accident.
    """
    if not isinstance(value, datetime):
        raise TypeError(f"{name} must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name} must be an aware datetime (e.g. in UTC), got naive {value!r}")
    return value.astimezone(UTC)
