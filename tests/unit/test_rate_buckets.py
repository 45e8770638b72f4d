"""Token buckets that spread a rate's starts (scheduler.duties.rate_buckets), alone and
inside the allowance, on a manual clock."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from scheduler.clock import ManualClock
from scheduler.duties.limits import Allowance
from scheduler.duties.rate_buckets import RateBuckets
from scheduler.store.limits import Limit, Started

RATE = Limit("task:mail", None, rate_count=50, rate_period=1)


@dataclass(frozen=True)
class J:
    task: str
    queue: str = "default"
    limit_key: str = ""


def test_a_slot_never_charged_has_a_full_bucket_of_a_tenth_of_the_count() -> None:
    buckets = RateBuckets(burst=0.1, clock=ManualClock())
    assert buckets.capacity(RATE) == 5
    assert buckets.room(RATE) == 5
    assert buckets.slots() == []
    slow = Limit("task:x", None, rate_count=3, rate_period=60)
    assert buckets.capacity(slow) == 1  # at least one job


def test_tokens_refill_at_the_rate_and_stop_at_the_capacity() -> None:
    clock = ManualClock()
    buckets = RateBuckets(burst=0.1, clock=clock)
    limits = {RATE.target: RATE}
    buckets.charge(limits, {("task:mail", ""): 5})
    assert buckets.room(RATE) == 0
    assert buckets.wait(RATE) == pytest.approx(0.05)  # half the capacity: 2.5 tokens
    clock.advance(0.05)
    assert buckets.room(RATE) == 2
    assert buckets.wait(RATE) == 0
    buckets.charge(limits, {("task:mail", ""): 1})  # 1 of 2: not behind any more
    clock.advance(10)
    assert buckets.room(RATE) == 5  # never more than the capacity
    buckets.charge(limits, {})
    assert buckets.slots() == []  # a full bucket is forgotten


def test_an_allowance_admits_what_both_the_window_and_the_bucket_leave() -> None:
    clock = ManualClock()
    buckets = RateBuckets(burst=0.1, clock=clock)
    a = Allowance([RATE], [], [Started("task:mail", "", 10, 0.8)], buckets)
    assert a.room(RATE) == 5  # the window leaves 40, the bucket 5
    kept, left = a.take([J("mail")] * 8, limit=100)
    assert (len(kept), len(left)) == (5, 3)
    assert a.holding()
    buckets.charge(a.limits, a.rate_starts(kept))
    clock.advance(0.02)  # one token back, not yet a slice of 2.5
    a = Allowance([RATE], [], [Started("task:mail", "", 15, 0.78)], buckets)
    assert a.room(RATE) == 1


def test_the_wake_time_is_the_later_of_the_window_and_the_bucket() -> None:
    clock = ManualClock()
    buckets = RateBuckets(burst=0.1, clock=clock)
    buckets.charge({RATE.target: RATE}, {("task:mail", ""): 5})
    a = Allowance([RATE], [], [Started("task:mail", "", 20, 0.5)], buckets)
    assert a.free_in() == pytest.approx(0.05)  # the window has room: the bucket's slice
    a = Allowance([RATE], [], [Started("task:mail", "", 50, 0.3)], buckets)
    assert a.free_in() == pytest.approx(0.3)  # the window is full for longer
    a = Allowance([RATE], [], [Started("task:mail", "", 50, 0.01)], buckets)
    assert a.free_in() == pytest.approx(0.05)


def test_each_key_of_a_per_key_rate_has_its_own_bucket() -> None:
    lim = Limit("queue:q", None, per_key=True, rate_count=20, rate_period=1)
    clock = ManualClock()
    buckets = RateBuckets(burst=0.1, clock=clock)
    a = Allowance([lim], [], [], buckets)
    jobs = [J("x", "q", "a")] * 3 + [J("x", "q", "b")] * 3
    kept, _ = a.take(jobs, limit=100)
    assert kept == [J("x", "q", "a")] * 2 + [J("x", "q", "b")] * 2
    buckets.charge(a.limits, a.rate_starts(kept))
    assert sorted(buckets.slots()) == [("queue:q", "a"), ("queue:q", "b")]
    a = Allowance([lim], [], [], buckets)
    assert set(a.closed().queue_keys) == {("q", "a"), ("q", "b")}
    assert a.room(lim, "c") == 2  # a key not charged yet has a full bucket


def test_without_buckets_the_window_alone_decides() -> None:
    a = Allowance([RATE], [], [Started("task:mail", "", 10, 0.8)])
    assert a.room(RATE) == 40


def test_a_burst_outside_0_1_is_refused() -> None:
    with pytest.raises(ValueError, match="burst"):
        RateBuckets(burst=1.5, clock=ManualClock())


def test_a_slot_behind_is_credited_for_a_slow_pass_and_an_idle_one_is_not() -> None:
    clock = ManualClock()
    buckets = RateBuckets(burst=0.1, clock=clock)
    limits = {RATE.target: RATE}
    buckets.charge(limits, {("task:mail", ""): 5})  # took every token: behind
    clock.advance(0.3)  # a slow pass (a loaded machine)
    assert buckets.room(RATE) == 15  # not clipped at 5: the mean is kept
    clock.advance(5)
    assert buckets.room(RATE) == 25  # credited for CATCH_UP (0.5 s) at most
    buckets.charge(limits, {("task:mail", ""): 2})  # got all it asked for: not behind
    clock.advance(0.3)
    assert buckets.room(RATE) == 5


def test_a_behind_bucket_is_kept_while_it_is_credited() -> None:
    """A charge that a slow commit follows must not forget the slot as full: its credit
    past the capacity would be lost (a 10/s rate started 4.7/s that way)."""
    clock = ManualClock()
    buckets = RateBuckets(burst=0.1, clock=clock)
    slow = Limit("task:x", None, rate_count=10, rate_period=1)
    buckets.charge({slow.target: slow}, {("task:x", ""): 1})  # capacity 1, all taken
    clock.advance(0.15)  # the commit
    buckets.charge({slow.target: slow}, {})
    clock.advance(0.1)
    assert buckets.room(slow) == 2


def test_a_slot_the_window_held_back_is_behind_too() -> None:
    clock = ManualClock()
    buckets = RateBuckets(burst=0.1, clock=clock)
    a = Allowance([RATE], [], [Started("task:mail", "", 48, 0.1)], buckets)
    kept, _ = a.take([J("mail")] * 5, limit=100)
    assert len(kept) == 2 and a.exhausted() == {("task:mail", "")}
    buckets.charge(a.limits, a.rate_starts(kept), a.read_at, a.exhausted())
    clock.advance(0.3)
    assert buckets.room(RATE) == 15  # credited for the wait, not clipped at 5
