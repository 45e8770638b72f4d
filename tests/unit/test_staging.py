"""Staging ahead, the pure parts (DESIGN §14): the worker's timer of staged deliveries
(``workers.staging``, on a ManualClock), the ``start_at`` field of the message, the
settings' bounds, and the staged queue's name."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest

from scheduler.broker import job_queue_names, staged_queue_name
from scheduler.clock import ManualClock
from scheduler.config import load_settings
from scheduler.errors import ConfigError
from scheduler.messages import JobMessage, MalformedMessage, decode
from workers.staging import StagedDeliveries

T0 = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)


async def turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_staged_items_are_released_at_their_start_time_in_order() -> None:
    clock = ManualClock(T0)
    released: list[str] = []
    staged: StagedDeliveries[str] = StagedDeliveries(released.append, clock=clock)
    staged.start()
    try:
        staged.hold("b", T0 + timedelta(seconds=2))
        staged.hold("a", T0 + timedelta(seconds=1))
        staged.hold("c", T0 + timedelta(seconds=2))  # same time as b: after it
        await turns()
        assert released == [] and len(staged) == 3
        clock.advance(0.999)
        await turns()
        assert released == []
        clock.advance(0.001)
        await turns()
        assert released == ["a"]
        staged.hold("now", T0)  # already due: released at the next turn
        await turns()
        assert released == ["a", "now"]
        clock.advance(1.0)
        await turns()
        assert released == ["a", "now", "b", "c"] and len(staged) == 0
    finally:
        assert await staged.close() == []


async def test_an_earlier_item_wakes_a_timer_sleeping_for_a_later_one() -> None:
    clock = ManualClock(T0)
    released: list[str] = []
    staged: StagedDeliveries[str] = StagedDeliveries(released.append, clock=clock)
    staged.start()
    try:
        staged.hold("late", T0 + timedelta(seconds=60))
        await turns()
        staged.hold("soon", T0 + timedelta(seconds=1))
        await turns()
        clock.advance(1.0)
        await turns()
        assert released == ["soon"]
    finally:
        assert await staged.close() == ["late"]  # given back, earliest first


async def test_close_returns_what_is_held_and_a_failing_release_stops_nothing() -> None:
    clock = ManualClock(T0)
    released: list[str] = []

    def release(item: str) -> None:
        if item == "bad":
            raise RuntimeError("boom")
        released.append(item)

    staged: StagedDeliveries[str] = StagedDeliveries(release, clock=clock)
    staged.start()
    staged.hold("bad", T0 + timedelta(seconds=1))
    staged.hold("good", T0 + timedelta(seconds=1))
    staged.hold("x", T0 + timedelta(seconds=9))
    staged.hold("y", T0 + timedelta(seconds=5))
    clock.advance(1.0)
    await turns()
    assert released == ["good"]
    assert await staged.close() == ["y", "x"]
    assert len(staged) == 0


def test_a_staged_message_carries_its_run_time_and_others_none() -> None:
    start = T0 + timedelta(seconds=1.5)
    msg = JobMessage(job_id=7, due_at=T0, attempt=1, epoch=3, task="t", start_at=start)
    assert decode(msg.encode()).start_at == start
    plain = JobMessage(job_id=7, due_at=T0, attempt=1, epoch=3, task="t")
    assert b"start_at" not in plain.encode()
    assert decode(plain.encode()).start_at is None


@pytest.mark.parametrize("value", ["tomorrow", 5, "2026-12-04T12:00:00", "99999-01-01T00:00"])
def test_a_bad_start_at_makes_the_message_malformed(value: object) -> None:
    body = (
        b'{"job_id":1,"due_at":"2026-12-04T12:00:00+00:00","attempt":1,"epoch":1,'
        b'"start_at":' + (f'"{value}"' if isinstance(value, str) else str(value)).encode() + b"}"
    )
    with pytest.raises(MalformedMessage, match="start_at"):
        decode(body)


def test_stage_settings_are_bounded_with_a_clear_error() -> None:
    assert load_settings(env={}).stage_ahead == 2.0
    assert load_settings(env={"DUETIME_STAGE_AHEAD": "0"}).stage_ahead == 0.0
    with pytest.raises(ConfigError, match=r"stage_ahead.*<= 60"):
        load_settings(env={"DUETIME_STAGE_AHEAD": "120"})
    with pytest.raises(ConfigError, match=r"stage_ahead.*>= 0"):
        load_settings(env={"DUETIME_STAGE_AHEAD": "-1"})
    with pytest.raises(ConfigError, match=r"worker_stage_limit.*<= 65535"):
        load_settings(env={"DUETIME_WORKER_STAGE_LIMIT": "100000"})


def test_a_staged_queue_cannot_be_a_job_queue() -> None:
    assert staged_queue_name("emails") == "duetime.emails:staged"
    # what deleting the job queue deletes (the demo, the benches, the tests)
    assert job_queue_names("emails") == ("duetime.emails", "duetime.emails:staged")
