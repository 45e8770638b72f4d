"""Logging: structlog everywhere, JSON lines for services, key=value on a TTY.

Standard-library loggers (asyncpg, aio-pika, aiormq, grpc) are routed through the same
processors so a service emits one format. Secrets: values of keys that look secret,
and passwords inside URLs, are redacted by a processor, so a stray ``dsn=...`` never
leaks a password into a log file.
"""

from __future__ import annotations

import logging
import re
import sys
from typing import Any

import structlog

# A password inside a URL: everything between "scheme://user:" and the LAST "@" before
# whitespace or a quote, so a password holding an unescaped "/" or "@" is still covered.
# "host.name:port/path@…" (a dotted host or localhost, a port, then a path with an "@")
# is an address, not a password; anything less certain is redacted (the safe mistake).
_URL_PASSWORD = re.compile(
    r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:/@\s'\"]*):(?P<pw>[^\s'\"]*)@", re.IGNORECASE
)
_PORT_AND_PATH = re.compile(r"\d{1,5}(?:/|$)")
# key=value secrets: libpq conninfo strings (password=…), URL query parameters
# (?password=…, sslpassword=…) and dumps of keyword arguments (etcd_password='…').
_KV_SECRET = re.compile(
    r"(?P<key>[\w.-]*(?:password|passwd|pwd|secret|token)\s*=\s*)"
    r"(?P<q>['\"]?)(?P<value>[^\s&'\",;)]+)",
    re.IGNORECASE,
)
# key: value secrets (JSON, dict reprs, YAML). Prose uses the same shape ("Secret: the
# job ran", "token: expired"), so it counts only when the key is quoted, or compound
# (etcd_password, api-token), or the value is quoted or not a plain word.
_COLON_SECRET = re.compile(
    r"(?P<key>(?P<kq>['\"]?)(?P<name>[\w.-]*(?:password|passwd|secret|token))(?P=kq)\s*:\s*)"
    r"(?P<q>['\"]?)(?P<value>[^\s&'\",;)]+)",
    re.IGNORECASE,
)
_PLAIN_WORD = re.compile(r"[^\W\d_]+")
# Bearer tokens (an Authorization header quoted in an error): a token has a digit.
_BEARER = re.compile(r"(?P<key>\bBearer\s+)(?P<value>(?=\S*\d)[\w.~+/=-]{8,})")
_SECRET_KEYS = ("password", "passwd", "secret", "token", "credential")


def _url_password(match: re.Match[str]) -> str:
    user = match["user"].lower()
    if ("." in user or user == "localhost") and _PORT_AND_PATH.match(match["pw"]):
        return match[0]
    return f"{match['scheme']}{match['user']}:***@"


def _colon_secret(match: re.Match[str]) -> str:
    compound = match["name"].lower() not in ("password", "passwd", "secret", "token")
    if match["kq"] or match["q"] or compound or not _PLAIN_WORD.fullmatch(match["value"]):
        return f"{match['key']}{match['q']}***"
    return match[0]


def scrub(text: str) -> str:
    """Redact credentials inside any text: passwords in URLs, ``password=…`` pairs,
    ``"password": "…"`` pairs and Bearer tokens. Ordinary sentences that merely use
    the words ("Secret: the job ran", "token: expired") are left as written."""
    text = _URL_PASSWORD.sub(_url_password, text)
    text = _KV_SECRET.sub(r"\g<key>\g<q>***", text)
    text = _COLON_SECRET.sub(_colon_secret, text)
    return _BEARER.sub(r"\g<key>***", text)


def _scrub_value(value: Any, depth: int = 0) -> Any:
    """Scrub strings, exceptions and containers of them (bounded depth)."""
    if isinstance(value, str):
        return scrub(value)
    if isinstance(value, BaseException):
        return scrub(f"{type(value).__name__}: {value}")
    if depth > 5:
        return value
    if isinstance(value, dict):
        return {
            k: "***" if _secret_key(k) and v else _scrub_value(v, depth + 1)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return type(value)(_scrub_value(v, depth + 1) for v in value)
    return value


def _secret_key(key: Any) -> bool:
    return isinstance(key, str) and any(s in key.lower() for s in _SECRET_KEYS)


_format_exc_info = structlog.processors.ExceptionRenderer()


def _redact(logger: Any, name: str, event: dict[str, Any]) -> dict[str, Any]:
    # Render a traceback to text here, before scrubbing, in every output format:
    # exception messages of asyncpg/aio-pika/aetcd may quote a URL with its password.
    if event.get("exc_info"):
        event = dict(_format_exc_info(logger, name, event))
    for key, value in list(event.items()):
        if _secret_key(key) and value:
            event[key] = "***"
        else:
            event[key] = _scrub_value(value)
    return event


def configure_logging(level: str = "info", fmt: str = "auto") -> None:
    """Configure structlog and the stdlib root logger. Safe to call more than once."""
    json_lines = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: Any
    if json_lines:
        renderer = structlog.processors.JSONRenderer()
        final = [_redact, renderer]
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False)
        final = [_redact, renderer]
    structlog.configure(
        # filter_by_level first: a disabled debug line must not pay for timestamps and
        # the rest of the chain (measured ~2.6 % of a busy worker's samples).
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *final],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("aiormq", "aio_pika", "asyncio", "grpc"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


def get_logger(name: str | None = None, **bound: Any) -> Any:
    return structlog.get_logger(name).bind(**bound) if bound else structlog.get_logger(name)
