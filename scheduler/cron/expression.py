"""Cron expressions: parsing and validation, with messages that name the mistake.

A schedule's cron expression and time zone are checked here before they reach the
database, so the CLI and API can say which field is wrong and what it accepts ("minute
field '61' ... value 61 is out of range 0-59", "unknown time zone 'Europe/Berln' (did you
mean 'Europe/Berlin'?)"). croniter 7 is the parser of record (5 fields, or 6 with
seconds first); the checks here catch the common mistakes first, with a message naming
the field, and croniter checks the rest. Hashed and random values (``H``, ``R``) are
refused: every replica must compute the same fire times. Day-of-month and day-of-week
combine with OR when both are restricted (croniter's default, as in Vixie cron).

What a valid expression fires at, in its zone, is :mod:`scheduler.cron.dst`.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

from croniter import CroniterError, croniter

from scheduler.errors import InvalidInput

__all__ = ["ALIASES", "CronSpec", "ScheduleSpecError", "did_you_mean", "parse_cron"]


class ScheduleSpecError(InvalidInput, ValueError):
    """A cron expression, time zone, interval or misfire policy is invalid.

    The message says what is wrong and what is accepted. It is an ``InvalidInput`` (the
    CLI reports it as bad input) and a ``ValueError`` (plain Python callers). It lives
    with the cron parser because every schedule parser (intervals and misfire policies
    in :mod:`scheduler.planning` too) raises it and the cron package is the lowest of them.
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
                f"unknown cron alias {text!r}{did_you_mean(text, ALIASES)}; "
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


def did_you_mean(word: str, choices: Sequence[str] | dict[str, str]) -> str:
    """A " (did you mean 'x'?)" hint for an unknown name, or "" when nothing is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
