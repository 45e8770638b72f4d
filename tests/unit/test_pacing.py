"""The dispatcher's pacing, driven by a ``ManualClock``: no sleeps, no services."""

from __future__ import annotations

import random

import pytest

from scheduler.clock import ManualClock
from scheduler.duties.pacing import BatchReport, DispatchPacing

BATCH = 10
PROBE = 0.05


def pacing(clock: ManualClock | None = None, *, backlog_interval: float = 5.0) -> DispatchPacing:
    return DispatchPacing(
        batch_size=BATCH,
        probe_interval=PROBE,
        backlog_interval=backlog_interval,
        clock=clock or ManualClock(),
        rng=random.Random(7),
    )


def test_an_idle_pass_probes_and_sleeps_at_most_the_probe_interval() -> None:
    p = pacing()
    assert p.should_probe()
    assert p.after_probe(None) == PROBE  # nothing pending
    assert p.after_probe(3.0) == PROBE  # due later than the cap: re-probe at the cap
    assert p.should_probe()


def test_a_job_due_within_the_cap_arms_the_timer_and_the_next_pass_claims_without_probing() -> None:
    clock = ManualClock()
    p = pacing(clock)
    assert p.should_probe()
    assert p.after_probe(0.02) == pytest.approx(0.02)
    clock.advance(0.02)
    assert not p.should_probe()  # the timer is up: claim at once
    assert p.should_probe()  # the timer is consumed


def test_a_pass_woken_before_the_timer_probes_again() -> None:
    clock = ManualClock()
    p = pacing(clock)
    p.after_probe(0.04)
    clock.advance(0.01)  # a NOTIFY woke the loop early
    assert p.should_probe()


def test_a_due_probe_answer_means_claim_now() -> None:
    p = pacing()
    assert p.after_probe(0.0) is None
    assert p.after_probe(-1.5) is None


def test_a_full_batch_means_a_backlog_claimed_back_to_back_without_probing() -> None:
    p = pacing()
    assert p.after_batch(BatchReport(claimed=BATCH, published=BATCH), probed=True) == 0.0
    assert p.in_backlog
    assert not p.should_probe()
    assert p.after_batch(BatchReport(claimed=3, published=3), probed=False) is None
    assert not p.in_backlog
    assert p.should_probe()


def test_an_empty_claim_after_a_due_probe_looks_again_after_the_probe_interval() -> None:
    p = pacing()
    assert p.after_batch(BatchReport(), probed=True) == PROBE
    # the same empty claim reached without a probe (the timer fired) probes next
    assert p.after_batch(BatchReport(), probed=False) is None


def test_failed_publishes_back_off_with_a_growing_ceiling_unless_a_full_batch_went_out() -> None:
    p = pacing()
    delays = [
        p.after_batch(BatchReport(claimed=2, published=0, failed=2), probed=True) for _ in range(4)
    ]
    assert p.failed_passes == 4
    for n, delay in enumerate(delays, start=1):
        ceiling = min(5.0, 0.1 * 2 ** (n - 1))
        assert delay is not None and ceiling / 2 <= delay <= ceiling
    # a full batch of which some went out keeps claiming
    assert p.after_batch(BatchReport(claimed=BATCH, published=1, failed=9), probed=False) == 0.0
    assert p.in_backlog
    # a clean batch resets the count
    p.after_batch(BatchReport(claimed=1, published=1), probed=False)
    assert p.failed_passes == 0


def test_a_lost_race_leaves_the_backlog_and_retries_soon() -> None:
    p = pacing()
    p.after_batch(BatchReport(claimed=BATCH, published=BATCH), probed=True)
    delay = p.after_conflict()
    assert 0.01 <= delay <= 0.02
    assert not p.in_backlog


def test_reset_makes_the_next_pass_probe() -> None:
    p = pacing()
    p.after_batch(BatchReport(claimed=BATCH, published=BATCH), probed=True)
    p.reset()
    assert p.should_probe()


def test_idle_clears_an_armed_timer() -> None:
    clock = ManualClock()
    p = pacing(clock)
    p.after_probe(0.03)
    assert p.idle(None) == PROBE
    clock.advance(1.0)
    assert p.should_probe()


def test_the_backlog_is_sampled_at_most_once_per_interval() -> None:
    clock = ManualClock()
    p = pacing(clock, backlog_interval=5.0)
    assert p.backlog_sample_due()
    assert not p.backlog_sample_due()
    clock.advance(4.9)
    assert not p.backlog_sample_due()
    clock.advance(0.1)
    assert p.backlog_sample_due()
