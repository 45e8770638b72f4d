"""The pure planning decision (scheduler.planning): what one planner pass does to one
schedule at a given ``now`` — fire times within the horizon, misfires after downtime,
overlap policies, jitter, bounds, invalid rows — and the schedule model's validation.

The cron arithmetic itself (DST, parsing) is tested in test_cron*.py; the database
side of the same decisions in tests/integration/test_planner.py.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from scheduler.errors import InvalidInput
from scheduler.planning import (
    PlanConfig,
    PlanDecision,
    Schedule,
    ScheduleSpec,
    deterministic_jitter,
    fire_key,
    plan_schedule,
    upcoming_fire_times,
)

T0 = datetime(2026, 6, 1, 12, 0, 0, tzinfo=UTC)
SEC = timedelta(seconds=1)
CONFIG = PlanConfig(horizon=timedelta(seconds=10), misfire_grace=timedelta(seconds=1))


def row(**overrides: Any) -> Schedule:
    values: dict[str, Any] = dict(
        id=42,
        name="s",
        task="t",
        payload={},
        queue="default",
        max_attempts=5,
        cron="* * * * * *",
        interval=None,
        timezone="UTC",
        start_at=None,
        end_at=None,
        paused=False,
        misfire_policy="skip",
        misfire_cap=100,
        overlap_policy="allow",
        jitter=0.0,
        next_fire_at=None,
        buffered_fire_at=None,
        last_fired_at=None,
        last_job_id=None,
        fired_count=0,
        skipped_count=0,
        missed_count=0,
        last_error=None,
        created_at=T0 - timedelta(days=1),
        updated_at=T0 - timedelta(days=1),
    )
    values.update(overrides)
    return Schedule(**values)


def times(decision: PlanDecision) -> list[datetime]:
    return [f.fire_time for f in decision.fires]


def seconds(start: datetime, count: int) -> list[datetime]:
    return [start + i * SEC for i in range(count)]


# --- keys ---------------------------------------------------------------------------


def test_fire_key_is_iso_utc_with_z() -> None:
    assert fire_key(7, T0) == "schedule:7:2026-06-01T12:00:00Z"
    berlin = T0.astimezone(datetime.now().astimezone().tzinfo)
    assert fire_key(7, berlin) == "schedule:7:2026-06-01T12:00:00Z"
    assert fire_key(7, T0 + timedelta(microseconds=5)) == "schedule:7:2026-06-01T12:00:00.000005Z"


# --- a fresh schedule, steady state -----------------------------------------------------


def test_fresh_schedule_plans_from_now_up_to_the_horizon() -> None:
    d = plan_schedule(row(), T0, CONFIG)
    assert times(d) == seconds(T0, 11)  # 12:00:00 .. 12:00:10, nothing missed
    assert d.missed == d.skipped == 0
    assert d.next_fire_at == T0 + 11 * SEC
    assert d.plan_at == T0 + 6 * SEC  # next fire - lead (horizon / 2)
    assert [f.key for f in d.fires][:1] == ["schedule:42:2026-06-01T12:00:00Z"]
    assert all(f.due_at == f.fire_time for f in d.fires)


def test_revisit_continues_where_the_last_pass_stopped() -> None:
    first = plan_schedule(row(), T0, CONFIG)
    assert first.plan_at is not None
    second = plan_schedule(row(next_fire_at=first.next_fire_at), first.plan_at, CONFIG)
    assert times(second) == seconds(T0 + 11 * SEC, 6)  # up to plan_at + horizon
    assert second.missed == 0


def test_fresh_minutely_schedule_waits_for_its_first_fire() -> None:
    d = plan_schedule(row(cron="0 * * * *"), T0 + 5 * SEC, CONFIG)
    assert d.fires == ()
    assert d.next_fire_at == T0 + timedelta(hours=1)
    assert d.plan_at == T0 + timedelta(hours=1) - 5 * SEC


def test_jitter_is_deterministic_and_inside_the_window() -> None:
    s = row(jitter=30.0, cron="0 * * * * *")
    d = plan_schedule(s, T0, PlanConfig(horizon=timedelta(minutes=5)))
    assert len(d.fires) == 6
    for fire in d.fires:
        offset = fire.due_at - fire.fire_time
        assert timedelta(0) <= offset < timedelta(seconds=30)
        assert offset == deterministic_jitter("42", fire.fire_time, 30.0)
    assert plan_schedule(s, T0, PlanConfig(horizon=timedelta(minutes=5))) == d
    other = plan_schedule(replace(s, id=43), T0, PlanConfig(horizon=timedelta(minutes=5)))
    assert [f.due_at for f in other.fires] != [f.due_at for f in d.fires]


def test_interval_fires_on_its_anchor_grid() -> None:
    anchor = T0 - timedelta(seconds=7, milliseconds=250)
    s = row(cron=None, interval=timedelta(seconds=3), created_at=anchor)
    d = plan_schedule(s, T0, CONFIG)
    assert times(d) == [anchor + k * timedelta(seconds=3) for k in range(3, 6)]
    start = row(cron=None, interval=timedelta(minutes=1), start_at=T0 + timedelta(hours=1))
    assert plan_schedule(start, T0, CONFIG).next_fire_at == T0 + timedelta(hours=1)


# --- bounds -------------------------------------------------------------------------------


def test_start_at_delays_the_first_fire() -> None:
    d = plan_schedule(row(start_at=T0 + 5 * SEC), T0, CONFIG)
    assert times(d)[0] == T0 + 5 * SEC


def test_end_at_finishes_the_schedule() -> None:
    d = plan_schedule(row(end_at=T0 + 3 * SEC), T0, CONFIG)
    assert times(d) == seconds(T0, 4)  # end_at itself fires
    assert d.next_fire_at is None
    assert d.plan_at is None  # stored as 'infinity': never claimed again


# --- misfires (downtime) ---------------------------------------------------------------------


def after_downtime(policy: str, cap: int = 100, down: int = 30) -> PlanDecision:
    """Planned up to T0 + 10 s, then nothing until T0 + down."""
    s = row(misfire_policy=policy, misfire_cap=cap, next_fire_at=T0 + 11 * SEC)
    return plan_schedule(s, T0 + down * SEC, CONFIG)


def test_skip_fires_none_of_the_missed_and_counts_them() -> None:
    d = after_downtime("skip")
    # missed: 12:00:11 .. 12:00:28 (earlier than now - grace = 12:00:29)
    assert d.missed == 18 and d.skipped_misfire == 18
    assert times(d) == seconds(T0 + 29 * SEC, 12)  # on time again: 12:00:29 .. now + horizon
    assert d.first_missed == T0 + 11 * SEC and d.last_missed == T0 + 28 * SEC


def test_fire_once_fires_the_last_missed_time_once() -> None:
    d = after_downtime("fire_once")
    assert d.missed == 18 and d.skipped_misfire == 17
    assert times(d)[0] == T0 + 28 * SEC
    assert times(d)[1:] == seconds(T0 + 29 * SEC, 12)


def test_fire_all_fires_each_missed_time_up_to_the_cap() -> None:
    d = after_downtime("fire_all", cap=1000)
    assert d.missed == 18 and d.skipped_misfire == 0
    assert times(d) == seconds(T0 + 11 * SEC, 18 + 12)
    capped = after_downtime("fire_all", cap=5)
    assert capped.skipped_misfire == 13
    assert times(capped)[:5] == seconds(T0 + 24 * SEC, 5)  # the most recent five


def test_a_little_late_is_not_a_misfire() -> None:
    d = plan_schedule(row(next_fire_at=T0), T0 + timedelta(milliseconds=900), CONFIG)
    assert d.missed == 0
    assert times(d)[0] == T0


@pytest.mark.parametrize(("policy", "cap"), [("skip", 1), ("fire_once", 1), ("fire_all", 7)])
def test_long_outage_is_worked_off_in_chunks_with_exact_counts(policy: str, cap: int) -> None:
    """Missed fire times beyond max_catchup_scan take several passes, but the totals and
    the catch-up runs are exactly those of one unbounded pass."""
    config = replace(CONFIG, max_catchup_scan=50)
    now = T0 + timedelta(seconds=500)
    s = row(misfire_policy=policy, misfire_cap=cap, next_fire_at=T0)
    missed = skipped = passes = 0
    fired: list[datetime] = []
    while True:
        passes += 1
        d = plan_schedule(s, now, config)
        missed += d.missed
        skipped += d.skipped_misfire
        fired += times(d)
        s = replace(s, next_fire_at=d.next_fire_at)
        if d.plan_at != now:
            break
    assert passes > 5
    late = seconds(T0, 499)  # 12:00:00 .. 12:08:18, earlier than now - 1 s
    assert missed == len(late)
    expected_fired = {"skip": [], "fire_once": late[-1:], "fire_all": late[-7:]}[policy]
    assert fired[: len(expected_fired)] == expected_fired
    assert skipped == len(late) - len(expected_fired)
    assert fired[len(expected_fired) :] == seconds(now - SEC, 12)


# --- overlap ---------------------------------------------------------------------------------


def test_overlap_policies_plan_just_in_time() -> None:
    s = row(overlap_policy="skip", next_fire_at=T0 + SEC)
    early = plan_schedule(s, T0, CONFIG)
    assert early.fires == ()
    assert early.plan_at == T0 + SEC  # looked at exactly when it fires
    d = plan_schedule(s, T0 + SEC, CONFIG)
    assert times(d) == [T0 + SEC]
    assert d.next_fire_at == d.plan_at == T0 + 2 * SEC


def test_overlap_skip_skips_while_the_previous_run_is_unfinished() -> None:
    s = row(overlap_policy="skip", next_fire_at=T0)
    d = plan_schedule(s, T0, CONFIG, previous_active=True)
    assert d.fires == () and d.skipped_overlap == 1 and d.next_fire_at == T0 + SEC
    free = plan_schedule(s, T0, CONFIG, previous_active=False)
    assert times(free) == [T0]


def test_overlap_skip_after_downtime_fires_one_catch_up_at_most() -> None:
    s = row(overlap_policy="skip", misfire_policy="fire_all", next_fire_at=T0)
    d = plan_schedule(s, T0 + 5 * SEC, CONFIG)
    assert times(d) == [T0]  # the first catch-up runs; the rest would overlap it
    assert d.missed == 4 and d.skipped_overlap == 5


def test_buffer_one_keeps_one_fire_waiting_for_the_running_job() -> None:
    s = row(overlap_policy="buffer_one", next_fire_at=T0)
    d1 = plan_schedule(s, T0, CONFIG, previous_active=True)
    assert d1.fires == () and d1.buffered_fire_at == T0 and d1.skipped_overlap == 0
    assert d1.plan_at == T0 + SEC  # min(next fire, now + buffer_poll)
    s = replace(s, next_fire_at=d1.next_fire_at, buffered_fire_at=d1.buffered_fire_at)
    d2 = plan_schedule(s, T0 + SEC, CONFIG, previous_active=True)
    assert d2.fires == () and d2.buffered_fire_at == T0 and d2.skipped_overlap == 1
    s = replace(s, next_fire_at=d2.next_fire_at)
    d3 = plan_schedule(s, T0 + timedelta(seconds=1.5), CONFIG, previous_active=False)
    assert times(d3) == [T0]  # the buffered fire runs as soon as the previous finished
    assert d3.buffered_fire_at is None
    assert d3.next_fire_at == T0 + 2 * SEC


# --- invalid rows ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"cron": "61 * * * *"}, "out of range"),
        ({"cron": "* * * *"}, "has 4 fields"),
        ({"timezone": "Mars/Olympus"}, "unknown time zone"),
        ({"cron": None, "interval": timedelta(milliseconds=10)}, "shorter than"),
        ({"cron": None}, "exactly one"),
    ],
)
def test_invalid_rows_become_an_error_decision(overrides: dict[str, Any], fragment: str) -> None:
    s = row(next_fire_at=T0, **overrides)
    d = plan_schedule(s, T0, CONFIG)
    assert d.invalid and fragment in (d.error or "")
    assert d.fires == () and d.next_fire_at == T0  # state kept for when it is fixed


# --- the model -------------------------------------------------------------------------------


def test_spec_normalizes_and_validates() -> None:
    spec = ScheduleSpec(
        "n", "t", cron="  0  3 * * * ", timezone="Europe/Berlin", misfire_policy="fire-once",
        overlap_policy="Buffer-One", jitter=5,
    )  # fmt: skip
    assert spec.cron == "0 3 * * *"
    assert (spec.misfire_policy, spec.overlap_policy, spec.jitter) == (
        "fire_once",
        "buffer_one",
        5.0,
    )
    every = ScheduleSpec("n", "t", interval="1m30s")
    assert every.interval == timedelta(seconds=90)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"cron": "* * * * *", "interval": "5s"}, "exactly one"),
        ({}, "exactly one"),
        ({"cron": "*/0 * * * *"}, "step"),
        ({"cron": "* * * * *", "timezone": "Europe/Berln"}, "did you mean 'Europe/Berlin'"),
        ({"interval": "500ms"}, "shorter than 1 second"),
        ({"interval": "5"}, "add a unit"),
        ({"cron": "* * * * *", "misfire_policy": "later"}, "misfire policy"),
        ({"cron": "* * * * *", "overlap_policy": "queue"}, "overlap policy"),
        ({"cron": "* * * * *", "misfire_cap": 0}, "misfire_cap"),
        ({"cron": "* * * * *", "jitter": float("nan")}, "jitter"),
        ({"cron": "* * * * *", "jitter": -1}, "jitter"),
        ({"cron": "* * * * *", "queue": "bad queue"}, "queue"),
        ({"cron": "* * * * *", "payload": [1]}, "JSON object"),
        ({"cron": "* * * * *", "start_at": T0, "end_at": T0}, "earlier than end_at"),
        ({"cron": "* * * * *", "start_at": T0.replace(tzinfo=None)}, "timezone-aware"),
    ],
)
def test_spec_refuses_bad_input(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(InvalidInput, match=None) as info:
        ScheduleSpec("n", "t", **kwargs)
    assert fragment in str(info.value)


def test_upcoming_respects_bounds_and_zone() -> None:
    s = row(cron="30 2 * * *", timezone="Europe/Berlin", end_at=datetime(2026, 3, 31, tzinfo=UTC))
    got = upcoming_fire_times(s, datetime(2026, 3, 28, tzinfo=UTC), 5)
    # 29 March is the spring-forward day: 02:30 does not exist, it fires at 03:00 CEST
    assert got == [
        datetime(2026, 3, 28, 1, 30, tzinfo=UTC),
        datetime(2026, 3, 29, 1, 0, tzinfo=UTC),
        datetime(2026, 3, 30, 0, 30, tzinfo=UTC),
    ]


def test_schedule_to_dict_is_json_ready() -> None:
    out = row(cron=None, interval=timedelta(hours=1, seconds=30)).to_dict()
    assert out["interval"] == "1h30s"
    assert out["created_at"].endswith("+00:00")


def test_schedules_with_the_same_timing_share_one_enumeration() -> None:
    memo: dict = {}
    a = plan_schedule(row(id=1), T0, CONFIG, memo=memo)
    b = plan_schedule(row(id=2, jitter=5.0), T0, CONFIG, memo=memo)
    late = row(id=3, misfire_policy="fire_all", next_fire_at=T0 - 5 * SEC)
    c = plan_schedule(late, T0, CONFIG, memo=memo)
    assert len(memo) == 2  # a and b shared one scan
    assert times(a) == times(b)
    assert b.fires[0].key == "schedule:2:2026-06-01T12:00:00Z"
    assert any(f.due_at != f.fire_time for f in b.fires)  # b's own jitter
    assert c == plan_schedule(late, T0, CONFIG)  # sharing changes nothing
    assert plan_schedule(row(id=1), T0, CONFIG, memo=memo) == a
