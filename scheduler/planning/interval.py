"""Interval schedules: the period a user writes, and the fire times it gives.

An interval is elapsed time, blind to DST ('1d' is always 86 400 s; a cron expression is
the way to say a wall-clock time). Periods are parsed to exact microseconds and fire
times are ``anchor + k * every`` in integer arithmetic, so a schedule never drifts
however long it runs. :func:`format_duration` writes a period back the way the CLI and
dashboard show it.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from decimal import Decimal, InvalidOperation

from scheduler.cron import ScheduleSpecError, as_utc

__all__ = ["format_duration", "next_interval_fire", "parse_interval"]

_UNIT_SECONDS = {
    unit: Decimal(seconds)
    for unit, seconds in (("w", 604800), ("d", 86400), ("h", 3600), ("m", 60), ("s", 1))
} | {"ms": Decimal("0.001")}
_UNIT_ORDER = ("w", "d", "h", "m", "s", "ms")
_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"
_COMPACT_RE = re.compile(rf"^(?:\s*{_NUMBER}\s*(?:ms|[wdhms])\s*)+$")
_COMPACT_PART_RE = re.compile(rf"({_NUMBER})\s*(ms|[wdhms])")
_ISO_RE = re.compile(
    rf"^P(?:(?P<w>{_NUMBER})W)?(?:(?P<d>{_NUMBER})D)?"
    rf"(?:T(?:(?P<h>{_NUMBER})H)?(?:(?P<m>{_NUMBER})M)?(?:(?P<s>{_NUMBER})S)?)?$"
)
_INTERVAL_HELP = (
    "expected a positive duration such as '30s', '5m', '1h30m', '2d', '1.5s', '250ms' "
    "(units w d h m s ms, largest first) or ISO 8601 like 'PT30S', 'P1DT12H'"
)


def parse_interval(text: str) -> timedelta:
    """Parse an interval schedule's period. Intervals are elapsed time, blind to DST:
    '1d' is always 86 400 s (use cron ``0 9 * * *`` for a wall-clock daily time)."""
    if not isinstance(text, str):
        raise ScheduleSpecError(f"interval must be a string, got {type(text).__name__}")
    raw = text.strip()
    parts: list[tuple[str, str]]
    if raw[:1].upper() == "P":
        iso = _ISO_RE.match(raw.upper().replace(",", "."))
        if iso is None or raw.upper().endswith("T") or not any(iso.groupdict().values()):
            no_fixed_length = re.search(r"\dY|P[^T]*\dM", raw.upper())
            hint = "; years and months have no fixed length" if no_fixed_length else ""
            raise ScheduleSpecError(f"invalid interval {text!r}{hint}; {_INTERVAL_HELP}")
        parts = [(v, k) for k, v in iso.groupdict().items() if v is not None]
    else:
        lowered = raw.lower()
        if not _COMPACT_RE.match(lowered):
            hint = "; add a unit, e.g. '30s'" if re.fullmatch(_NUMBER, lowered) else ""
            raise ScheduleSpecError(f"invalid interval {text!r}{hint}; {_INTERVAL_HELP}")
        parts = _COMPACT_PART_RE.findall(lowered)
        units = [unit for _, unit in parts]
        if units != sorted(set(units), key=_UNIT_ORDER.index):
            raise ScheduleSpecError(
                f"invalid interval {text!r}: give each unit once, largest first; {_INTERVAL_HELP}"
            )
    try:
        seconds = sum((Decimal(number) * _UNIT_SECONDS[unit] for number, unit in parts), Decimal())
        period = timedelta(microseconds=int((seconds * 1_000_000).to_integral_value()))
    except (InvalidOperation, OverflowError):
        raise ScheduleSpecError(f"interval {text!r} is too large; {_INTERVAL_HELP}") from None
    if period <= timedelta(0):
        raise ScheduleSpecError(f"interval {text!r} must be positive (at least 1µs)")
    return period


def next_interval_fire(anchor: datetime, every: timedelta, after: datetime) -> datetime:
    """The smallest ``anchor + k*every`` (k >= 0) strictly after ``after``, in UTC.

    Exact integer arithmetic on microseconds, so a schedule never drifts.
    """
    anchor, after = as_utc(anchor, "anchor"), as_utc(after, "after")
    if every <= timedelta(0):
        raise ScheduleSpecError(f"interval must be positive, got {every}")
    if after < anchor:
        return anchor
    return anchor + ((after - anchor) // every + 1) * every


def format_duration(value: timedelta) -> str:
    """``5400 s`` -> ``1h30m``: whole days, hours and minutes, then seconds."""
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
