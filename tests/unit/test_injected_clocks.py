"""Modules that take a ``Clock`` decide by it, not by the system clock: each decision
below is driven by a ``ManualClock`` (no sleeping, exact instants)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from scheduler.clock import ManualClock
from scheduler.dashboard.auth import SESSION_TTL, Auth
from scheduler.health import LoopWatch
from scheduler.publisher import Publisher


def test_a_dashboard_session_expires_by_the_clock() -> None:
    clock = ManualClock(datetime(2026, 12, 1, tzinfo=UTC))
    auth = Auth("secret-token", clock=clock)
    session = auth.new_session()
    clock.advance(SESSION_TTL - 1)
    assert auth.session_ok(session)
    clock.advance(2)
    assert not auth.session_ok(session)


def test_the_loop_watch_sees_a_stall_on_the_clock() -> None:
    clock = ManualClock()
    watch = LoopWatch(interval=0.5, stall_threshold=5.0, clock=clock)
    assert watch.liveness()[0]
    clock.advance(6.0)  # no tick for 6 s: 5.5 s later than the interval
    alive, body = watch.liveness()
    assert not alive and body["status"] == "stalled" and body["uptime_seconds"] == 6.0


def test_a_slow_batch_buys_a_pause_measured_on_the_clock() -> None:
    clock = ManualClock()
    publisher = Publisher("amqp://unused", delivery_limit=5, publish_timeout=1.0, clock=clock)
    publisher._record(1.0, timed_out=True)  # the deadline was hit: back off
    assert publisher.throttle_delay() == 1.0
    clock.advance(0.4)
    assert publisher.throttle_delay() == pytest.approx(0.6)
    clock.advance(0.6)
    assert publisher.throttle_delay() == 0.0
