"""Token buckets that spread a rate limit's starts over its period (pure).

A rate limit (``--rate N/s``) is exact on its sliding window: the dispatcher sums the
starts of the last period from ``duetime.limit_starts`` in its fenced transaction and
never lets them pass N (``scheduler.duties.limits``). The window alone admits a whole
period's budget the moment it frees, so 50/s went out as one burst of 50 each second:
exact on the dispatches, but a worker that started one burst a little late and the
next on time ran 84 handlers within one second (docs/benchmarks.md).

So each rated slot (a target, or a key of a per-key rate) also has a bucket of
``capacity`` tokens, ``burst`` of N (at least 1), refilled continuously at N per period;
a start takes a token and a job starts only when both the window and its bucket allow
it. Starts then leave in slices of a few jobs, ``capacity / 2`` or so per pass, evenly
over the period. Why a bucket and not a second, shorter window: a window's slice waits
for the previous slice to leave it and then for a claim cycle, so every slice pays a
cycle (k slices per period of P seconds and a cycle of c: N / (P + k c) per period, 10
slices and 13 ms a tenth less); a bucket's tokens accrue while the claim runs, so a
late pass takes a larger slice and the mean stays at N per period.

A bucket holds at most ``capacity`` tokens, except while its slot is *behind*: its
last pass took every whole token or all the room the window left (jobs were waiting
for more). Then the time until the
next pass is credited in full, up to ``CATCH_UP`` seconds: a pass slower than
``capacity / rate`` (a loaded machine: 100-200 ms; a 50/s rate's bucket of 5 fills in
100 ms) would otherwise lose the tokens past the capacity, and the mean with them
(measured: 27/s for 50/s under load 9). A slot that got all it asked for is clipped at
``capacity``, so jobs arriving after an idle spell start in a slice, not a burst.

The buckets live in the dispatcher's memory, not in the rows: the window, read from
the rows, is what makes the limit exact and survive a failover; the bucket only shapes
it. A slot the dispatcher has not charged recently (a new term, an idle key) has a full
bucket, so a new leader may start ``capacity`` jobs at once, never more than the window
allows. Full buckets are forgotten, which bounds memory by the slots charged within
``capacity / rate`` seconds. Synchronous; time comes from the ``Clock``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from scheduler.clock import Clock
from scheduler.store.limits import Limit

__all__ = ["RateBuckets"]

#: Longest wait between passes a behind slot is credited for in full (seconds).
CATCH_UP = 0.5


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float  # monotonic instant ``tokens`` was computed
    behind: bool = False  # the pass that charged it took every whole token


class RateBuckets:
    """One token bucket per rated (target, key) slot (module docstring)."""

    def __init__(self, *, burst: float, clock: Clock) -> None:
        if not 0 < burst <= 1:
            raise ValueError(f"burst must be in (0, 1] (got {burst})")
        self.burst = burst
        self._clock = clock
        self._buckets: dict[tuple[str, str], _Bucket] = {}

    def capacity(self, lim: Limit) -> int:
        """Starts ``lim``'s slots may make at once (``burst`` of its count, at least 1)."""
        assert lim.rate_count is not None
        return max(1, math.ceil(lim.rate_count * self.burst))

    @staticmethod
    def _refill(lim: Limit) -> float:
        assert lim.rate_count is not None and lim.rate_period
        return lim.rate_count / lim.rate_period  # tokens per second

    def now(self) -> float:
        return self._clock.monotonic()

    def tokens(self, lim: Limit, key: str = "", at: float | None = None) -> float:
        """The tokens of ``lim``'s slot ``key`` ('' unless per key) now, or at the
        monotonic instant ``at``."""
        capacity = self.capacity(lim)
        bucket = self._buckets.get((lim.target, key))
        if bucket is None:
            return float(capacity)
        at = self._clock.monotonic() if at is None else at
        elapsed = max(0.0, at - bucket.at)
        ceiling = float(capacity)
        if bucket.behind:
            ceiling = max(ceiling, min(elapsed, CATCH_UP) * self._refill(lim))
        return min(ceiling, bucket.tokens + elapsed * self._refill(lim))

    def room(self, lim: Limit, key: str = "") -> int:
        """Starts the bucket admits now (whole tokens)."""
        return int(self.tokens(lim, key) + 1e-9)

    def wait(self, lim: Limit, key: str = "", taken: int = 0) -> float:
        """Seconds until the slot holds a slice worth a pass (half its capacity, at
        least one token) once ``taken`` tokens are gone; 0 when it does now."""
        want = max(1.0, self.capacity(lim) / 2)
        missing = want - (self.tokens(lim, key) - taken)
        return max(0.0, missing / self._refill(lim))

    def charge(
        self,
        limits: Mapping[str, Limit],
        starts: Mapping[tuple[str, str], int],
        at: float | None = None,
        exhausted: Collection[tuple[str, str]] = (),
    ) -> None:
        """Take the tokens of ``starts`` (per (target, key) slot, as logged) as of the
        instant ``at`` their room was read (default now): tokens that accrue while the
        claim commits are the next pass's. A slot is left behind when the pass took
        every whole token it saw, or all the room it had (``exhausted``: the window
        held it back): its jobs wait, and the wait until the next pass is theirs."""
        at = self._clock.monotonic() if at is None else at
        for (target, key), count in starts.items():
            lim = limits.get(target)
            if lim is None or lim.rate_count is None:
                continue
            tokens = self.tokens(lim, key, at) - count
            behind = tokens < 1 or (target, key) in exhausted
            self._buckets[(target, key)] = _Bucket(tokens, at, behind=behind)
        self._forget_full(limits)

    def slots(self) -> list[tuple[str, str]]:
        """The slots with a bucket that is not full (the others are full)."""
        return list(self._buckets)

    def _forget_full(self, limits: Mapping[str, Limit]) -> None:
        """Drop the buckets that are full and no longer behind (a behind one is
        credited past its capacity until ``CATCH_UP`` has passed)."""
        now = self._clock.monotonic()
        for slot, bucket in list(self._buckets.items()):
            lim = limits.get(slot[0])
            if lim is None or lim.rate_count is None:
                del self._buckets[slot]
            elif self.tokens(lim, slot[1]) >= self.capacity(lim) and (
                not bucket.behind or now - bucket.at >= CATCH_UP
            ):
                del self._buckets[slot]

    def reset(self) -> None:
        """Forget every bucket (a new term: every slot starts full)."""
        self._buckets.clear()
