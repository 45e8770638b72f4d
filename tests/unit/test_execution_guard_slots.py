"""Which guard slot a begin read runs on (scheduler/store/execution_guard.py): the
choice is pure, so it is checked without a database."""

from __future__ import annotations

from typing import Any, cast

from scheduler.store.conn import Conn, Pooled
from scheduler.store.execution_guard import AttemptGuard


def guard() -> AttemptGuard:
    return AttemptGuard(cast(Pooled, None), begin_sql="", release_sql="", slots=4)


def test_a_begin_carries_pending_releases_then_reuses_a_held_connection() -> None:
    g = guard()
    slots = g._slots
    assert g._free_slot() is slots[0]  # nothing to prefer: the first
    slots[3].conn = cast(Conn, object())
    assert g._free_slot() is slots[3]  # no other connection taken from the pool
    slots[2].releasing.append((7, 1, 1))
    assert g._free_slot() is slots[2]  # its releases ride along with the read


def test_a_begin_of_an_attempt_being_released_goes_to_the_session_that_holds_it() -> None:
    g = guard()
    slots = g._slots
    slots[1].releasing.append((7, 1, 1))
    slots[2].releasing.append((8, 1, 1))
    assert g._free_slot([(8, 1, 1)]) is slots[2]


async def test_busy_slots_are_skipped_and_all_busy_means_the_fewest_locks() -> None:
    g = guard()
    slots = g._slots
    slots[2].releasing.append((7, 1, 1))
    locks: list[Any] = [slot.lock for slot in slots]
    await locks[2].acquire()
    assert g._free_slot() is slots[0]
    for lock in (locks[0], locks[1], locks[3]):
        await lock.acquire()
    slots[0].held.update({(1, 1, 1), (2, 1, 1)})
    slots[1].held.add((3, 1, 1))
    slots[2].held.add((4, 1, 1))
    slots[3].held.update({(5, 1, 1), (6, 1, 1)})
    assert g._free_slot() is slots[1]
