"""The trust window of a leader's etcd lease: pure arithmetic on monotonic seconds.

**The trust window.** etcd expires a lease TTL seconds after it *processed* the last
refresh, and it processed it after we *sent* it. So, clock rates being equal, the
lease lives at least until ``sent_at + TTL``. The leader trusts its lease until
``sent_at + TTL - safety_margin`` of the last successful refresh (monotonic clock): a
slow reply shortens the window instead of stretching it, and a stale reply can neither
move the deadline back nor past its own ``sent_at + TTL``. We ask etcd for the TTL
rounded up to whole seconds (etcd TTLs are integers, and etcd may raise them to its
minimum); the window uses the smaller of the configured and the granted TTL.
The window opens when the lease is granted, so ``hold()`` must start as soon as
``campaign()`` returns (it raises at once if the window already closed).

**Safety margin.** Default ``min(max(0.25, 0.2 * TTL), 2.0)`` (the same rule as
``Settings.effective_safety_margin``). It covers what happens after the deadline is
computed: event-loop stalls and the time to cancel duties (hundreds of ms on a loaded
host) and clock-rate skew (ppm). Those do not grow with the TTL, hence the 2 s cap; the
20 % keeps at least 80 % of the TTL usable.
"""

from __future__ import annotations

__all__ = ["LeaseDeadline", "default_safety_margin"]


def default_safety_margin(ttl: float) -> float:
    """The margin used when none is configured (see the module docstring)."""
    return min(max(0.25, ttl * 0.2), 2.0)


class LeaseDeadline:
    """The trust window of one lease, as pure arithmetic on monotonic seconds."""

    def __init__(self, ttl: float, safety_margin: float) -> None:
        if ttl <= 0 or not 0 <= safety_margin < ttl:
            raise ValueError(
                f"need ttl > 0 and 0 <= safety_margin < ttl (got {ttl}, {safety_margin})"
            )
        self.ttl = ttl
        self.safety_margin = safety_margin
        self._valid_until: float | None = None

    @property
    def valid_until(self) -> float | None:
        """Monotonic instant the lease stops being trusted; None before any refresh."""
        return self._valid_until

    def renewed(self, sent_at: float, granted_ttl: float | None = None) -> float | None:
        """Record a successful refresh whose request was *sent* at ``sent_at``.

        The window never shrinks (a stale reply is harmless) and never extends past
        ``sent_at + min(ttl, granted_ttl) - safety_margin``.
        """
        ttl = self.ttl if granted_ttl is None else min(self.ttl, granted_ttl)
        if ttl > 0:
            candidate = sent_at + ttl - self.safety_margin
            if self._valid_until is None or candidate > self._valid_until:
                self._valid_until = candidate
        return self._valid_until

    def expired(self, now: float) -> bool:
        return self._valid_until is None or now >= self._valid_until

    def remaining(self, now: float) -> float:
        return 0.0 if self._valid_until is None else max(0.0, self._valid_until - now)
