"""The upper bound on dispatched jobs that lets a claim no limit can bind skip the count
(scheduler.duties.limits.RunningBound)."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.duties.limits import RunningBound
from scheduler.store.limits import Limit, Running


@dataclass(frozen=True)
class J:
    task: str
    queue: str = "default"


CAP = [Limit("task:mail", 1000)]


def test_without_an_exact_count_in_this_term_nothing_is_slack() -> None:
    bound = RunningBound(max_age=1.0)
    assert not bound.slack(1, CAP, 10, now=0.0)


def test_every_job_dispatched_since_the_count_is_charged_until_the_cap_binds() -> None:
    bound = RunningBound(max_age=1.0)
    bound.observe(1, CAP, [Running("mail", "default", "", 480)], now=0.0)
    assert bound.slack(1, CAP, 500, now=0.1)  # 480 + 500 <= 1000
    bound.charge(1, [J("mail")] * 20 + [J("other")] * 100)  # only mail's count
    assert bound.bound("task:mail") == 500
    assert bound.slack(1, CAP, 500, now=0.2)  # 500 + 500
    bound.charge(1, [J("mail")])
    assert not bound.slack(1, CAP, 500, now=0.3)  # 501 + 500: count again


def test_a_queue_limit_and_a_task_limit_are_both_charged() -> None:
    limits = [Limit("task:mail", 100), Limit("queue:q", 100)]
    bound = RunningBound(max_age=1.0)
    bound.observe(1, limits, [Running("mail", "q", "a", 3), Running("x", "q", "b", 4)], now=0)
    assert (bound.bound("task:mail"), bound.bound("queue:q")) == (3, 7)
    bound.charge(1, [J("mail", "q"), J("y", "q")])
    assert (bound.bound("task:mail"), bound.bound("queue:q")) == (4, 9)


def test_a_new_term_a_change_of_limits_or_an_old_count_needs_a_new_count() -> None:
    bound = RunningBound(max_age=1.0)
    bound.observe(1, CAP, [], now=0.0)
    assert bound.slack(1, CAP, 10, now=0.5)
    assert not bound.slack(2, CAP, 10, now=0.5)  # another leader may have dispatched
    assert not bound.slack(1, [Limit("task:mail", 999)], 10, now=0.5)
    assert not bound.slack(1, [*CAP, Limit("task:sms", 1000)], 10, now=0.5)
    assert not bound.slack(1, CAP, 10, now=1.0)  # max_age
    bound.charge(2, [J("mail")])  # another term's charge is no part of this bound
    assert bound.bound("task:mail") == 0
    bound.reset()
    assert not bound.slack(1, CAP, 10, now=0.5)


def test_rates_and_fair_queues_are_never_slack_by_the_bound() -> None:
    for lim in (
        Limit("task:mail", 1000, rate_count=10_000, rate_period=1),
        Limit("queue:q", None, fair=True),
    ):
        bound = RunningBound(max_age=1.0)
        bound.observe(1, [lim], [], now=0.0)
        assert not bound.slack(1, [lim], 1, now=0.0)


def test_a_per_key_cap_is_bounded_by_the_whole_targets_count() -> None:
    per_key = [Limit("task:mail", 100, per_key=True)]
    bound = RunningBound(max_age=1.0)
    rows = [Running("mail", "default", "a", 40), Running("mail", "default", "b", 40)]
    bound.observe(1, per_key, rows, now=0.0)
    assert bound.slack(1, per_key, 20, now=0.0)  # 80 + 20: no key can pass 100
    assert not bound.slack(1, per_key, 21, now=0.0)
