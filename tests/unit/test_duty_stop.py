"""``Duty.stop()`` ends the loop even when it lands in a teardown.

A pass that fails is followed by a teardown (shielded, so it completes). A ``stop()``
arriving during that teardown must still end the task once the teardown is done,
instead of the loop sleeping and running passes until someone cancels it again.
"""

from __future__ import annotations

import asyncio

from scheduler.duties.base import DutyLoop, LeaderTerm


class FailingDuty:
    name = "failing"

    def __init__(self) -> None:
        self.loop = DutyLoop(self)
        self.in_teardown = asyncio.Event()
        self.release = asyncio.Event()
        self.passes = 0
        self.teardowns_done = 0

    async def run_once(self) -> float:
        self.passes += 1
        raise RuntimeError("the database went away")

    async def teardown(self) -> None:
        self.in_teardown.set()
        await self.release.wait()
        self.teardowns_done += 1


async def test_stop_during_the_teardown_after_a_failed_pass_ends_the_loop() -> None:
    duty = FailingDuty()
    task = duty.loop.start(LeaderTerm(1, "n"))
    await asyncio.wait_for(duty.in_teardown.wait(), 2)
    stopping = asyncio.ensure_future(duty.loop.stop())
    await asyncio.sleep(0)  # stop() has cancelled the task; the teardown still runs
    assert not stopping.done()
    duty.release.set()
    await asyncio.wait_for(stopping, 2)
    assert task.done()
    assert duty.passes == 1  # no pass ran after stop()
    assert duty.teardowns_done >= 1


class SwallowingDuty:
    """A pass that answers its cancellation with another error, as asyncpg does for a
    query cancelled on a connection that died meanwhile."""

    name = "swallowing"

    def __init__(self) -> None:
        self.loop = DutyLoop(self)
        self.running = asyncio.Event()
        self.passes = 0

    async def run_once(self) -> float:
        self.passes += 1
        self.running.set()
        try:
            await asyncio.Event().wait()  # a query that never answers
        except asyncio.CancelledError:
            raise RuntimeError("Transaction.__aexit__(): the connection is closed") from None
        return 0.0


async def test_stop_ends_the_loop_when_the_pass_turns_cancellation_into_an_error() -> None:
    duty = SwallowingDuty()
    task = duty.loop.start(LeaderTerm(1, "n"))
    await asyncio.wait_for(duty.running.wait(), 2)
    await asyncio.wait_for(duty.loop.stop(), 2)
    assert task.done() and task.cancelled()
    assert duty.passes == 1
    assert duty.loop.failures == 0  # a stop is not a failed pass
