"""workers.batching.Coalescer: concurrent submits become few flushes, results and errors
reach the right callers, and close() leaves nothing running (pure asyncio, no services)."""

from __future__ import annotations

import asyncio

import pytest

from workers.batching import Coalescer

pytestmark = pytest.mark.timeout(10)


async def test_callers_of_one_loop_turn_share_one_flush() -> None:
    seen: list[list[int]] = []

    async def flush(items: list[int]) -> list[int]:
        seen.append(items)
        return [i * 10 for i in items]

    c: Coalescer[int, int] = Coalescer(flush, name="t", max_batch=100)
    assert await asyncio.gather(*(c.submit(i) for i in range(50))) == [i * 10 for i in range(50)]
    assert seen == [list(range(50))]
    await c.close()


async def test_batches_grow_while_flushes_are_busy_and_respect_the_limits() -> None:
    gate = asyncio.Event()
    sizes: list[int] = []
    in_flight = 0
    peak = 0

    async def flush(items: list[int]) -> list[int]:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        sizes.append(len(items))
        await gate.wait()
        in_flight -= 1
        return items

    c: Coalescer[int, int] = Coalescer(flush, name="t", max_batch=8, max_flushes=2)
    first = [asyncio.ensure_future(c.submit(i)) for i in range(3)]
    await asyncio.sleep(0.01)
    later = [asyncio.ensure_future(c.submit(i)) for i in range(3, 40)]
    await asyncio.sleep(0.01)
    gate.set()
    assert await asyncio.gather(*first, *later) == list(range(40))
    assert peak <= 2 and max(sizes) <= 8 and sum(sizes) == 40
    assert len(sizes) < 40  # coalesced
    await c.close()


async def test_a_failed_flush_fails_its_callers_only() -> None:
    calls = 0

    async def flush(items: list[int]) -> list[int]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ConnectionError("database away")
        return items

    c: Coalescer[int, int] = Coalescer(flush, name="t")
    with pytest.raises(ConnectionError):
        await c.submit(1)
    assert await c.submit(2) == 2
    await c.close()


async def test_close_cancels_flushes_and_waiting_callers() -> None:
    async def flush(items: list[int]) -> list[int]:
        await asyncio.sleep(60)
        return items

    c: Coalescer[int, int] = Coalescer(flush, name="t")
    waiting = asyncio.ensure_future(c.submit(1))
    await asyncio.sleep(0.01)
    await c.close()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    with pytest.raises(RuntimeError, match="closed"):
        await c.submit(2)


@pytest.mark.parametrize("ordered", [True, False])
async def test_an_ordered_coalescer_answers_in_submit_order_whichever_flush_returns_first(
    ordered: bool,
) -> None:
    """Two flushes in flight; the first is slower. Ordered, its callers are still
    answered first (the worker's begin read: slots are taken in arrival order); a
    failure of the first batch does not hold the second back for ever."""
    first_gate = asyncio.Event()
    answered: list[int] = []

    async def flush(items: list[int]) -> list[int]:
        if 0 in items:
            await first_gate.wait()
            if 99 in items:
                raise RuntimeError("first batch failed")
        return items

    c: Coalescer[int, int] = Coalescer(flush, name="t", max_batch=1, ordered=ordered)

    async def call(i: int) -> None:
        try:
            await c.submit(i)
        except RuntimeError:
            pass
        answered.append(i)

    calls = [asyncio.create_task(call(i)) for i in (0, 1)]
    await asyncio.sleep(0.05)  # the second batch returned meanwhile
    assert answered == ([] if ordered else [1])
    first_gate.set()
    await asyncio.gather(*calls)
    assert answered == ([0, 1] if ordered else [1, 0])

    first_gate.clear()
    answered.clear()
    c2: Coalescer[int, int] = Coalescer(flush, name="t", max_batch=2, ordered=ordered)
    calls = [asyncio.create_task(call2) for call2 in (c2.submit(0), c2.submit(99), c2.submit(5))]
    await asyncio.sleep(0.05)
    first_gate.set()
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert isinstance(results[0], RuntimeError) and results[2] == 5
    await c.close()
    await c2.close()
