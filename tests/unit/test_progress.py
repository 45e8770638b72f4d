"""Progress reports are throttled per job (workers/progress.py): at most one write per
MIN_INTERVAL, the latest report kept and written when the interval has passed, nothing
left running when the attempt ends. The store is a recorder: this is the throttle's
logic; tests/integration/test_job_control.py writes to a real row."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pytest

from scheduler.clock import ManualClock
from scheduler.store.rows import JobRef
from workers.context import JobContext
from workers.progress import MIN_INTERVAL, Progress

REF = JobRef(1, datetime(2026, 1, 1, tzinfo=UTC), 1)


class Recorder:
    def __init__(self) -> None:
        self.writes: list[tuple[float, str | None]] = []

    async def progress(self, ref: JobRef, fraction: float, note: str | None) -> bool:
        self.writes.append((fraction, note))
        return True


async def test_a_tight_loop_writes_once_then_its_last_value_after_the_interval() -> None:
    store, clock = Recorder(), ManualClock()
    progress = Progress(store, REF, clock=clock)  # type: ignore[arg-type]
    for i in range(100):
        await progress.report(i / 100, f"step {i}")
    assert store.writes == [(0.0, "step 0")]
    clock.advance(MIN_INTERVAL)
    await asyncio.sleep(MIN_INTERVAL + 0.1)  # the loop's timer (real time) fires
    assert store.writes == [(0.0, "step 0"), (0.99, "step 99")]
    clock.advance(MIN_INTERVAL)
    await progress.report(1.0, "done")  # the interval passed on the clock: written now
    assert store.writes[-1] == (1.0, "done")
    await progress.close()


class SlowRecorder(Recorder):
    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def progress(self, ref: JobRef, fraction: float, note: str | None) -> bool:
        if self.writes:  # the second write waits, as a slow database would
            await self.gate.wait()
        return await super().progress(ref, fraction, note)


async def test_a_report_made_while_a_deferred_write_is_in_flight_still_lands() -> None:
    store, clock = SlowRecorder(), ManualClock()
    progress = Progress(store, REF, clock=clock)  # type: ignore[arg-type]
    await progress.report(0.1)
    await progress.report(0.2)  # deferred: the timer writes it
    await asyncio.sleep(MIN_INTERVAL + 0.1)  # the deferred write is now in flight
    await progress.report(0.3)  # kept while it is
    store.gate.set()
    await asyncio.sleep(2 * MIN_INTERVAL + 0.1)
    assert store.writes == [(0.1, None), (0.2, None), (0.3, None)]
    await progress.close()


async def test_close_cancels_a_pending_write_and_later_reports_are_dropped() -> None:
    store, clock = Recorder(), ManualClock()
    progress = Progress(store, REF, clock=clock)  # type: ignore[arg-type]
    await progress.report(0.1)
    await progress.report(0.2)
    await progress.close()
    await asyncio.sleep(MIN_INTERVAL + 0.1)
    await progress.report(0.3)
    assert store.writes == [(0.1, None)]


@pytest.mark.parametrize("bad", [-0.1, 1.01, float("nan"), "half", True])
async def test_a_fraction_outside_0_to_1_is_the_handlers_error(bad: Any) -> None:
    ctx = JobContext(
        job_id=1, attempt=1, max_attempts=1, due_at=REF.due_at, task="t", queue="q",
        idempotency_key="k", db=None, beat=None,  # type: ignore[arg-type]
    )  # fmt: skip
    with pytest.raises(ValueError, match="progress must be a number from 0 to 1"):
        await ctx.progress(bad)


async def test_a_long_note_is_cut_to_the_columns_limit() -> None:
    store = Recorder()
    progress = Progress(store, REF, clock=ManualClock())  # type: ignore[arg-type]
    await progress.report(0.5, "n" * 500)
    assert store.writes == [(0.5, "n" * 200)]
