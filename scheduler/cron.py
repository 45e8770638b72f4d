"""Pure cron and interval arithmetic for recurring schedules (DESIGN §5b).

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
every zone in tzdata since 1970 (checked against tzdata 2026). Day-of-month and
day-of-week combine with OR when both are restricted (croniter's default, as in Vixie cron).
"""

from __future__ import annotations

import difflib
import hashlib
import itertools
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation
from functools import lru_cache
from typing import NamedTuple
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

from croniter import CroniterError, croniter

from scheduler.errors import InvalidInput

__all__ = [
    "ALIASES",
    "MISFIRE_POLICIES",
    "CronSpec",
    "MisfirePlan",
    "ScheduleSpecError",
    "deterministic_jitter",
    "fire_times_between",
    "iter_fire_times",
    "misfire_plan",
    "next_fire_after",
    "next_interval_fire",
    "parse_cron",
    "parse_interval",
    "parse_misfire_policy",
]


class ScheduleSpecError(InvalidInput, ValueError):
    """A cron expression, time zone, interval or misfire policy is invalid.

    The message says what is wrong and what is accepted. It is an ``InvalidInput`` (the
    CLI reports it as bad input) and a ``ValueError`` (plain Python callers).
    """


ALIASES: dict[str, str] = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
_ACCEPTED = (
    "expected 5 fields 'minute hour day-of-month month day-of-week', "
    "6 fields with seconds first 'second minute hour day-of-month month day-of-week', "
    "or an alias: " + ", ".join(ALIASES)
)


@dataclass(frozen=True)
class _Field:
    name: str
    low: int
    high: int
    names: tuple[str, ...] = ()  # names[i] means low + i
    wraps: bool = False  # ranges may wrap around (fri-mon, nov-feb)
    extra: str = ""  # special forms this field also takes

    def help(self) -> str:
        names = f" or {self.names[0]}-{self.names[-1]}" if self.names else ""
        return (
            f"expected {self.low}-{self.high}{names}: a value, a range like 1-5, a step "
            f"like */15 or 10-40/10, or a list like 1,2,5{self.extra}"
        )


_F_SECOND = _Field("second", 0, 59)
_F_MINUTE = _Field("minute", 0, 59)
_F_HOUR = _Field("hour", 0, 23)
_F_DOM = _Field(
    "day-of-month", 1, 31, extra="; also ? or L (last day) or 15W (weekday nearest the 15th)"
)
_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_F_MONTH = _Field("month", 1, 12, _MONTHS, wraps=True)
_DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
_F_DOW = _Field(
    "day-of-week",
    0,
    7,
    _DAYS,
    wraps=True,
    extra="; 0 and 7 are Sunday; also ?, 5#3 (3rd Friday), L5 (last Friday)",
)
_FIVE = (_F_MINUTE, _F_HOUR, _F_DOM, _F_MONTH, _F_DOW)
_SIX = (_F_SECOND, *_FIVE)

_TOKEN_RE = re.compile(r"^(?:\*|(?P<lo>[a-z0-9]+)(?:-(?P<hi>[a-z0-9]+))?)(?:/(?P<step>\d+))?$")
_HASHED_RE = re.compile(r"^[hr](?:\(|/|$)")  # croniter's H / R extensions
_DOM_SPECIAL_RE = re.compile(r"^(?:l|\d{1,2}w|w\d{1,2})$")  # last day, nearest weekday
_DOW_SPECIAL_RE = re.compile(r"^(?:(?:[0-7]|[a-z]{3})#[1-5]|l[0-7])$")  # 5#3, fri#3, l5


@dataclass(frozen=True)
class CronSpec:
    """A validated cron schedule; build it with :func:`parse_cron`."""

    expr: str  # as given, whitespace normalized (aliases lower-cased)
    tz: str  # IANA zone key
    has_seconds: bool  # 6 fields, seconds first
    fields: tuple[str, ...] = field(repr=False, compare=False)  # aliases expanded
    hour_wildcard: bool = field(repr=False, compare=False)  # fires on every real hour

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.tz)


def parse_cron(expr: str, tz: str = "UTC") -> CronSpec:
    """Validate a cron expression and an IANA time zone; raise ScheduleSpecError if bad."""
    if not isinstance(expr, str):
        raise ScheduleSpecError(f"cron expression must be a string, got {type(expr).__name__}")
    text = " ".join(expr.split())
    if not text:
        raise ScheduleSpecError(f"cron expression is empty; {_ACCEPTED}")
    key = _check_zone(tz)
    if text.startswith("@"):
        text = text.lower()
        if text not in ALIASES:
            raise ScheduleSpecError(
                f"unknown cron alias {text!r}{_did_you_mean(text, ALIASES)}; "
                f"accepted aliases: {', '.join(ALIASES)}"
            )
        fields = tuple(ALIASES[text].split())
    else:
        fields = tuple(text.lower().split())
        if len(fields) not in (5, 6):
            raise ScheduleSpecError(
                f"cron expression {text!r} has {len(fields)} fields; {_ACCEPTED}"
            )
    layout = _SIX if len(fields) == 6 else _FIVE
    for spec_field, value in zip(layout, fields, strict=True):
        _check_field(text, spec_field, value)
    has_seconds = len(fields) == 6
    body = " ".join(fields)
    try:
        # strict: reject day/month pairs that never happen (0 0 30 2 *) -- unless a
        # day-of-week is also given, which ORs in other days.
        expanded, _ = croniter.expand(
            body, second_at_beginning=has_seconds, strict=fields[-1] in ("*", "?")
        )
        croniter(body, datetime(2000, 1, 1), second_at_beginning=has_seconds).get_next(datetime)
    except CroniterError as exc:
        raise ScheduleSpecError(f"invalid cron expression {text!r}: {exc}") from None
    hour_items = fields[layout.index(_F_HOUR)].split(",")
    hour_wildcard = expanded[1] == ["*"] or any(item.startswith("*") for item in hour_items)
    return CronSpec(text, key, has_seconds, fields, hour_wildcard)


def _check_field(expr: str, spec: _Field, value: str) -> None:
    """Catch the common mistakes with a message naming the field; croniter checks the rest."""
    where = f"{spec.name} field {value!r} of cron expression {expr!r}"
    for item in value.split(","):
        if not item:
            raise ScheduleSpecError(f"{where} has an empty list item; {spec.help()}")
        if item == "?":
            if spec not in (_F_DOM, _F_DOW):
                raise ScheduleSpecError(f"{where}: '?' is only allowed in day-of-month/day-of-week")
            continue
        if _HASHED_RE.match(item):
            raise ScheduleSpecError(
                f"{where}: hashed/random values (H, R) are not supported; fire times must be "
                "deterministic"
            )
        if (spec is _F_DOM and _DOM_SPECIAL_RE.match(item)) or (
            spec is _F_DOW and _DOW_SPECIAL_RE.match(item)
        ):
            continue
        match = _TOKEN_RE.match(item)
        if match is None:
            raise ScheduleSpecError(f"{where}: {item!r} is not understood; {spec.help()}")
        lo = _field_value(where, spec, match["lo"]) if match["lo"] else None
        hi = _field_value(where, spec, match["hi"]) if match["hi"] else None
        if lo is not None and hi is not None and lo > hi and not spec.wraps:
            raise ScheduleSpecError(
                f"{where}: range {item!r} goes backwards; write it as "
                f"{lo}-{spec.high},{spec.low}-{hi}"
            )
        step = match["step"]
        if step is not None and not 1 <= int(step) <= spec.high - spec.low:
            raise ScheduleSpecError(
                f"{where}: step {step} must be between 1 and {spec.high - spec.low}; cron steps "
                f"restart every cycle, so for a longer period use an interval (e.g. '90m')"
            )


def _field_value(where: str, spec: _Field, text: str) -> int:
    if text.isdigit():
        number = int(text)
    elif text in spec.names:
        number = spec.low + spec.names.index(text)
    else:
        raise ScheduleSpecError(f"{where}: {text!r} is not a number or name; {spec.help()}")
    if not spec.low <= number <= spec.high:
        raise ScheduleSpecError(f"{where}: value {number} is out of range {spec.low}-{spec.high}")
    return number


def _check_zone(tz: str) -> str:
    if not isinstance(tz, str) or not tz.strip():
        raise ScheduleSpecError(f"time zone must be an IANA name such as 'UTC', got {tz!r}")
    key = tz.strip()
    if key.lower() == "localtime":
        raise ScheduleSpecError(
            "time zone 'localtime' depends on the host; name the IANA zone, e.g. 'Europe/Berlin'"
        )
    try:
        ZoneInfo(key)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise ScheduleSpecError(
            f"unknown time zone {key!r}{_did_you_mean_zone(key)}; use an IANA name such as "
            "'UTC', 'Europe/Berlin' or 'America/New_York'"
        ) from None
    return key


@lru_cache(maxsize=1)
def _zones_by_lower() -> dict[str, str]:
    return {name.lower(): name for name in available_timezones()}


def _did_you_mean_zone(key: str) -> str:
    zones = _zones_by_lower()
    if key.lower() in zones:
        return f" (did you mean {zones[key.lower()]!r}?)"
    close = difflib.get_close_matches(key.lower(), zones, n=1, cutoff=0.75)
    return f" (did you mean {zones[close[0]]!r}?)" if close else ""


def _did_you_mean(word: str, choices: Sequence[str] | dict[str, str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# --- fire times ---------------------------------------------------------------------

_ONE_SECOND = timedelta(seconds=1)
_PROBE_STEP = timedelta(hours=6)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def next_fire_after(spec: CronSpec, after: datetime) -> datetime:
    """The first fire time strictly after ``after`` (aware), as an aware UTC datetime."""
    return _Firing(spec).next_after(_as_utc(after, "after"))


def fire_times_between(
    spec: CronSpec, after: datetime, until: datetime, limit: int
) -> list[datetime]:
    """Fire times in ``(after, until]``, ascending, at most ``limit`` of them."""
    until = _as_utc(until, "until")
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
    instant = _as_utc(after, "after")
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


def _as_utc(value: datetime, name: str) -> datetime:
    if not isinstance(value, datetime):
        raise TypeError(f"{name} must be a datetime, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name} must be an aware datetime (e.g. in UTC), got naive {value!r}")
    return value.astimezone(UTC)


# --- intervals ----------------------------------------------------------------------

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
    anchor, after = _as_utc(anchor, "anchor"), _as_utc(after, "after")
    if every <= timedelta(0):
        raise ScheduleSpecError(f"interval must be positive, got {every}")
    if after < anchor:
        return anchor
    return anchor + ((after - anchor) // every + 1) * every


def deterministic_jitter(schedule_key: str, fire_time: datetime, max_seconds: float) -> timedelta:
    """A delay in ``[0, max_seconds)`` spreading a schedule's fires, the same on every
    replica and every retry: a blake2b hash of (key, fire time in UTC), microsecond grain."""
    if not math.isfinite(max_seconds) or max_seconds < 0:
        raise ValueError(f"jitter must be a finite number of seconds >= 0, got {max_seconds!r}")
    instant = _as_utc(fire_time, "fire_time")
    span = int(max_seconds * 1_000_000)
    if span <= 0:
        return timedelta(0)
    digest = hashlib.blake2b(
        f"{schedule_key}\x00{instant.isoformat()}".encode(), digest_size=8, person=b"duetime-jitter"
    ).digest()
    return timedelta(microseconds=(int.from_bytes(digest, "big") * span) >> 64)


# --- misfires -----------------------------------------------------------------------

MISFIRE_POLICIES = ("skip", "fire_once", "fire_all")


class MisfirePlan(NamedTuple):
    """Which missed fire times to materialize now, and how many are dropped (to log)."""

    fire: list[datetime]
    skipped: int


def parse_misfire_policy(policy: str) -> str:
    """Normalize a policy name ('fire-once' -> 'fire_once'), or say what is accepted."""
    name = policy.strip().lower().replace("-", "_") if isinstance(policy, str) else ""
    if name not in MISFIRE_POLICIES:
        raise ScheduleSpecError(
            f"unknown misfire policy {policy!r}{_did_you_mean(name, MISFIRE_POLICIES)}; "
            f"accepted: {', '.join(MISFIRE_POLICIES)}"
        )
    return name


def misfire_plan(policy: str, missed: Sequence[datetime], cap: int) -> MisfirePlan:
    """Decide what to do with fire times that were missed (downtime, or found late).

    - ``skip``: fire none; all are skipped (the schedule jumps to its next future time).
    - ``fire_once``: one catch-up run, as the LAST missed time; the rest are skipped.
    - ``fire_all``: every missed time, but at most ``cap``: the MOST RECENT ``cap`` ones,
      so a long outage cannot flood workers with stale runs and the catch-up is the
      same fire time ``fire_once`` would pick; the older ones are skipped.

    ``missed`` must be strictly increasing (as ``fire_times_between`` returns it).
    """
    name = parse_misfire_policy(policy)
    if any(later <= earlier for earlier, later in itertools.pairwise(missed)):
        raise ValueError("missed fire times must be strictly increasing")
    if name == "skip":
        return MisfirePlan([], len(missed))
    if name == "fire_once":
        return MisfirePlan(list(missed[-1:]), max(len(missed) - 1, 0))
    if cap < 1:
        raise ValueError(f"fire_all needs a cap >= 1, got {cap}")
    fire = list(missed[-cap:])
    return MisfirePlan(fire, len(missed) - len(fire))
