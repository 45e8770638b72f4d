"""Deterministic jitter: spreading a schedule's fires without making them random.

Thousands of schedules on ``0 * * * *`` would all fall due in the same second; a
schedule's ``jitter`` delays each fire by up to that many seconds. The delay is a hash
of the schedule and the fire time, not a random draw, so every replica and every retry
of a planner pass computes the same ``due_at`` for the same fire time (a new leader
re-planning a fire never moves it).
"""

from __future__ import annotations

import hashlib
import math
from datetime import datetime, timedelta

from scheduler.cron import as_utc

__all__ = ["deterministic_jitter"]


def deterministic_jitter(schedule_key: str, fire_time: datetime, max_seconds: float) -> timedelta:
    """A delay in ``[0, max_seconds)`` spreading a schedule's fires, the same on every
    replica and every retry: a blake2b hash of (key, fire time in UTC), microsecond grain."""
    if not math.isfinite(max_seconds) or max_seconds < 0:
        raise ValueError(f"jitter must be a finite number of seconds >= 0, got {max_seconds!r}")
    instant = as_utc(fire_time, "fire_time")
    span = int(max_seconds * 1_000_000)
    if span <= 0:
        return timedelta(0)
    digest = hashlib.blake2b(
        f"{schedule_key}\x00{instant.isoformat()}".encode(), digest_size=8, person=b"duetime-jitter"
    ).digest()
    return timedelta(microseconds=(int.from_bytes(digest, "big") * span) >> 64)
