"""A slot is a running handler, from the begin on (``workers.slots``): the prefetch a
worker asks for, its setting, and what a delivery waiting for a slot keeps of a cancel
(``workers.cancel.Cancellations.waiting``)."""

from __future__ import annotations

import asyncio

import pytest

from scheduler.clock import ManualClock
from scheduler.config import load_settings
from scheduler.errors import ConfigError
from workers.cancel import REMEMBER, Cancellations
from workers.consumer import SETTLING_PREFETCH, Consumer, prefetch_for
from workers.slots import HandlerSlot


def test_prefetch_is_the_running_handlers_plus_room_for_batches() -> None:
    assert SETTLING_PREFETCH == 128
    assert prefetch_for(10) == 138  # was 30: a short handler was bound by it
    assert prefetch_for(64) == 192  # as before
    assert prefetch_for(1) == 129
    assert prefetch_for(16, configured=16) == 16


def test_worker_prefetch_is_validated_against_the_concurrency() -> None:
    assert load_settings(env={}).worker_prefetch == 0
    settings = load_settings(
        env={"DUETIME_WORKER_PREFETCH": "20", "DUETIME_WORKER_CONCURRENCY": "8"}
    )
    assert settings.worker_prefetch == 20
    with pytest.raises(ConfigError, match=r"worker_prefetch 4 must be 0 \(automatic\) or at least"):
        load_settings(env={"DUETIME_WORKER_PREFETCH": "4", "DUETIME_WORKER_CONCURRENCY": "8"})
    with pytest.raises(ConfigError, match=r"worker_prefetch.*<= 65535"):
        load_settings(env={"DUETIME_WORKER_PREFETCH": "70000"})


async def test_a_consumer_refuses_a_prefetch_below_its_concurrency() -> None:
    with pytest.raises(ValueError, match="prefetch 3 is below concurrency 4"):
        Consumer(object(), concurrency=4, prefetch=3)  # type: ignore[arg-type]
    assert Consumer(object(), concurrency=4).prefetch == 132  # type: ignore[arg-type]


async def test_a_slot_is_free_until_n_are_taken() -> None:
    semaphore = asyncio.Semaphore(1)
    changes: list[int] = []
    first, second = HandlerSlot(semaphore, changes.append), HandlerSlot(semaphore, changes.append)
    assert first.free() and second.free()
    await first.acquire()
    assert first.free() and not second.free()  # held counts as free for its holder
    first.release()
    assert second.free()
    assert changes == [1, -1]


async def test_a_cancel_heard_while_waiting_for_a_slot_is_kept_however_long_it_waits() -> None:
    clock = ManualClock()
    cancels = Cancellations(shard="main", clock=clock)
    with cancels.waiting(7):
        assert cancels.running() == [7]  # the backstop check asks about waiting jobs
        cancels.cancel([7, 8])  # 8 is neither running nor waiting here
        clock.advance(REMEMBER * 3)
        cancels.forget_old()
    assert cancels.running() == []
    cancels.forget_old()
    assert cancels.heard(7)  # kept through the wait: the handler must not start
    assert not cancels.heard(7)  # told once
    assert not cancels.heard(8)  # an unrelated cancel is still forgotten after REMEMBER


async def test_a_cancel_kept_through_a_wait_ages_from_the_end_of_the_wait() -> None:
    clock = ManualClock()
    cancels = Cancellations(shard="main", clock=clock)
    with cancels.waiting(7), cancels.waiting(7):  # two copies of one job waiting
        cancels.cancel([7])
        clock.advance(REMEMBER * 2)
    clock.advance(REMEMBER - 1)
    cancels.forget_old()
    assert cancels.heard(7)
    with cancels.waiting(9):
        cancels.cancel([9])
    clock.advance(REMEMBER + 1)
    cancels.forget_old()
    assert not cancels.heard(9)
