"""The publisher's back-pressure pause runs on its clock (scheduler/publisher.py):
pure bookkeeping, checked on a ManualClock without a broker."""

from __future__ import annotations

from scheduler.clock import ManualClock
from scheduler.publisher import MAX_THROTTLE, Publisher


def test_a_timed_out_batch_pauses_the_next_one_until_the_clock_passes() -> None:
    clock = ManualClock()
    publisher = Publisher("amqp://unused", delivery_limit=5, publish_timeout=5.0, clock=clock)
    assert publisher.throttle_delay() == 0.0
    publisher._record(5.0, timed_out=True)
    assert publisher.throttle_delay() == MAX_THROTTLE
    clock.advance(MAX_THROTTLE / 2)
    assert publisher.throttle_delay() == MAX_THROTTLE / 2
    clock.advance(MAX_THROTTLE / 2)
    assert publisher.throttle_delay() == 0.0


def test_fast_batches_do_not_pause() -> None:
    clock = ManualClock()
    publisher = Publisher("amqp://unused", delivery_limit=5, publish_timeout=5.0, clock=clock)
    for _ in range(10):
        publisher._record(0.1, timed_out=False)
    assert publisher.throttle_delay() == 0.0
