"""``await ctx.progress(0.4, "copied 4 of 10 files")``: how far a running job got, on its
row (DESIGN §12; migration 0019: ``progress``, ``progress_note``, ``progress_at``).

A report is written on a pooled connection of the worker's own, in autocommit
(``duetime.worker_progress``, which changes only the row ``dispatched`` at this
attempt), never in the attempt's ``ctx.db`` transaction: it is visible while the
handler runs, it survives the handler failing, and the commit of the handler's work
waits for nothing of it. Reports are throttled per job: at most one write every
``MIN_INTERVAL`` seconds; a report arriving sooner is kept, and the latest one kept is
written when the interval has passed (a timer, cancelled when the handler ends), so a
handler may report in a tight loop and the last value still lands. A handler that
never reports costs nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import math

from scheduler.clock import SYSTEM_CLOCK, Clock
from scheduler.log import get_logger
from scheduler.store.execution import ExecutionStore
from scheduler.store.rows import JobRef

__all__ = ["MAX_NOTE_CHARS", "MIN_INTERVAL", "Progress", "check_fraction"]

log = get_logger("duetime.worker")

#: Seconds between two progress writes of one job (at most 4 writes a second).
MIN_INTERVAL = 0.25
#: The longest note kept (CHECK jobs_progress_note_too_long); longer ones are cut.
MAX_NOTE_CHARS = 200


def check_fraction(fraction: float) -> float:
    """``fraction`` as a float in 0..1, else ``ValueError`` (a handler's bug: it is told
    at once rather than its report dropped)."""
    if isinstance(fraction, bool) or not isinstance(fraction, int | float):
        raise ValueError(f"progress must be a number from 0 to 1, not {fraction!r}")
    value = float(fraction)
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"progress must be a number from 0 to 1, not {fraction!r}")
    return value


class Progress:
    """One attempt's progress reports (module docstring); ``close()`` when it ends."""

    def __init__(self, store: ExecutionStore, ref: JobRef, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self._store = store
        self._ref = ref
        self._clock = clock
        self._written_at: float | None = None
        self._pending: tuple[float, str | None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._flush: asyncio.Task[None] | None = None
        self._closed = False

    async def report(self, fraction: float, note: str | None = None) -> None:
        value = check_fraction(fraction)
        if note is not None:
            note = str(note).replace("\x00", "")[:MAX_NOTE_CHARS]
        if self._closed:
            return
        now = self._clock.monotonic()
        due = self._written_at is None or now - self._written_at >= MIN_INTERVAL
        if due and self._flush is None:
            self._pending = None
            self._cancel_timer()
            await self._write(value, note)
            return
        self._pending = (value, note)
        if self._timer is None and self._flush is None:
            wait = MIN_INTERVAL - (now - (self._written_at or now))
            self._timer = asyncio.get_running_loop().call_later(max(0.0, wait), self._later)

    def _later(self) -> None:
        self._timer = None
        if self._pending is not None and not self._closed:
            self._flush = asyncio.create_task(self._write_pending(), name="duetime-progress")

    async def _write_pending(self) -> None:
        try:
            pending, self._pending = self._pending, None
            if pending is not None:
                await self._write(*pending)
        finally:
            self._flush = None
        if self._pending is not None and not self._closed and self._timer is None:
            # reported while this write was in flight: written one interval later
            self._timer = asyncio.get_running_loop().call_later(MIN_INTERVAL, self._later)

    async def _write(self, value: float, note: str | None) -> None:
        self._written_at = self._clock.monotonic()
        try:
            await self._store.progress(self._ref, value, note)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a lost report is not worth failing the job for
            log.warning("progress_not_recorded", error=f"{type(exc).__name__}: {exc}")

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def close(self) -> None:
        """Stop: the timer cancelled, a write in flight ended (the attempt is over; a
        report not yet written is dropped)."""
        self._closed = True
        self._cancel_timer()
        flush, self._flush = self._flush, None
        if flush is not None:
            flush.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flush
