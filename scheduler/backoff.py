"""Back-off arithmetic (pure): exponential with full jitter, capped.

Full jitter (AWS architecture blog, "Exponential Backoff and Jitter") spreads retries
of many clients that failed together, which is exactly the failure shape of a job
scheduler (a downstream outage fails thousands of jobs at once).
"""

from __future__ import annotations

import random


def exponential_delay(
    failures: int,
    *,
    base: float = 1.0,
    factor: float = 2.0,
    cap: float = 3600.0,
    jitter: bool = True,
    rng: random.Random | None = None,
) -> float:
    """Delay before retry number ``failures`` (1 = first retry)."""
    if failures < 1:
        return 0.0
    ceiling = min(cap, base * factor ** min(failures - 1, 64))
    if not jitter:
        return ceiling
    return (rng or random).uniform(0.0, ceiling)


def bounded_jitter(
    failures: int, *, base: float = 0.1, cap: float = 10.0, rng: random.Random | None = None
) -> float:
    """Back-off for infrastructure retries (reconnects, duty restarts): never below
    half the exponential ceiling, so a retry loop cannot spin while jitter stays useful."""
    ceiling = min(cap, base * 2.0 ** min(max(failures, 1) - 1, 64))
    return (rng or random).uniform(ceiling / 2, ceiling)
