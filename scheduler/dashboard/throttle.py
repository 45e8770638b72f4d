"""Wrong tokens cost time: a per-client back-off in front of every token comparison.

Each client address may get ``free`` wrong tokens (login form or Bearer); each further
one locks the address for ``base`` × 2^(n − free) seconds, at most ``ceiling``. While
locked, a request that offers a token is answered 429 with ``Retry-After`` before the
token is compared, so guessing is no faster than the back-off. A success forgives the
address; an address silent for ``forget`` seconds starts afresh. Memory is bounded: at
most ``limit`` addresses are remembered (the least recently failed is dropped first).

With the defaults an address gets 5 guesses, then 1, 2, 4 … s apart, and after 9
more one guess per 5 minutes: 4,000 guesses take about two weeks instead of 12 s.
Limit: an attacker with many addresses gets ``free`` guesses and a back-off per address;
the log (``dashboard_auth_failed``) shows it. Behind a proxy the address is the proxy's
``X-Forwarded-For``, believed only from ``DUETIME_DASHBOARD_TRUSTED_PROXIES``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

__all__ = ["Throttle"]


@dataclass
class _Client:
    failures: int = 0
    last: float = 0.0
    locked_until: float = 0.0


@dataclass
class Throttle:
    free: int = 5
    base: float = 1.0
    ceiling: float = 300.0
    forget: float = 3600.0
    limit: int = 10_000
    _clients: OrderedDict[str, _Client] = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self._clients)

    def retry_after(self, client: str, now: float) -> float:
        """Seconds ``client`` must wait before its next token is compared (0: now)."""
        entry = self._clients.get(client)
        if entry is None:
            return 0.0
        if now - entry.last > self.forget:
            del self._clients[client]
            return 0.0
        return max(0.0, entry.locked_until - now)

    def failed(self, client: str, now: float) -> tuple[int, float]:
        """Record a wrong token; (failures so far, seconds locked from now)."""
        entry = self._clients.pop(client, None)
        if entry is None or now - entry.last > self.forget:
            entry = _Client()
        entry.failures += 1
        entry.last = now
        lock = 0.0
        if entry.failures > self.free:
            exponent = min(entry.failures - self.free - 1, 32)
            lock = min(self.base * 2.0**exponent, self.ceiling)
            entry.locked_until = now + lock
        self._clients[client] = entry  # most recent last
        while len(self._clients) > self.limit:
            self._clients.popitem(last=False)
        return entry.failures, lock

    def succeeded(self, client: str) -> None:
        self._clients.pop(client, None)
