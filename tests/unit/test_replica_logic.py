"""Pure decisions of the replica: why a term ends, and when to campaign again."""

from __future__ import annotations

import asyncio
import random

import pytest

from scheduler.errors import Fenced, LeadershipLost
from scheduler.leadership.policy import STEP_DOWN_REASONS, recampaign_delay, term_end_reason


def pending() -> asyncio.Future[None]:
    return asyncio.get_running_loop().create_future()


def failed(exc: BaseException) -> asyncio.Future[None]:
    fut = pending()
    fut.set_exception(exc)
    return fut


def returned() -> asyncio.Future[None]:
    fut = pending()
    fut.set_result(None)
    return fut


def cancelled() -> asyncio.Future[None]:
    fut = pending()
    fut.cancel()
    return fut


async def test_lost_lease_wins_over_everything() -> None:
    hold = failed(LeadershipLost("lease_unconfirmed"))
    duties = {"heartbeat": failed(Fenced(3, 5))}
    assert term_end_reason(hold=hold, duties=duties, stopped=True) == (
        "lease_lost",
        "lease_unconfirmed",
    )


@pytest.mark.parametrize(
    ("make_hold", "detail"),
    [
        (lambda: returned(), "hold ended: returned"),
        (lambda: cancelled(), "hold cancelled"),
        (lambda: failed(RuntimeError("bug")), "hold ended: RuntimeError: bug"),
    ],
)
async def test_any_end_of_hold_is_a_lost_lease(make_hold, detail) -> None:  # type: ignore[no-untyped-def]
    assert term_end_reason(hold=make_hold(), duties={}, stopped=False) == ("lease_lost", detail)


async def test_fenced_duty_reports_fenced() -> None:
    reason, detail = term_end_reason(
        hold=pending(), duties={"a": pending(), "hb": failed(Fenced(3, 5))}, stopped=False
    )
    assert reason == "fenced"
    assert detail.startswith("hb: epoch 3 is fenced")


async def test_duty_seeing_lost_leadership_reports_lease_lost() -> None:
    assert term_end_reason(
        hold=pending(), duties={"d": failed(LeadershipLost("x"))}, stopped=False
    ) == ("lease_lost", "d: x")


@pytest.mark.parametrize(
    ("make_task", "detail"),
    [
        (lambda: returned(), "d: returned"),
        (lambda: cancelled(), "d: cancelled"),
        (lambda: failed(KeyError("k")), "d: KeyError: 'k'"),
    ],
)
async def test_a_dead_duty_ends_the_term(make_task, detail) -> None:  # type: ignore[no-untyped-def]
    assert term_end_reason(hold=pending(), duties={"d": make_task()}, stopped=False) == (
        "duty_exited",
        detail,
    )


async def test_stop_only_when_nothing_else_ended() -> None:
    assert term_end_reason(hold=pending(), duties={"d": pending()}, stopped=True) == (
        "stopped",
        "stop requested",
    )
    with pytest.raises(ValueError):
        term_end_reason(hold=pending(), duties={"d": pending()}, stopped=False)


async def test_reasons_are_a_bounded_label_set() -> None:
    cases = [
        term_end_reason(hold=failed(LeadershipLost("a")), duties={}, stopped=False),
        term_end_reason(hold=pending(), duties={"d": failed(Fenced(1, 2))}, stopped=False),
        term_end_reason(hold=pending(), duties={"d": returned()}, stopped=False),
        term_end_reason(hold=pending(), duties={}, stopped=True),
    ]
    assert {reason for reason, _ in cases} <= set(STEP_DOWN_REASONS)


def test_recampaign_is_immediate_after_a_healthy_term() -> None:
    assert recampaign_delay(0, ttl=10) == 0.0


def test_recampaign_backs_off_after_short_terms_and_is_capped() -> None:
    random.seed(7)
    ttl = 2.0
    first = [recampaign_delay(1, ttl) for _ in range(200)]
    assert all(ttl / 8 <= d <= ttl / 4 for d in first)  # never zero: no flapping
    later = [recampaign_delay(n, ttl) for n in range(1, 40) for _ in range(5)]
    assert max(later) <= ttl * 4
    assert min(recampaign_delay(30, ttl) for _ in range(50)) >= ttl * 2
