"""Explicit cases for scheduler.cron: the DST contract (DESIGN §5b) zone by zone,
parsing and its error messages; and scheduler.planning's intervals, jitter and misfire
plans."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from scheduler.cron import (
    ALIASES,
    CronSpec,
    ScheduleSpecError,
    fire_times_between,
    iter_fire_times,
    next_fire_after,
    parse_cron,
)
from scheduler.errors import InvalidInput
from scheduler.planning import (
    MisfirePlan,
    deterministic_jitter,
    misfire_plan,
    next_interval_fire,
    parse_interval,
    parse_misfire_policy,
)

BERLIN = "Europe/Berlin"
NEW_YORK = "America/New_York"
LORD_HOWE = "Australia/Lord_Howe"
KOLKATA = "Asia/Kolkata"


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)  # type: ignore[arg-type,misc]


def local_day(expr: str, tz: str, year: int, month: int, day: int) -> list[datetime]:
    """Fire times (UTC) during one local calendar day."""
    zone = ZoneInfo(tz)
    start = datetime(year, month, day, tzinfo=zone).astimezone(UTC)
    end = (datetime(year, month, day, tzinfo=zone) + timedelta(days=1)).astimezone(UTC)
    return fire_times_between(
        parse_cron(expr, tz),
        start - timedelta(microseconds=1),
        end - timedelta(microseconds=1),
        100_000,
    )


def walls(times: list[datetime], tz: str) -> list[str]:
    return [t.astimezone(ZoneInfo(tz)).strftime("%H:%M:%S%z") for t in times]


# --- spring forward: a time in the gap fires once, at the first instant after it ----


@pytest.mark.parametrize(
    ("expr", "tz", "day", "expected_utc"),
    [
        ("30 2 * * *", BERLIN, (2026, 3, 29), utc(2026, 3, 29, 1, 0)),  # 03:00 CEST
        ("30 2 * * *", NEW_YORK, (2026, 3, 8), utc(2026, 3, 8, 7, 0)),  # 03:00 EDT
        ("0 2 * * *", BERLIN, (2026, 3, 29), utc(2026, 3, 29, 1, 0)),
        ("59 2 * * *", NEW_YORK, (2026, 3, 8), utc(2026, 3, 8, 7, 0)),
        ("0 30 2 * * *", BERLIN, (2026, 3, 29), utc(2026, 3, 29, 1, 0)),  # seconds first
        ("30 2 * * *", BERLIN, (2027, 3, 28), utc(2027, 3, 28, 1, 0)),
        ("30 2 * * *", NEW_YORK, (2027, 3, 14), utc(2027, 3, 14, 7, 0)),
    ],
)
def test_spring_forward_gap_fires_once_at_end_of_gap(
    expr: str, tz: str, day: tuple[int, int, int], expected_utc: datetime
) -> None:
    assert local_day(expr, tz, *day) == [expected_utc]


def test_spring_forward_normal_days_around_the_gap_keep_their_wall_time() -> None:
    spec = parse_cron("30 2 * * *", BERLIN)
    fires = fire_times_between(spec, utc(2026, 3, 27), utc(2026, 3, 31), 10)
    assert fires == [
        utc(2026, 3, 27, 1, 30),  # 02:30 CET
        utc(2026, 3, 28, 1, 30),
        utc(2026, 3, 29, 1, 0),  # 03:00 CEST: first instant after the gap
        utc(2026, 3, 30, 0, 30),  # 02:30 CEST
    ]


def test_several_gap_times_collapse_into_one_fire() -> None:
    # 02:00, 02:15, 02:30, 02:45 do not exist on that day: one fire at 03:00 EDT
    assert local_day("*/15 2 * * *", NEW_YORK, 2026, 3, 8) == [utc(2026, 3, 8, 7, 0)]
    # a gap time and the first wall time after the gap are the same instant: fire once
    assert walls(local_day("0 1-3 * * *", NEW_YORK, 2026, 3, 8), NEW_YORK) == [
        "01:00:00-0500",
        "03:00:00-0400",
    ]


def test_next_fire_after_from_inside_the_day_of_the_gap() -> None:
    spec = parse_cron("30 2 * * *", NEW_YORK)
    assert next_fire_after(spec, utc(2026, 3, 8, 6, 59, 59)) == utc(2026, 3, 8, 7, 0)
    assert next_fire_after(spec, utc(2026, 3, 8, 7, 0)) == utc(2026, 3, 9, 6, 30)


# --- fall back: a time that happens twice fires once, at its first occurrence ------


@pytest.mark.parametrize(
    ("expr", "tz", "day", "expected"),
    [
        ("30 1 * * *", NEW_YORK, (2026, 11, 1), ["01:30:00-0400"]),  # EDT, not EST
        ("30 2 * * *", BERLIN, (2026, 10, 25), ["02:30:00+0200"]),  # CEST, not CET
        ("30 2 * * *", NEW_YORK, (2026, 11, 1), ["02:30:00-0500"]),  # exists once
        ("0 1 * * *", NEW_YORK, (2026, 11, 1), ["01:00:00-0400"]),
        ("59 59 1 * * *", NEW_YORK, (2026, 11, 1), ["01:59:59-0400"]),
        ("30 2 * * *", BERLIN, (2027, 10, 31), ["02:30:00+0200"]),
    ],
)
def test_fall_back_repeated_time_fires_once_at_first_occurrence(
    expr: str, tz: str, day: tuple[int, int, int], expected: list[str]
) -> None:
    assert walls(local_day(expr, tz, *day), tz) == expected


def test_fall_back_from_inside_the_repeated_hour_skips_to_the_next_day() -> None:
    spec = parse_cron("30 1 * * *", NEW_YORK)
    # 01:15 EST, the second 01:15: 01:30 already fired (in EDT)
    assert next_fire_after(spec, utc(2026, 11, 1, 6, 15)) == utc(2026, 11, 2, 6, 30)
    # every second of hour 1: the repeated stretch is skipped at once
    every_second = parse_cron("* * 1 * * *", NEW_YORK)
    assert next_fire_after(every_second, utc(2026, 11, 1, 5, 59, 59)) == utc(2026, 11, 2, 6)
    assert next_fire_after(every_second, utc(2026, 11, 1, 5, 30)) == utc(2026, 11, 1, 5, 30, 1)


def test_fixed_hour_minute_wildcard_fires_only_in_first_occurrence() -> None:
    fires = local_day("*/15 1 * * *", NEW_YORK, 2026, 11, 1)
    assert walls(fires, NEW_YORK) == [f"01:{m:02d}:00-0400" for m in (0, 15, 30, 45)]


# --- hour wildcard: every real hour -------------------------------------------------


@pytest.mark.parametrize(
    ("tz", "day", "count"),
    [
        (NEW_YORK, (2026, 3, 8), 23),
        (NEW_YORK, (2026, 11, 1), 25),
        (NEW_YORK, (2026, 6, 1), 24),
        (BERLIN, (2026, 3, 29), 23),
        (BERLIN, (2026, 10, 25), 25),
        (BERLIN, (2026, 1, 15), 24),
        (KOLKATA, (2026, 3, 29), 24),
        ("UTC", (2026, 3, 29), 24),
    ],
)
def test_hourly_fires_on_every_real_hour(tz: str, day: tuple[int, int, int], count: int) -> None:
    fires = local_day("0 * * * *", tz, *day)
    assert len(fires) == count
    assert {b - a for a, b in itertools.pairwise(fires)} == {timedelta(hours=1)}


def test_hourly_across_fall_back_fires_the_repeated_hour_twice() -> None:
    fires = fire_times_between(
        parse_cron("0 * * * *", NEW_YORK), utc(2026, 11, 1, 4), utc(2026, 11, 1, 8), 10
    )
    assert walls(fires, NEW_YORK) == [
        "01:00:00-0400",
        "01:00:00-0500",
        "02:00:00-0500",
        "03:00:00-0500",
    ]


@pytest.mark.parametrize("expr", ["0 * * * *", "0 0-23 * * *", "0 */1 * * *", "@hourly"])
def test_hour_wildcard_spellings_all_fire_on_real_hours(expr: str) -> None:
    assert parse_cron(expr).hour_wildcard
    assert len(local_day(expr, BERLIN, 2026, 10, 25)) == 25


def test_hour_step_is_a_wildcard_and_skips_times_in_the_gap() -> None:
    # Vixie-cron rule: '*/2' is a wildcard; 02:00 does not exist and is not moved
    assert walls(local_day("0 */2 * * *", NEW_YORK, 2026, 3, 8), NEW_YORK)[:3] == [
        "00:00:00-0500",
        "04:00:00-0400",
        "06:00:00-0400",
    ]
    assert not parse_cron("0 1-3 * * *").hour_wildcard


@pytest.mark.parametrize(
    ("tz", "transition"),
    [
        (BERLIN, utc(2026, 3, 29, 1)),
        (BERLIN, utc(2026, 10, 25, 1)),
        (NEW_YORK, utc(2026, 3, 8, 7)),
        (NEW_YORK, utc(2026, 11, 1, 6)),
        (LORD_HOWE, utc(2026, 10, 3, 15, 30)),
        (LORD_HOWE, utc(2026, 4, 4, 15)),
    ],
)
def test_seconds_step_fires_every_15_real_seconds_across_transitions(
    tz: str, transition: datetime
) -> None:
    spec = parse_cron("*/15 * * * * *", tz)
    assert spec.has_seconds
    fires = fire_times_between(
        spec, transition - timedelta(minutes=5), transition + timedelta(minutes=5), 1000
    )
    assert len(fires) == 40
    assert {b - a for a, b in itertools.pairwise(fires)} == {timedelta(seconds=15)}
    assert transition in fires


# --- Australia/Lord_Howe: 30-minute shifts -----------------------------------------
# 2026-10-04 02:00 +10:30 -> 02:30 +11:00 (gap 02:00-02:30)
# 2026-04-05 02:00 +11:00 -> 01:30 +10:30 (01:30-02:00 happens twice)


@pytest.mark.parametrize(
    ("expr", "day", "expected"),
    [
        ("30 2 * * *", (2026, 10, 4), ["02:30:00+1100"]),  # exists, right after the gap
        ("0 2 * * *", (2026, 10, 4), ["02:30:00+1100"]),  # in the gap
        ("15 2 * * *", (2026, 10, 4), ["02:30:00+1100"]),  # in the gap
        ("0 1 * * *", (2026, 10, 4), ["01:00:00+1030"]),
        ("30 1 * * *", (2026, 4, 5), ["01:30:00+1100"]),  # repeated: first occurrence
        ("45 1 * * *", (2026, 4, 5), ["01:45:00+1100"]),
        ("0 2 * * *", (2026, 4, 5), ["02:00:00+1030"]),  # exists once
        ("30 2 * * *", (2026, 4, 5), ["02:30:00+1030"]),
    ],
)
def test_lord_howe_half_hour_shift(
    expr: str, day: tuple[int, int, int], expected: list[str]
) -> None:
    assert walls(local_day(expr, LORD_HOWE, *day), LORD_HOWE) == expected


def test_lord_howe_hour_wildcard_follows_the_wall_clock() -> None:
    spring = local_day("0 * * * *", LORD_HOWE, 2026, 10, 4)
    assert len(spring) == 23  # 02:00 does not exist
    assert walls(spring, LORD_HOWE)[1:3] == ["01:00:00+1030", "03:00:00+1100"]
    assert len(local_day("0 * * * *", LORD_HOWE, 2026, 4, 5)) == 24  # :00 never repeats
    fall = local_day("30 * * * *", LORD_HOWE, 2026, 4, 5)
    assert len(fall) == 25  # 01:30 happens twice
    assert walls(fall, LORD_HOWE)[1:3] == ["01:30:00+1100", "01:30:00+1030"]
    assert len(local_day("*/30 * * * *", LORD_HOWE, 2026, 10, 4)) == 47  # 23.5 real hours


# --- Asia/Kolkata, aliases ----------------------------------------------------------


def test_kolkata_half_hour_offset() -> None:
    assert local_day("30 2 * * *", KOLKATA, 2026, 3, 29) == [utc(2026, 3, 28, 21, 0)]
    hourly = local_day("0 * * * *", KOLKATA, 2026, 3, 29)
    assert {t.minute for t in hourly} == {30}


@pytest.mark.parametrize(
    ("alias", "after", "expected"),
    [
        ("@hourly", utc(2026, 5, 5, 10, 0), utc(2026, 5, 5, 11, 0)),
        ("@daily", utc(2026, 5, 5, 10, 0), utc(2026, 5, 5, 22, 0)),  # 00:00 CEST
        ("@midnight", utc(2026, 5, 5, 10, 0), utc(2026, 5, 5, 22, 0)),
        ("@weekly", utc(2026, 5, 5, 10, 0), utc(2026, 5, 9, 22, 0)),  # Sunday 05-10
        ("@monthly", utc(2026, 5, 5, 10, 0), utc(2026, 5, 31, 22, 0)),
        ("@yearly", utc(2026, 5, 5, 10, 0), utc(2026, 12, 31, 23, 0)),  # CET
        ("@annually", utc(2026, 5, 5, 10, 0), utc(2026, 12, 31, 23, 0)),
        ("@Daily", utc(2026, 5, 5, 10, 0), utc(2026, 5, 5, 22, 0)),
    ],
)
def test_aliases(alias: str, after: datetime, expected: datetime) -> None:
    spec = parse_cron(alias, BERLIN)
    assert next_fire_after(spec, after) == expected
    assert spec.expr == alias.lower()
    assert spec.fields == tuple(ALIASES[alias.lower()].split())


# --- API behaviour ------------------------------------------------------------------


def test_next_fire_after_is_strictly_after_and_utc() -> None:
    spec = parse_cron("*/5 * * * *", "UTC")
    assert next_fire_after(spec, utc(2026, 1, 1, 0, 5)) == utc(2026, 1, 1, 0, 10)
    assert next_fire_after(spec, utc(2026, 1, 1, 0, 4, 59, 999_999)) == utc(2026, 1, 1, 0, 5)
    berlin_time = datetime(2026, 1, 1, 1, 5, tzinfo=ZoneInfo(BERLIN))  # any aware input
    result = next_fire_after(spec, berlin_time)
    assert result == utc(2026, 1, 1, 0, 10)
    assert result.tzinfo is UTC


def test_naive_datetimes_are_refused() -> None:
    spec = parse_cron("* * * * *")
    with pytest.raises(ValueError, match="aware"):
        next_fire_after(spec, datetime(2026, 1, 1))
    with pytest.raises(ValueError, match="aware"):
        next_interval_fire(datetime(2026, 1, 1), timedelta(seconds=5), utc(2026, 1, 1))


def test_fire_times_between_bounds_and_limit() -> None:
    spec = parse_cron("0 * * * *")
    fires = fire_times_between(spec, utc(2026, 1, 1, 0), utc(2026, 1, 1, 3), 100)
    assert fires == [utc(2026, 1, 1, 1), utc(2026, 1, 1, 2), utc(2026, 1, 1, 3)]  # (after, until]
    assert fire_times_between(spec, utc(2026, 1, 1), utc(2026, 1, 2), 2) == fires[:2]
    assert fire_times_between(spec, utc(2026, 1, 1), utc(2026, 1, 2), 0) == []
    assert fire_times_between(spec, utc(2026, 1, 1, 3), utc(2026, 1, 1, 1), 5) == []
    assert list(itertools.islice(iter_fire_times(spec, utc(2026, 1, 1)), 3)) == fires


def test_day_of_month_and_day_of_week_combine_with_or() -> None:
    spec = parse_cron("0 0 13 * fri")  # the 13th, and every Friday
    fires = fire_times_between(spec, utc(2026, 2, 1), utc(2026, 2, 28), 10)
    assert [f.day for f in fires] == [6, 13, 20, 27]  # 13th is itself a Friday
    assert parse_cron("0 0 L * *").fields[2] == "l"
    assert next_fire_after(parse_cron("0 0 L * *"), utc(2028, 2, 1)) == utc(2028, 2, 29)


def test_cron_spec_is_a_frozen_value() -> None:
    a, b = parse_cron("  0   5 * * * ", BERLIN), parse_cron("0 5 * * *", BERLIN)
    assert a == b and hash(a) == hash(b)
    assert a.expr == "0 5 * * *" and a.tz == BERLIN and not a.has_seconds
    assert isinstance(a, CronSpec)
    with pytest.raises(AttributeError):
        a.tz = "UTC"  # type: ignore[misc]


# --- invalid expressions and zones: clear messages ----------------------------------


@pytest.mark.parametrize(
    ("expr", "fragments"),
    [
        ("", ["empty", "expected 5 fields"]),
        ("* * * *", ["has 4 fields", "expected 5 fields", "seconds first", "@hourly"]),
        ("0 0 0 * * * *", ["has 7 fields"]),
        ("61 * * * *", ["minute field", "61 is out of range 0-59"]),
        ("* 24 * * *", ["hour field", "24 is out of range 0-23"]),
        ("0 0 0 * *", ["day-of-month", "0 is out of range 1-31"]),
        ("0 0 * 13 *", ["month field", "13 is out of range 1-12"]),
        ("0 0 * * 8", ["day-of-week", "8 is out of range 0-7"]),
        ("60 * * * * *", ["second field", "60 is out of range 0-59"]),
        ("*/0 * * * *", ["step 0 must be between 1 and 59"]),
        ("*/90 * * * *", ["step 90", "interval"]),
        ("50-10 * * * *", ["goes backwards", "50-59,0-10"]),
        ("1,,2 * * * *", ["empty list item"]),
        ("hello world foo bar baz", ["minute field", "'hello' is not a number or name"]),
        ("* * * foo *", ["month field", "'foo'", "jan-dec"]),
        ("0 0 * * 5#6", ["day-of-week", "5#3"]),
        ("0 0 30 2 *", ["can never occur"]),
        ("0 0 31 4,6,9,11 *", ["can never occur"]),
        ("H * * * *", ["hashed/random", "deterministic"]),
        ("R 0 * * *", ["hashed/random"]),
        ("? * * * *", ["'?' is only allowed"]),
        ("0 0 * * * ; rm", ["has 7 fields"]),
        ("*/5 * * *  ", ["has 4 fields"]),
        ("@every5m", ["unknown cron alias", "@hourly"]),
        ("@hourlyy", ["did you mean '@hourly'"]),
        ("1.5 * * * *", ["not understood"]),
    ],
)
def test_invalid_expressions_explain_themselves(expr: str, fragments: list[str]) -> None:
    with pytest.raises(ScheduleSpecError) as info:
        parse_cron(expr)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("tz", "fragments"),
    [
        ("Europe/Berln", ["unknown time zone 'Europe/Berln'", "did you mean 'Europe/Berlin'"]),
        ("europe/berlin", ["did you mean 'Europe/Berlin'"]),
        ("Mars/Olympus_Mons", ["unknown time zone 'Mars/Olympus_Mons'", "IANA"]),
        ("Europe", ["unknown time zone 'Europe'"]),
        ("/etc/passwd", ["unknown time zone"]),
        ("../../etc/passwd", ["unknown time zone"]),
        ("", ["IANA"]),
        ("localtime", ["depends on the host"]),
    ],
)
def test_unknown_time_zone_is_named(tz: str, fragments: list[str]) -> None:
    with pytest.raises(ScheduleSpecError) as info:
        parse_cron("0 0 * * *", tz)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    "expr",
    [
        "0 0 * * fri#3",
        "0 0 * * l5",
        "0 0 15w * *",
        "0 0 ? * mon-fri",
        "0 0 * jan-mar sat-sun",
        "0 0 * nov-feb *",
        "0 0 * * 7",
        "0 0 31 2 mon",
        "0 0 29 2 *",
        "10/5 * * * *",
        "0 0 1,15 * *",
        "0 0 * * SUN",
        "0 9-17/2 * * MON-FRI",
    ],
)
def test_valid_extensions_are_accepted(expr: str) -> None:
    spec = parse_cron(expr, BERLIN)
    assert next_fire_after(spec, utc(2026, 1, 1)) > utc(2026, 1, 1)


def test_schedule_spec_error_is_input_error_and_value_error() -> None:
    with pytest.raises(InvalidInput):
        parse_cron("nope")
    with pytest.raises(ValueError):
        parse_cron("nope")


# --- intervals ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("30s", timedelta(seconds=30)),
        ("5m", timedelta(minutes=5)),
        ("1h30m", timedelta(hours=1, minutes=30)),
        ("1h 30m", timedelta(hours=1, minutes=30)),
        ("2d", timedelta(days=2)),
        ("1w2d", timedelta(days=9)),
        ("1.5s", timedelta(seconds=1.5)),
        (".5s", timedelta(milliseconds=500)),
        ("250ms", timedelta(milliseconds=250)),
        ("1m0.5s", timedelta(seconds=60.5)),
        ("1H", timedelta(hours=1)),
        (" 10s ", timedelta(seconds=10)),
        ("PT30S", timedelta(seconds=30)),
        ("pt5m", timedelta(minutes=5)),
        ("P1DT12H", timedelta(days=1, hours=12)),
        ("P2W", timedelta(weeks=2)),
        ("PT1,5S", timedelta(seconds=1.5)),
    ],
)
def test_parse_interval(text: str, expected: timedelta) -> None:
    assert parse_interval(text) == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("30", "add a unit"),
        ("0s", "must be positive"),
        ("0.0000001s", "must be positive"),
        ("-5s", "expected a positive duration"),
        ("5x", "expected a positive duration"),
        ("30m1h", "largest first"),
        ("1m1m", "largest first"),
        ("P1M", "no fixed length"),
        ("P1Y", "no fixed length"),
        ("PT", "ISO 8601"),
        ("P", "ISO 8601"),
        ("", "expected a positive duration"),
        ("1e3s", "expected a positive duration"),
        ("99999999999999d", "too large"),
    ],
)
def test_parse_interval_errors(text: str, fragment: str) -> None:
    with pytest.raises(ScheduleSpecError, match="interval") as info:
        parse_interval(text)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("after", "expected"),
    [
        (utc(2025, 12, 31), utc(2026, 1, 1)),  # before the anchor: the anchor itself
        (utc(2026, 1, 1), utc(2026, 1, 1, 0, 0, 7)),  # strictly after
        (utc(2026, 1, 1, 0, 0, 6, 999_999), utc(2026, 1, 1, 0, 0, 7)),
        (utc(2026, 1, 1, 0, 0, 7), utc(2026, 1, 1, 0, 0, 14)),
    ],
)
def test_next_interval_fire(after: datetime, expected: datetime) -> None:
    assert next_interval_fire(utc(2026, 1, 1), timedelta(seconds=7), after) == expected


def test_next_interval_fire_is_exact_far_from_the_anchor_and_ignores_dst() -> None:
    anchor = datetime(2026, 3, 1, 9, tzinfo=ZoneInfo(BERLIN))  # 08:00 UTC
    every = timedelta(milliseconds=333)
    after = utc(2027, 3, 1, 12, 34, 56, 789)
    result = next_interval_fire(anchor, every, after)
    k = (after - anchor) // every + 1
    assert result == anchor + k * every and result - every <= after < result
    assert result.tzinfo is UTC
    daily = next_interval_fire(anchor, timedelta(days=1), utc(2026, 4, 1))
    assert daily == utc(2026, 4, 1, 8)  # 10:00 CEST: elapsed days, not wall-clock 09:00
    with pytest.raises(ScheduleSpecError, match="positive"):
        next_interval_fire(anchor, timedelta(0), after)


# --- jitter -------------------------------------------------------------------------


def test_jitter_is_deterministic_and_in_range() -> None:
    fire = utc(2026, 5, 5, 12)
    first = deterministic_jitter("schedule:42", fire, 30.0)
    assert first == deterministic_jitter("schedule:42", fire, 30.0)
    same_instant = fire.astimezone(ZoneInfo(KOLKATA))
    assert deterministic_jitter("schedule:42", same_instant, 30.0) == first
    samples = [
        deterministic_jitter(f"schedule:{n}", fire + timedelta(minutes=n), 10.0)
        for n in range(2000)
    ]
    assert all(timedelta(0) <= s < timedelta(seconds=10) for s in samples)
    mean = sum(s.total_seconds() for s in samples) / len(samples)
    assert 4.5 < mean < 5.5  # roughly uniform
    assert len(set(samples)) > 1990
    assert max(samples) > timedelta(seconds=9.9) and min(samples) < timedelta(seconds=0.1)


def test_jitter_edges() -> None:
    fire = utc(2026, 5, 5, 12)
    assert deterministic_jitter("k", fire, 0) == timedelta(0)
    assert deterministic_jitter("k", fire, 1e-9) == timedelta(0)
    assert deterministic_jitter("k", fire, 0.000002) < timedelta(microseconds=2)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="jitter"):
            deterministic_jitter("k", fire, bad)
    with pytest.raises(ValueError, match="aware"):
        deterministic_jitter("k", datetime(2026, 5, 5), 5)


# --- misfires -----------------------------------------------------------------------

MISSED = [utc(2026, 1, 1, h) for h in range(5)]


@pytest.mark.parametrize(
    ("policy", "cap", "fire", "skipped"),
    [
        ("skip", 10, [], 5),
        ("fire_once", 10, [MISSED[-1]], 4),
        ("fire-once", 10, [MISSED[-1]], 4),
        ("fire_all", 10, MISSED, 0),
        ("fire_all", 5, MISSED, 0),
        ("fire_all", 2, MISSED[-2:], 3),  # the most recent ones
        ("fire_all", 1, [MISSED[-1]], 4),
        (" FIRE_ALL ", 3, MISSED[-3:], 2),
    ],
)
def test_misfire_plan(policy: str, cap: int, fire: list[datetime], skipped: int) -> None:
    plan = misfire_plan(policy, MISSED, cap)
    assert plan == MisfirePlan(fire, skipped)
    assert len(plan.fire) + plan.skipped == len(MISSED)
    assert plan.fire is not MISSED


@pytest.mark.parametrize("policy", ["skip", "fire_once", "fire_all"])
def test_misfire_plan_with_nothing_missed(policy: str) -> None:
    assert misfire_plan(policy, [], 3) == ([], 0)


def test_misfire_plan_errors() -> None:
    with pytest.raises(ScheduleSpecError, match=r"did you mean 'fire_all'.*skip, fire_once"):
        misfire_plan("fireall", MISSED, 3)
    with pytest.raises(ScheduleSpecError, match="unknown misfire policy"):
        parse_misfire_policy("sometimes")
    with pytest.raises(ValueError, match="cap"):
        misfire_plan("fire_all", MISSED, 0)
    with pytest.raises(ValueError, match="strictly increasing"):
        misfire_plan("skip", [MISSED[1], MISSED[0]], 3)
    assert parse_misfire_policy("Fire-Once") == "fire_once"
