"""Property tests for scheduler.cron's DST contract (DESIGN §5b).

Random expressions (5 fields, or 6 with seconds first) and zones are checked against a
brute-force oracle that knows nothing of folds or bisection: it walks real instants one
step (minute or second) at a time, records the wall clock of each, and applies the
contract directly -- hour-wildcard expressions fire at every instant whose wall clock
matches; fixed-hour expressions fire each matching wall time at its first instant, or,
when no instant shows it (a gap), at the first instant whose wall clock is past it.
Field matching itself comes from ``croniter.expand`` (parsing is tested in test_cron.py).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from functools import cache
from zoneinfo import ZoneInfo

from croniter import croniter
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from scheduler.cron import CronSpec, fire_times_between, next_fire_after, parse_cron

ZONES = ["America/New_York", "Europe/Berlin", "Australia/Lord_Howe", "Asia/Kolkata", "UTC"]
SPAN_START = datetime(2026, 1, 1, tzinfo=UTC)
SPAN_END = datetime(2028, 1, 1, tzinfo=UTC)
SETTINGS = settings(deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow])


@cache
def transitions(tz: str) -> tuple[datetime, ...]:
    """Hours in 2026-2027 at which the zone's UTC offset changed (found by scanning)."""
    zone, found = ZoneInfo(tz), []
    previous = SPAN_START.astimezone(zone).utcoffset()
    hour = SPAN_START
    while hour < SPAN_END:
        hour += timedelta(hours=1)
        offset = hour.astimezone(zone).utcoffset()
        if offset != previous:
            found.append(hour)
        previous = offset
    return tuple(found)


def test_zones_under_test_have_the_expected_transitions() -> None:
    assert [len(transitions(tz)) for tz in ZONES] == [4, 4, 4, 0, 0]


# --- expression strategies ----------------------------------------------------------


def field_items(low: int, high: int, star: bool = True) -> st.SearchStrategy[str]:
    value = st.integers(low, high)
    span = high - low
    return st.one_of(
        st.just("*" if star else str(low)),
        value.map(str),
        st.tuples(value, value).map(lambda ab: f"{min(ab)}-{max(ab)}"),
        st.integers(1, span).map(lambda n: f"*/{n}"),
        st.tuples(value, value, st.integers(1, span)).map(
            lambda abn: f"{min(abn[:2])}-{max(abn[:2])}/{abn[2]}"
        ),
    )


def field(low: int, high: int, star: bool = True) -> st.SearchStrategy[str]:
    items = field_items(low, high, star)
    return st.one_of(items, st.lists(items, min_size=2, max_size=3).map(",".join))


def often_star(low: int, high: int, weight: int) -> st.SearchStrategy[str]:
    """'*' in ``weight`` of ``weight + 1`` draws: keeps fires inside short windows."""
    return st.one_of(*[st.just("*")] * weight, field(low, high))


def near(zone: ZoneInfo, center: datetime | None) -> dict[str, st.SearchStrategy[str]]:
    """Field strategies that, around ``center`` (a transition, mostly), often name the
    wall-clock hours and the day there: fixed-hour expressions on transition days are
    what the DST contract is about, and a window without fires proves little."""
    if center is None:
        return {
            "hour": field(0, 23),
            "dom": often_star(1, 31, 3),
            "month": often_star(1, 12, 3),
            "dow": often_star(0, 7, 3),
        }
    walls = [(center + timedelta(hours=h)).astimezone(zone) for h in (-1, 0, 1)]
    hours = sorted({w.hour for w in walls})
    day = walls[1]
    return {
        "hour": st.one_of(
            st.sampled_from(hours).map(str), st.just(",".join(map(str, hours))), field(0, 23)
        ),
        "dom": st.one_of(often_star(1, 31, 2), st.just(str(day.day))),
        "month": st.one_of(often_star(1, 12, 2), st.just(str(day.month))),
        "dow": st.one_of(often_star(0, 7, 2), st.just(str((day.weekday() + 1) % 7))),
    }


def five_fields(zone: ZoneInfo, center: datetime | None = None) -> st.SearchStrategy[str]:
    f = near(zone, center)
    return st.tuples(field(0, 59), f["hour"], f["dom"], f["month"], f["dow"]).map(" ".join)


def six_fields(zone: ZoneInfo, center: datetime | None = None) -> st.SearchStrategy[str]:
    # seconds: no bare '*' (one fire per second makes examples slow, not stronger)
    f = near(zone, center)
    return st.tuples(
        field(0, 59, star=False), often_star(0, 59, 2), f["hour"], f["dom"], f["month"], f["dow"]
    ).map(" ".join)


FIVE = five_fields(ZoneInfo("UTC"))
SIX = six_fields(ZoneInfo("UTC"))


def valid(expr: str, tz: str) -> CronSpec | None:
    """Random day/month combinations can be impossible (31 Feb); those are rejected."""
    try:
        return parse_cron(expr, tz)
    except ValueError:
        return None


# --- the oracle ---------------------------------------------------------------------


def matcher(spec: CronSpec) -> Callable[[datetime], bool]:
    expanded, _ = croniter.expand(" ".join(spec.fields), second_at_beginning=spec.has_seconds)
    # croniter keeps '*' in a list that also names values ('*,0'): a wildcard all the same
    sets = [None if "*" in e else {int(v) for v in e} for e in expanded]
    minute, hour, dom, month, dow = sets[:5]
    second = sets[5] if spec.has_seconds else {0}
    either_day = dom is not None and dow is not None  # both restricted: OR (Vixie cron)

    def matches(wall: datetime) -> bool:
        def ok(value: int, allowed: set[int] | None) -> bool:
            return allowed is None or value in allowed

        dom_ok, dow_ok = ok(wall.day, dom), ok((wall.weekday() + 1) % 7, dow)
        return (
            ok(wall.second, second)
            and ok(wall.minute, minute)
            and ok(wall.hour, hour)
            and ok(wall.month, month)
            and ((dom_ok or dow_ok) if either_day else (dom_ok and dow_ok))
        )

    return matches


def oracle(spec: CronSpec, after: datetime, until: datetime) -> list[datetime]:
    zone, matches = spec.zone, matcher(spec)
    step = timedelta(seconds=1 if spec.has_seconds else 60)
    margin = timedelta(minutes=62)  # > any shift in these zones (1 h at most)
    start = after - margin
    start -= (start - SPAN_START) % step
    instants: list[datetime] = []
    walls: list[datetime] = []
    instant = start
    while instant <= until + margin:
        instants.append(instant)
        walls.append(instant.astimezone(zone).replace(tzinfo=None))
        instant += step
    if spec.hour_wildcard:
        fires = [t for t, w in zip(instants, walls, strict=True) if matches(w)]
    else:
        first_at: dict[datetime, datetime] = {}
        for t, w in zip(instants, walls, strict=True):
            first_at.setdefault(w, t)
        fires = []
        past = 0  # first index whose wall clock is past ``wall``; only moves forward
        wall, last_wall = min(walls), max(walls)
        while wall <= last_wall:
            while past < len(walls) and walls[past] <= wall:
                past += 1
            if matches(wall):
                if wall in first_at:
                    fires.append(first_at[wall])
                elif past < len(walls):  # a gap: the first instant whose wall clock is past it
                    fires.append(instants[past])
            wall += step
    return sorted({t for t in fires if after < t <= until})


def window_center(tz: str, data: st.DataObject) -> datetime:
    near = list(transitions(tz))
    if near and data.draw(st.integers(0, 3), label="near a transition") > 0:
        center = data.draw(st.sampled_from(near), label="transition")
        return center + timedelta(minutes=data.draw(st.integers(-120, 120), label="shift"))
    seconds = data.draw(st.integers(0, int((SPAN_END - SPAN_START).total_seconds())))
    return SPAN_START + timedelta(seconds=seconds)


# --- properties ---------------------------------------------------------------------


@SETTINGS
@given(tz=st.sampled_from(ZONES), data=st.data())
def test_five_field_fire_times_match_the_oracle(tz: str, data: st.DataObject) -> None:
    center = window_center(tz, data)
    spec = valid(data.draw(five_fields(ZoneInfo(tz), center), label="expr"), tz)
    assume(spec is not None)
    assert spec is not None
    after, until = center - timedelta(hours=12), center + timedelta(hours=12)
    expected = oracle(spec, after, until)
    event("fires in window", "none" if not expected else "some")
    event("rule", "real instants" if spec.hour_wildcard else "nominal wall times")
    assert fire_times_between(spec, after, until, 10_000) == expected


@settings(deadline=None, max_examples=75, suppress_health_check=[HealthCheck.too_slow])
@given(tz=st.sampled_from(ZONES), data=st.data())
def test_six_field_fire_times_match_the_oracle(tz: str, data: st.DataObject) -> None:
    center = window_center(tz, data)
    spec = valid(data.draw(six_fields(ZoneInfo(tz), center), label="expr"), tz)
    assume(spec is not None)
    assert spec is not None and spec.has_seconds
    after, until = center - timedelta(minutes=40), center + timedelta(minutes=40)
    expected = oracle(spec, after, until)
    event("fires in window", "none" if not expected else "some")
    event("rule", "real instants" if spec.hour_wildcard else "nominal wall times")
    assert fire_times_between(spec, after, until, 10_000) == expected


@SETTINGS
@given(expr=st.one_of(FIVE, SIX), tz=st.sampled_from(ZONES), data=st.data())
def test_fire_times_increase_and_never_fall_in_a_gap(
    expr: str, tz: str, data: st.DataObject
) -> None:
    spec = valid(expr, tz)
    assume(spec is not None)
    assert spec is not None
    zone, matches = spec.zone, matcher(spec)
    after = window_center(tz, data)
    fires = fire_times_between(spec, after, SPAN_END + timedelta(days=3000), 25)
    assert fires and fires[0] > after
    assert all(a < b for a, b in itertools.pairwise(fires))
    for previous, fire in zip([after, *fires], fires, strict=False):
        assert fire.tzinfo is UTC and fire.microsecond == 0
        assert next_fire_after(spec, previous) == fire
        wall = fire.astimezone(zone).replace(tzinfo=None)
        # the wall clock reading exists: reading it back gives an instant, not a gap
        assert wall.replace(tzinfo=zone, fold=fire.astimezone(zone).fold).astimezone(UTC) == fire
        if spec.hour_wildcard or matches(wall):
            assert matches(wall)
            if not spec.hour_wildcard:  # a repeated time fires at its first occurrence
                assert wall.replace(tzinfo=zone, fold=0).astimezone(UTC) == fire
        else:  # moved out of a gap: the fire is the transition, clocks jumped forward
            before = (fire - timedelta(seconds=1)).astimezone(zone).utcoffset()
            now = fire.astimezone(zone).utcoffset()
            assert before is not None and now is not None and before < now


def fixed_daily(has_seconds: bool) -> st.SearchStrategy[str]:
    parts = st.tuples(st.integers(0, 59), st.integers(0, 59), st.integers(0, 23))
    if has_seconds:
        return parts.map(lambda smh: f"{smh[0]} {smh[1]} {smh[2]} * * *")
    return parts.map(lambda smh: f"{smh[1]} {smh[2]} * * *")


def assert_once_per_local_day(spec: CronSpec, first_day: datetime, days: int) -> None:
    zone = spec.zone
    start = first_day.replace(tzinfo=zone).astimezone(UTC)
    end = (first_day + timedelta(days=days)).replace(tzinfo=zone).astimezone(UTC)
    fires = fire_times_between(
        spec, start - timedelta(seconds=1), end - timedelta(seconds=1), 10_000
    )
    per_day = Counter(f.astimezone(zone).date() for f in fires)
    expected_days = {(first_day + timedelta(days=n)).date() for n in range(days)}
    assert set(per_day) == expected_days
    assert set(per_day.values()) == {1}
    fields = spec.fields if spec.has_seconds else ("0", *spec.fields)
    second, minute, hour = (int(f) for f in fields[:3])
    for fire in fires:
        local = fire.astimezone(zone)
        nominal = local.replace(hour=hour, minute=minute, second=second, fold=0)
        if nominal.astimezone(UTC).astimezone(zone).replace(tzinfo=None) == nominal.replace(
            tzinfo=None
        ):  # the nominal time exists: it fires then, at its first occurrence
            assert fire == nominal.astimezone(UTC)
        else:  # it fell in the gap: fired at the first instant after it
            assert local.replace(tzinfo=None) > nominal.replace(tzinfo=None)
            assert (
                fire.astimezone(zone).utcoffset()
                != (fire - timedelta(seconds=1)).astimezone(zone).utcoffset()
            )


@SETTINGS
@given(
    has_seconds=st.booleans(),
    tz=st.sampled_from(ZONES),
    data=st.data(),
)
def test_fixed_time_daily_fires_once_per_local_day_around_transitions(
    has_seconds: bool, tz: str, data: st.DataObject
) -> None:
    spec = parse_cron(data.draw(fixed_daily(has_seconds), label="expr"), tz)
    center = window_center(tz, data).astimezone(spec.zone).replace(tzinfo=None)
    first_day = center.replace(hour=0, minute=0, second=0, microsecond=0) - timedelta(days=2)
    assert_once_per_local_day(spec, first_day, days=5)


@settings(deadline=None, max_examples=15)
@given(expr=fixed_daily(False), tz=st.sampled_from(ZONES[:3]))
def test_fixed_time_daily_fires_once_per_local_day_for_two_years(expr: str, tz: str) -> None:
    assert_once_per_local_day(parse_cron(expr, tz), datetime(2026, 1, 1), days=730)
