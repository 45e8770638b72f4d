"""Who may use the dashboard, and proof that a POST came from its own pages.

- **Binding**: without a token the dashboard serves loopback only (``check_listen``);
  anyone who can reach a non-loopback port could otherwise cancel every job. Off
  loopback the token must be at least ``MIN_TOKEN_CHARS`` long: it is the only thing
  between the network and every action.
- **Token** (``DUETIME_DASHBOARD_TOKEN``): every request but ``/healthz``, ``/static``
  and the login form needs it, either as ``Authorization: Bearer <token>`` (API
  clients, monitoring) or as a session cookie set by the login form. Nothing a visitor
  can see is derived from the token: the session cookie is a random id the process
  remembers (``Sessions``: bounded, expires after ``SESSION_TTL``, forgotten at logout
  and at restart), and every signature is keyed by ``secret``, random per process.
  Wrong tokens are throttled per client (``scheduler.dashboard.throttle``). The cookie
  is HttpOnly, SameSite=Strict, Path=/, and Secure when the request came over HTTPS
  (directly or via the X-Forwarded-Proto of a proxy DUETIME_DASHBOARD_TRUSTED_PROXIES
  names).
- **CSRF**: every action is a POST carrying ``csrf`` = HMAC(secret, the session id) when
  logged in, else HMAC(secret, the ``duetime_csrf`` cookie) — a per-browser random
  cookie, SameSite=Strict, set on the first page (the login form, the token-less
  dashboard). A forged cross-site form has neither the cookie (SameSite) nor a way to
  compute the field, and a field read before logout is worthless after it. Bearer
  requests are exempt: a browser never attaches that header on its own, so it cannot be
  forged cross-site. A POST whose ``Origin`` is not a host the dashboard answers to is
  refused as well (``scheduler.dashboard.hosts``).

All comparisons are constant-time (``hmac.compare_digest``).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field

from scheduler.clock import SYSTEM_CLOCK, Clock
from scheduler.dashboard.throttle import Throttle
from scheduler.errors import ConfigError
from scheduler.log import get_logger

__all__ = [
    "MIN_TOKEN_CHARS",
    "SESSION_TTL",
    "Auth",
    "Sessions",
    "Verdict",
    "check_listen",
    "is_loopback",
    "local_path",
    "split_listen",
]

log = get_logger(__name__)

SESSION_COOKIE = "duetime_session"
CSRF_COOKIE = "duetime_csrf"
SESSION_TTL = 12 * 3600.0
MAX_SESSIONS = 10_000  # the oldest session is forgotten (logged out) beyond this
MIN_TOKEN_CHARS = 16


def split_listen(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_path(target: str) -> str:
    """``target`` when it is a path on this site, else ``/`` (no open redirect: ``//host``
    and ``/\\host`` are other sites to a browser)."""
    if not target.startswith("/") or target.startswith(("//", "/\\")) or "\n" in target:
        return "/"
    return target


def check_listen(listen: str, token: str | None) -> tuple[str, int]:
    """(host, port) to bind; refuses a non-loopback address without a strong token."""
    host, port = split_listen(listen)
    if is_loopback(host):
        return host, port
    if token is None:
        raise ConfigError(
            f"refusing to serve the dashboard on {listen} without a token: set "
            "DUETIME_DASHBOARD_TOKEN (or the credential dashboard_token), or listen on "
            "127.0.0.1"
        )
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(
            f"refusing to serve the dashboard on {listen} with a token of {len(token)} "
            f"characters: off loopback it needs at least {MIN_TOKEN_CHARS} "
            "(e.g. openssl rand -hex 32)"
        )
    return host, port


@dataclass
class Sessions:
    """Session ids this process issued, each with its expiry; bounded (the oldest goes
    first). A restart forgets them all: everyone logs in again."""

    ttl: float = SESSION_TTL
    limit: int = MAX_SESSIONS
    _expiry: OrderedDict[str, float] = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self._expiry)

    def issue(self, now: float) -> str:
        session = secrets.token_urlsafe(32)
        self._expiry[session] = now + self.ttl
        while len(self._expiry) > self.limit:
            self._expiry.popitem(last=False)
        return session

    def valid(self, session: str, now: float) -> bool:
        expiry = self._expiry.get(session)  # a dict lookup by a 256-bit random id
        if expiry is None:
            return False
        if now > expiry:
            del self._expiry[session]
            return False
        return True

    def revoke(self, session: str) -> bool:
        return self._expiry.pop(session, None) is not None


@dataclass(frozen=True)
class Verdict:
    """What a token offered by a client earned: ``ok``, or refused; ``retry_after`` > 0
    when the client is throttled and the token was not even compared."""

    ok: bool
    retry_after: float = 0.0


@dataclass
class Auth:
    """The token, this process's random secret, its sessions and its throttle."""

    token: str | None
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    sessions: Sessions = field(default_factory=Sessions)
    throttle: Throttle = field(default_factory=Throttle)
    clock: Clock = SYSTEM_CLOCK  # session expiry and throttling, in epoch seconds

    @classmethod
    def create(cls, token: str | None) -> Auth:
        return cls(token)

    @property
    def required(self) -> bool:
        return self.token is not None

    def _now(self) -> float:
        return self.clock.now().timestamp()

    def _sign(self, text: str) -> str:
        # any str a client sent (non-ASCII, even a lone surrogate) signs: never a 500
        raw = text.encode("utf-8", "surrogatepass")
        return hmac.new(self.secret, raw, hashlib.sha256).hexdigest()

    # -- credentials ---------------------------------------------------------------------

    def token_matches(self, offered: str | None) -> bool:
        if self.token is None or not offered:
            return False
        return _same(offered, self.token)

    def try_token(
        self, offered: str | None, client: str, *, via: str, now: float | None = None
    ) -> Verdict:
        """Compare a token a client offered, unless its address is throttled; every
        failure is logged (the address, the count, the lock; never the token)."""
        current = self._now() if now is None else now
        wait = self.throttle.retry_after(client, current)
        if wait > 0:
            return Verdict(False, wait)
        if self.token_matches(offered):
            self.throttle.succeeded(client)
            return Verdict(True)
        failures, locked = self.throttle.failed(client, current)
        log.warning(
            "dashboard_auth_failed", client=client, via=via, failures=failures,
            locked_seconds=round(locked, 1),
        )  # fmt: skip
        return Verdict(False)

    @staticmethod
    def bearer(header: str | None) -> str | None:
        """The token an ``Authorization: Bearer`` header offers, if it is one."""
        if not header or not header.lower().startswith("bearer "):
            return None
        return header[7:].strip()

    def bearer_ok(self, header: str | None) -> bool:
        return self.token_matches(self.bearer(header))

    def new_session(self, now: float | None = None) -> str:
        return self.sessions.issue(self._now() if now is None else now)

    def session_ok(self, cookie: str | None, now: float | None = None) -> bool:
        if not cookie or self.token is None:
            return False
        return self.sessions.valid(cookie, self._now() if now is None else now)

    def end_session(self, cookie: str | None) -> bool:
        return bool(cookie) and self.sessions.revoke(str(cookie))

    # -- CSRF ----------------------------------------------------------------------------

    @staticmethod
    def new_csrf_cookie() -> str:
        return secrets.token_urlsafe(24)

    def csrf_token(self, binding: str) -> str:
        """The CSRF field for a request bound to ``binding`` (``session:<id>`` when
        logged in, ``cookie:<duetime_csrf>`` otherwise)."""
        return self._sign("csrf:" + binding)

    def csrf_ok(self, binding: str | None, offered: str | None) -> bool:
        if not binding or not offered:
            return False
        return _same(offered, self.csrf_token(binding))


def _same(offered: str, expected: str) -> bool:
    """Constant-time equality of a client's string and ours. ``hmac.compare_digest``
    raises TypeError on a str that is not ASCII (a cookie or form field anyone can send:
    that was an HTTP 500 before login), so both are compared as UTF-8 bytes."""
    encode = "utf-8", "surrogatepass"
    return hmac.compare_digest(offered.encode(*encode), expected.encode(*encode))
