"""The pure allowance arithmetic of concurrency limits (scheduler.duties.limits)."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.duties.limits import Allowance
from scheduler.store.limits import Limit, Running, Started


@dataclass(frozen=True)
class J:
    task: str
    queue: str = "default"
    limit_key: str = ""


def test_room_is_the_limit_minus_what_is_dispatched() -> None:
    a = Allowance([Limit("task:mail", 5)], [Running("mail", "default", "", 3)])
    assert a.room(a.limits["task:mail"]) == 2
    kept, left = a.take([J("mail")] * 4, limit=100)
    assert len(kept) == 2 and len(left) == 2
    assert a.closed().tasks == ("mail",)


def test_counts_of_every_key_add_up_for_a_plain_limit() -> None:
    running = [Running("mail", "default", "a", 2), Running("mail", "default", "b", 2)]
    a = Allowance([Limit("task:mail", 4)], running)
    assert a.take([J("mail")], limit=10) == ([], [J("mail")])
    assert a.holding()


def test_per_key_limit_counts_each_key_apart() -> None:
    a = Allowance([Limit("task:mail", 1, per_key=True)], [Running("mail", "q", "a", 1)])
    jobs = [J("mail", "q", "a"), J("mail", "q", "b"), J("mail", "q", "b"), J("mail", "q", "")]
    kept, left = a.take(jobs, limit=10)
    assert kept == [J("mail", "q", "b"), J("mail", "q", "")]
    assert left == [J("mail", "q", "a"), J("mail", "q", "b")]
    closed = a.closed()
    assert set(closed.task_keys) == {("mail", "a"), ("mail", "b"), ("mail", "")}
    assert closed.tasks == ()


def test_a_job_under_two_limits_needs_room_in_both_and_is_charged_to_both() -> None:
    a = Allowance([Limit("task:mail", 10), Limit("queue:q", 2)], [])
    kept, left = a.take([J("mail", "q"), J("other", "q"), J("mail", "q")], limit=10)
    assert kept == [J("mail", "q"), J("other", "q")]
    assert left == [J("mail", "q")]
    assert a.room(a.limits["task:mail"]) == 9
    assert a.closed().queues == ("q",)


def test_the_batch_limit_bounds_what_is_kept() -> None:
    a = Allowance([Limit("task:mail", 100)], [])
    kept, left = a.take([J("mail")] * 5, limit=3)
    assert (len(kept), len(left)) == (3, 2)


def test_counts_of_unlimited_targets_are_ignored() -> None:
    a = Allowance([Limit("queue:q", 1)], [Running("mail", "other", "", 50)])
    assert not a.holding()
    assert a.skip_queues == ("q",) and a.skip_tasks == ()


def test_all_closed_only_when_every_plain_limit_is_full() -> None:
    full = [Running("mail", "q", "", 2)]
    assert Allowance([Limit("task:mail", 2)], full).all_closed()
    assert not Allowance([Limit("task:mail", 2), Limit("queue:other", 1)], full).all_closed()
    assert not Allowance([Limit("task:mail", 2, per_key=True)], full).all_closed()


def test_a_fair_queue_without_a_cap_caps_nothing_and_is_never_closed() -> None:
    a = Allowance([Limit("queue:q", None, fair=True)], [Running("mail", "q", "a", 99)])
    assert a.fair_queues == ("q",)
    assert not a.all_closed() and not a.holding()
    kept, left = a.take([J("mail", "q", "a")] * 3, limit=10)
    assert (len(kept), left) == (3, [])


def test_a_full_fair_queue_with_a_cap_offers_no_fair_claim() -> None:
    a = Allowance([Limit("queue:q", 2, fair=True)], [Running("mail", "q", "a", 2)])
    assert a.fair_queues == ()
    assert a.closed().queues == ("q",)


# -- rates (migration 0018) ------------------------------------------------------------


def rate(target: str, count: int, *, per_key: bool = False, running: int | None = None) -> Limit:
    return Limit(target, running, per_key=per_key, rate_count=count, rate_period=1)


def test_a_rate_leaves_its_count_minus_the_starts_in_the_window() -> None:
    a = Allowance([rate("task:mail", 5)], [], [Started("task:mail", "", 3, 0.4)])
    kept, left = a.take([J("mail")] * 4, limit=100)
    assert (len(kept), len(left)) == (2, 2)
    assert a.closed().tasks == ("mail",)
    assert a.all_closed()
    assert a.free_in() == 0.4  # the oldest start leaves the window then
    assert a.rate_starts(kept) == {("task:mail", ""): 2}


def test_a_rate_with_room_holds_nothing_and_has_no_wake_time() -> None:
    a = Allowance([rate("task:mail", 5)], [], [Started("task:mail", "", 1, 0.9)])
    assert a.room(a.limits["task:mail"]) == 4
    assert a.free_in() is None
    assert not a.holding()


def test_rate_and_running_cap_together_leave_the_smaller_room() -> None:
    lim = rate("task:mail", 10, running=3)
    a = Allowance([lim], [Running("mail", "default", "", 2)], [Started("task:mail", "", 4, 0.5)])
    assert a.room(lim) == 1  # 3 - 2 running, not 10 - 4 started
    a = Allowance([lim], [], [Started("task:mail", "", 9, 0.5)])
    assert a.room(lim) == 1  # 10 - 9 started, not 3 - 0 running


def test_a_per_key_rate_counts_each_key_apart() -> None:
    lim = rate("queue:q", 2, per_key=True)
    a = Allowance([lim], [], [Started("queue:q", "a", 2, 0.3), Started("queue:q", "b", 1, 0.6)])
    jobs = [J("x", "q", "a"), J("x", "q", "b"), J("x", "q", "b"), J("x", "q", "c")]
    kept, left = a.take(jobs, limit=10)
    assert kept == [J("x", "q", "b"), J("x", "q", "c")]
    assert left == [J("x", "q", "a"), J("x", "q", "b")]
    assert set(a.closed().queue_keys) == {("q", "a"), ("q", "b")}
    assert not a.all_closed()  # a key not seen yet has room
    assert a.rate_starts(kept) == {("queue:q", "b"): 1, ("queue:q", "c"): 1}


def test_starts_of_a_removed_rate_bind_nothing() -> None:
    a = Allowance([Limit("task:mail", 5)], [], [Started("task:mail", "", 50, 0.2)])
    assert a.room(a.limits["task:mail"]) == 5
    assert not a.rated
    assert a.rate_starts([J("mail")]) == {}


def test_rate_text_round_trips() -> None:
    assert rate("task:x", 100).rate == "100/s"
    assert Limit("task:x", None, rate_count=5, rate_period=60).rate == "5/min"
    assert Limit("task:x", 3).rate is None


def test_bound_is_the_room_of_a_single_limit_only() -> None:
    limits = [Limit("task:mail", 5), rate("queue:q", 10)]
    a = Allowance(limits, [Running("mail", "q", "", 2)], [Started("queue:q", "", 4, 0.5)])
    assert a.bound([limits[0]]) == 3
    assert a.bound([limits[1]]) == 6
    # two limits: a bound filled by one target's jobs could starve the other's
    assert a.bound(limits) is None
    assert a.bound([Limit("task:x", 1, per_key=True)]) is None


def test_slack_only_when_every_plain_cap_has_room_for_the_whole_claim() -> None:
    running = [Running("mail", "default", "", 10)]
    assert Allowance([Limit("task:mail", 1000)], running).slack(500)
    assert not Allowance([Limit("task:mail", 500)], running).slack(500)  # 490 left
    per_key = [Running("mail", "q", "a", 600), Running("mail", "q", "b", 1)]
    assert not Allowance([Limit("task:mail", 1000, per_key=True)], per_key).slack(500)
    assert Allowance([Limit("task:mail", 1200, per_key=True)], per_key).slack(500)
    assert not Allowance([rate("task:mail", 100_000)], []).slack(1)  # a rate always binds
    assert not Allowance([Limit("queue:q", None, fair=True)], []).slack(1)  # fair orders
    assert Allowance([], []).slack(500)
