"""The pure allowance arithmetic of concurrency limits (scheduler.duties.limits)."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.duties.limits import Allowance
from scheduler.store.limits import Limit, Running


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
