"""Which ``Host`` (and ``Origin``) the dashboard answers to: the defence against DNS
rebinding.

A page on ``http://evil.example:8089`` whose name the attacker re-points at 127.0.0.1
is, to the browser, same-origin with itself: it can read the token-less loopback
dashboard and post to it, and its ``Origin`` equals its ``Host``. Only the name it
arrives under gives it away, so every request's ``Host`` must be one of:

- a name in ``dashboard_hosts`` (``DUETIME_DASHBOARD_HOSTS``: ``name`` for any port,
  e.g. the name a reverse proxy serves, or ``name:port``);
- listening on loopback: ``127.0.0.1``, ``localhost`` or ``[::1]`` with the listening
  port (and the listening address itself, ``127.0.0.2`` say);
- listening on one other address: that address with the port; on a wildcard
  (``0.0.0.0``, ``::``): any IP address with the port. An address is no name an
  attacker can re-point.

Anything else is answered 421 (Misdirected Request) before authentication. A POST's
``Origin``, when the browser sends one, must name an allowed host too.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

from scheduler.dashboard.auth import is_loopback

__all__ = ["Hosts", "split_host"]

LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
WILDCARDS = frozenset({"0.0.0.0", "::", ""})


def split_host(value: str) -> tuple[str, int | None] | None:
    """``(name, port)`` of a Host header value (port None when absent), lower-cased,
    IPv6 without brackets; None when it is not a host."""
    text = value.strip().lower()
    if not text or any(c in text for c in "/\\@ ?#"):
        return None
    port: int | None = None
    if text.startswith("["):
        name, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            return None
        text_port = rest[1:] if rest else None
    else:
        name, sep, text_port = text.partition(":")
        if not sep:
            text_port = None
        elif ":" in text_port:
            return None
    if text_port is not None:
        if not text_port.isdigit() or int(text_port) > 65535:
            return None
        port = int(text_port)
    return (name, port) if name else None


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Hosts:
    listen_host: str
    port: int
    names: frozenset[str] = frozenset()  # configured, any port
    named_ports: frozenset[tuple[str, int]] = frozenset()  # configured name:port

    @classmethod
    def for_listen(cls, host: str, port: int, configured: tuple[str, ...] = ()) -> Hosts:
        names: set[str] = set()
        named_ports: set[tuple[str, int]] = set()
        for item in configured:
            parsed = split_host(item)
            if parsed is None:
                continue  # the setting's parser refuses these
            name, item_port = parsed
            if item_port is None:
                names.add(name)
            else:
                named_ports.add((name, item_port))
        return cls(host.lower(), port, frozenset(names), frozenset(named_ports))

    def allows(self, value: str | None, default_port: int = 80) -> bool:
        """Whether a ``Host`` header value names this dashboard."""
        parsed = split_host(value or "")
        if parsed is None:
            return False
        name, given = parsed
        port = default_port if given is None else given
        if name in self.names or (name, port) in self.named_ports:
            return True
        if port != self.port:
            return False
        if name == self.listen_host:
            return True
        if is_loopback(self.listen_host):
            return name in LOOPBACK_NAMES
        return self.listen_host in WILDCARDS and _is_address(name)

    def allows_origin(self, origin: str) -> bool:
        """Whether a POST's ``Origin`` names this dashboard (``null`` does not)."""
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return False
        return self.allows(parts.netloc, 443 if parts.scheme == "https" else 80)
