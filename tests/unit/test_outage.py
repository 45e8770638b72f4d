"""workers.outage: a delivery that could not reach its database waits until it answers
again (a probe, or a delivery that committed), at most ``cap`` seconds, and a probe that
answers while deliveries keep failing cannot make a hot loop."""

from __future__ import annotations

import asyncio
import random

import pytest

from scheduler.clock import ManualClock
from workers.outage import Outage

CAP = 10.0


class Probe:
    """Fails ``failures`` times, then answers (or never, with ``failures=None``)."""

    def __init__(self, failures: int | None) -> None:
        self.failures = failures
        self.calls = 0

    async def __call__(self) -> None:
        self.calls += 1
        if self.failures is None or self.calls <= self.failures:
            raise ConnectionError("connection refused")


async def run_until_done(
    clock: ManualClock, task: asyncio.Task[float], step: float = 0.05
) -> float:
    """Advance the clock in small steps until ``task`` is done (bounded)."""
    for _ in range(int(3 * CAP / step)):
        for _ in range(5):
            await asyncio.sleep(0)
        if task.done():
            return task.result()
        clock.advance(step)
    raise AssertionError("the wait never ended")


def outage(probe: Probe, clock: ManualClock) -> Outage:
    return Outage(
        probe, cap=CAP, probe_timeout=1.0, shard="main", clock=clock, rng=random.Random(7)
    )


async def test_a_wait_ends_when_the_probe_answers_not_at_the_cap() -> None:
    clock = ManualClock()
    probe = Probe(failures=2)
    o = outage(probe, clock)
    waited = await run_until_done(clock, asyncio.create_task(o.wait()))
    # probes every 0.125-0.25 s, then 0.25-0.5, then 0.5-1: the third answers
    assert probe.calls == 3
    assert 0.4 <= waited <= 1.8
    await o.close()


async def test_every_waiting_delivery_is_woken_by_one_probe() -> None:
    clock = ManualClock()
    probe = Probe(failures=1)
    o = outage(probe, clock)
    waits = [asyncio.create_task(o.wait()) for _ in range(50)]
    await run_until_done(clock, waits[0])
    for _ in range(5):
        await asyncio.sleep(0)
    assert all(w.done() for w in waits)
    assert probe.calls == 2  # one probe at a time, not one per delivery
    assert o.waiting == 0
    await o.close()


async def test_a_commit_wakes_the_waiting_deliveries_at_once() -> None:
    clock = ManualClock()
    o = outage(Probe(failures=None), clock)
    waits = [asyncio.create_task(o.wait()) for _ in range(3)]
    for _ in range(5):
        await asyncio.sleep(0)
    clock.advance(0.1)
    o.committed()  # another delivery of the shard committed: the database answers
    for _ in range(10):
        await asyncio.sleep(0)
    assert all(w.done() for w in waits)
    assert [w.result() for w in waits] == [pytest.approx(0.1)] * 3
    assert o.failures == 0
    await o.close()


async def test_a_database_that_never_answers_is_waited_out_at_the_cap() -> None:
    clock = ManualClock()
    probe = Probe(failures=None)
    o = outage(probe, clock)
    waited = await run_until_done(clock, asyncio.create_task(o.wait()))
    assert CAP <= waited <= CAP + 0.1
    # probed at a growing interval, capped at 2 s: not a loop
    assert 5 <= probe.calls <= 10
    await o.close()


async def test_a_probe_that_answers_while_deliveries_keep_failing_raises_a_floor() -> None:
    clock = ManualClock()
    o = outage(Probe(failures=0), clock)  # answers every time
    waits = []
    for _ in range(7):  # every delivery fails again after its wake-up (no commit)
        waits.append(await run_until_done(clock, asyncio.create_task(o.wait())))
    assert waits[0] <= 0.35  # the first probe (0.125-0.25 s), in 0.05 s steps
    assert waits[-1] >= 4.0  # floor: 0.25 s doubling per wake-up no commit followed
    assert waits[-1] > waits[3] > waits[1]
    o.committed()  # a delivery committed: the floor is gone
    assert await run_until_done(clock, asyncio.create_task(o.wait())) <= 0.35
    await o.close()


async def test_close_stops_the_probe() -> None:
    clock = ManualClock()
    probe = Probe(failures=None)
    o = outage(probe, clock)
    wait = asyncio.create_task(o.wait())
    for _ in range(5):
        await asyncio.sleep(0)
    await o.close()
    calls = probe.calls
    assert await run_until_done(clock, wait) >= CAP  # a wait still ends, at the cap
    assert probe.calls == calls
