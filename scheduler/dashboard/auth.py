"""Who may use the dashboard, and proof that a POST came from its own pages.

- **Binding**: without a token the dashboard serves loopback only (``check_listen``);
  anyone who can reach a non-loopback port could otherwise cancel every job.
- **Token** (``DUETIME_DASHBOARD_TOKEN``): every request but ``/healthz``, ``/static``
  and the login form needs it, either as ``Authorization: Bearer <token>`` (API
  clients, monitoring) or as a session cookie set by the login form. The cookie holds
  ``<issued>.<nonce>.<HMAC>`` keyed by a hash of the token, so it survives a restart,
  dies when the token is rotated, and expires after ``SESSION_TTL``; it is HttpOnly,
  SameSite=Strict, Path=/, and Secure when the request came over HTTPS (directly or via
  a proxy's X-Forwarded-Proto, which uvicorn trusts from loopback only).
- **CSRF**: every action is a POST carrying ``csrf`` = HMAC(key, the ``duetime_csrf``
  cookie) — a per-browser random cookie, SameSite=Strict, set on the first page. A
  forged cross-site form has neither the cookie (SameSite) nor a way to compute the
  field. Bearer requests are exempt: a browser never attaches that header on its own,
  so it cannot be forged cross-site. A POST whose ``Origin`` names another host is
  refused as well.

All comparisons are constant-time (``hmac.compare_digest``).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import time
from dataclasses import dataclass

from scheduler.errors import ConfigError

__all__ = ["SESSION_TTL", "Auth", "check_listen", "is_loopback", "local_path", "split_listen"]

SESSION_COOKIE = "duetime_session"
CSRF_COOKIE = "duetime_csrf"
SESSION_TTL = 12 * 3600.0


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
    """(host, port) to bind; refuses a non-loopback address without a token."""
    host, port = split_listen(listen)
    if token is None and not is_loopback(host):
        raise ConfigError(
            f"refusing to serve the dashboard on {listen} without a token: set "
            "DUETIME_DASHBOARD_TOKEN (or the credential dashboard_token), or listen on "
            "127.0.0.1"
        )
    return host, port


@dataclass(frozen=True)
class Auth:
    """Tokens and signatures for one dashboard process."""

    token: str | None
    key: bytes

    @classmethod
    def create(cls, token: str | None) -> Auth:
        if token is None:  # loopback only: a per-process key signs the CSRF tokens
            return cls(None, secrets.token_bytes(32))
        return cls(token, hashlib.sha256(b"duetime-dashboard\0" + token.encode()).digest())

    @property
    def required(self) -> bool:
        return self.token is not None

    def _sign(self, text: str) -> str:
        # any str a client sent (non-ASCII, even a lone surrogate) signs: never a 500
        return hmac.new(self.key, text.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()

    # -- credentials ---------------------------------------------------------------------

    def token_matches(self, offered: str | None) -> bool:
        if self.token is None or not offered:
            return False
        return _same(offered, self.token)

    def bearer_ok(self, header: str | None) -> bool:
        if not header or not header.lower().startswith("bearer "):
            return False
        return self.token_matches(header[7:].strip())

    def new_session(self, now: float | None = None) -> str:
        issued = str(int(time.time() if now is None else now))
        body = f"{issued}.{secrets.token_urlsafe(16)}"
        return f"{body}.{self._sign('session:' + body)}"

    def session_ok(self, cookie: str | None, now: float | None = None) -> bool:
        if not cookie or cookie.count(".") != 2:
            return False
        body, _, signature = cookie.rpartition(".")
        if not _same(signature, self._sign("session:" + body)):
            return False
        issued = body.split(".", 1)[0]
        if not issued.isdigit():
            return False
        current = time.time() if now is None else now
        return 0 <= current - int(issued) <= SESSION_TTL

    # -- CSRF ----------------------------------------------------------------------------

    @staticmethod
    def new_csrf_cookie() -> str:
        return secrets.token_urlsafe(24)

    def csrf_token(self, cookie: str) -> str:
        return self._sign("csrf:" + cookie)

    def csrf_ok(self, cookie: str | None, offered: str | None) -> bool:
        if not cookie or not offered:
            return False
        return _same(offered, self.csrf_token(cookie))


def _same(offered: str, expected: str) -> bool:
    """Constant-time equality of a client's string and ours. ``hmac.compare_digest``
    raises TypeError on a str that is not ASCII (a cookie or form field anyone can send:
    that was an HTTP 500 before login), so both are compared as UTF-8 bytes."""
    encode = "utf-8", "surrogatepass"
    return hmac.compare_digest(offered.encode(*encode), expected.encode(*encode))
