"""``Snooze``: a handler sends its job back to ``pending`` for later without using an
attempt (DESIGN §12).

``raise Snooze(in_=60)`` (or ``await ctx.snooze(60)``, which raises it) ends the
attempt like a failure does — its ``ctx.db`` work is rolled back — but the job goes back
to ``pending`` at the same attempt, runnable ``in_`` seconds from now, and its
``snoozes`` count goes up by one (``duetime.worker_snooze``, migration 0019). The count
is bounded by the row's ``max_snoozes`` (default 100): one snooze more is a failed
attempt with a clear error (retried or dead like any failure), so a handler that keeps
snoozing cannot keep its job alive forever. For "try again, and count it", raise
``Retry``.
"""

from __future__ import annotations

import math
from datetime import timedelta

from workers.retry import MAX_RETRY_DELAY

__all__ = ["Snooze", "SnoozeLimitReached"]


class Snooze(Exception):
    """Raise from a handler to run the job again ``in_`` seconds from now, at the same
    attempt (no attempt is used; the job's ``snoozes`` count goes up)."""

    def __init__(self, in_: float | timedelta, reason: str | None = None) -> None:
        seconds = in_.total_seconds() if isinstance(in_, timedelta) else float(in_)
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"Snooze delay must be a finite number of seconds >= 0, not {in_!r}")
        self.delay = min(seconds, MAX_RETRY_DELAY)
        self.reason = reason
        super().__init__(reason or f"snoozed for {seconds:g}s")


class SnoozeLimitReached(Exception):
    """The job asked to snooze once more than its ``max_snoozes`` allows: a failed
    attempt."""
