"""Dispatch credit (scheduler/duties/credit.py): the broker's buffer per queue stays
bounded whatever the samples say, and dispatch never stops for good."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from scheduler.clock import ManualClock
from scheduler.duties.credit import HELD_CLAIM_PAUSE_MAX, DispatchCredit, claim_limit
from scheduler.store.dispatch import claim_sql


@dataclass(frozen=True)
class Job:
    id: int
    queue: str


def book(clock: ManualClock, **kw: int) -> DispatchCredit:
    values = {"buffer": 100, "per_consumer": 10, **kw}
    return DispatchCredit(
        buffer=values["buffer"], per_consumer=values["per_consumer"], refresh=0.02, clock=clock
    )


def test_an_unsampled_queue_gets_one_buffer_then_must_be_sampled() -> None:
    clock = ManualClock()
    credit = book(clock)
    assert credit.credit("a") == 100 and credit.to_sample() == []
    credit.spend(["a"] * 60)
    assert credit.credit("a") == 40
    credit.spend(["a"] * 40)
    assert credit.credit("a") == 0 and credit.held() == ["a"]
    clock.advance(0.02)
    assert credit.to_sample() == ["a"]


def test_credit_is_target_minus_ready_minus_published_since_the_sample() -> None:
    clock = ManualClock()
    credit = book(clock)
    credit.observe("a", ready=30, consumers=20)  # target = max(100, 20 x 10) = 200
    assert credit.target("a") == 200 and credit.credit("a") == 170
    credit.spend(["a"] * 70)
    assert credit.credit("a") == 100
    credit.observe("a", ready=250, consumers=20)  # over target (an old leader's buffer)
    assert credit.credit("a") == 0 and credit.held() == ["a"]
    credit.observe("a", ready=0, consumers=0)  # consumers gone: back to the floor
    assert credit.credit("a") == 100


def test_a_failed_sample_gives_one_buffer_per_blind_window_never_zero_forever() -> None:
    clock = ManualClock()
    credit = book(clock)
    credit.observe("a", ready=100, consumers=0)
    credit.observe_failed("a")
    assert credit.credit("a") == 100  # blind: the last ready count is not trusted
    credit.spend(["a"] * 100)
    for _ in range(10):  # failing again and again does not reopen the allowance
        clock.advance(0.05)
        credit.observe_failed("a")
        assert credit.credit("a") == 0
    clock.advance(0.5)  # one second after the blindness began
    assert credit.credit("a") == 100
    credit.observe("a", ready=20, consumers=0)
    assert credit.credit("a") == 80


def test_trim_keeps_each_queue_within_its_credit_in_claim_order() -> None:
    clock = ManualClock()
    credit = book(clock)
    credit.observe("a", ready=98, consumers=0)  # 2 left
    jobs = [Job(1, "a"), Job(2, "b"), Job(3, "a"), Job(4, "a"), Job(5, "b")]
    kept, over = credit.trim(jobs)
    assert [j.id for j in kept] == [1, 2, 3, 5] and [j.id for j in over] == [4]


@pytest.mark.parametrize(
    ("credit", "limit"), [(1, 1), (2, 2), (3, 2), (100, 64), (499, 256), (500, 500), (9000, 500)]
)
def test_claim_limit_rounds_down_to_a_power_of_two_up_to_the_batch(credit: int, limit: int) -> None:
    assert claim_limit(credit, 500) == limit


def test_limit_follows_the_largest_credit_or_the_buffer() -> None:
    clock = ManualClock()
    credit = book(clock)
    assert credit.limit(500) == 64  # nothing sampled: one buffer (100) rounded down
    credit.observe("a", ready=70, consumers=0)
    assert credit.limit(500) == 16  # 30 left
    credit.observe("a", ready=100, consumers=0)
    assert credit.limit(500) == 64  # a held; other queues: one buffer


def test_claims_skipping_a_held_queue_back_off_until_woken() -> None:
    clock = ManualClock()
    credit = book(clock)
    credit.observe("a", ready=100, consumers=0)
    held = credit.held()
    assert not credit.skip_claim(held)
    pauses = []
    for _ in range(10):
        credit.claimed(0, held)
        start = clock.monotonic()
        while credit.skip_claim(held):
            clock.advance(0.01)
        pauses.append(round(clock.monotonic() - start, 2))
    assert pauses[:2] == [0.02, 0.04] and abs(max(pauses) - HELD_CLAIM_PAUSE_MAX) <= 0.02
    credit.claimed(0, held)
    credit.wake()
    assert not credit.skip_claim(held)
    credit.claimed(0, [])  # nothing held: no pause
    assert not credit.skip_claim(held)


def test_claim_sql_splices_held_queues_and_max_wait_as_validated_literals() -> None:
    sql = claim_sql(64, max_wait=12.5, held=("a", "b.c"))
    code = "\n".join(line for line in sql.splitlines() if not line.lstrip().startswith("--"))
    assert "ARRAY['a','b.c']::text[]" in code and "secs => 12.5" in code and "$" not in code
    assert claim_sql(64, max_wait=12.5, held=("a", "b.c")) is sql
    with pytest.raises(Exception, match="queue"):
        claim_sql(64, held=("x'; DROP TABLE duetime.jobs; --",))
    with pytest.raises(ValueError, match="max_wait"):
        claim_sql(64, max_wait=float("nan"))


def test_a_queue_is_refilled_only_once_its_refill_mark_is_free() -> None:
    """With ``refill`` 0.5 a queue under half its target free is held (no claim of a few
    jobs per sample), then given its whole credit at once; the bound is unchanged."""
    clock = ManualClock()
    credit = DispatchCredit(buffer=100, per_consumer=0, refresh=0.02, clock=clock, refill=0.5)
    credit.observe("a", ready=60, consumers=0)  # 40 free: under the mark of 50
    assert credit.mark("a") == 50 and credit.credit("a") == 40
    assert credit.held() == ["a"] and credit.limit(500) == 64  # other queues: one buffer
    credit.observe("a", ready=50, consumers=0)  # 50 free: refilled, by all of it
    assert credit.held() == [] and credit.limit(500) == 32
    credit.spend(["a"] * 50)
    assert credit.credit("a") == 0 and credit.held() == ["a"]  # never past the target
    jobs = [Job(i, "a") for i in range(5)]
    credit.observe("a", ready=98, consumers=0)
    kept, _ = credit.trim(jobs)
    assert len(kept) == 2  # trim still bounds by the credit itself


def test_the_refill_mark_follows_the_target_and_is_never_zero() -> None:
    clock = ManualClock()
    credit = DispatchCredit(buffer=3, per_consumer=10, refresh=0.02, clock=clock, refill=0.5)
    credit.observe("a", ready=0, consumers=20)  # target 200
    assert credit.mark("a") == 100
    credit.observe("a", ready=0, consumers=0)  # target 3
    assert credit.mark("a") == 2
    lazy = DispatchCredit(buffer=3, per_consumer=0, refresh=0.02, clock=clock)
    lazy.observe("a", ready=2, consumers=0)
    assert lazy.mark("a") == 1 and lazy.held() == []  # refill 0: any credit is used
    with pytest.raises(ValueError, match="refill"):
        DispatchCredit(buffer=3, per_consumer=0, refresh=0.02, clock=clock, refill=1.5)


def test_a_queue_sampled_without_consumers_is_named_until_one_is_counted() -> None:
    """Staging skips a staged queue nobody consumes (``without_consumers``); a queue never
    sampled, or blind, is not named: nothing is known of its consumers."""
    clock = ManualClock()
    credit = book(clock)
    credit.spend(["a", "b", "c"])
    assert credit.without_consumers() == []
    credit.observe("a", ready=3, consumers=0)
    credit.observe("b", ready=0, consumers=2)
    credit.observe_failed("c")
    assert credit.without_consumers() == ["a"]
    credit.observe("a", ready=0, consumers=1)
    assert credit.without_consumers() == []
