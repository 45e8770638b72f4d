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

_URL_PASSWORD = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:/@\s]*):(?P<pw>[^@/\s]+)@")
_SECRET_KEYS = ("password", "passwd", "secret", "token")


def scrub(text: str) -> str:
    """Redact passwords embedded in URLs inside arbitrary text."""
    return _URL_PASSWORD.sub(r"\g<scheme>\g<user>:***@", text)


def _redact(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
    for key, value in list(event.items()):
        if any(s in key.lower() for s in _SECRET_KEYS) and value:
            event[key] = "***"
        elif isinstance(value, str) and "://" in value:
            event[key] = scrub(value)
    exc = event.get("exception")
    if isinstance(exc, str):
        event["exception"] = scrub(exc)
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
        final = [structlog.processors.format_exc_info, _redact, renderer]
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False)
        final = [_redact, renderer]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
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
