"""Value parsers of the settings table: each takes a raw value (a string from the
environment or a flag, a typed value from TOML) and returns it typed, or raises
``ValueError`` with the reason, which ``load_settings`` prefixes with the value's source.
``redact_url`` is here too: every error about a URL shows it redacted.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import socket
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from scheduler.config.shards import Shard, host_list_problem, parse_shards_env, parse_shards_table
from scheduler.errors import ConfigError
from scheduler.jobspec import QUEUE_NAME

# A comma that starts another URL ("...,amqps://..."): the commas of a libpq multi-host
# netloc ("postgresql://h1:5432,h2:5432/db") are not followed by a scheme.
_URL_LIST_SEPARATOR = re.compile(r",\s*(?=[a-z][a-z0-9+.-]*://)", re.IGNORECASE)


def redact_url(url: str) -> str:
    """Replace the password of a URL by ``***`` so the URL can be logged (of every URL in
    a comma-separated list of them, like ``amqp_url`` for a cluster)."""
    urls = _URL_LIST_SEPARATOR.split(url)
    if len(urls) > 1:
        return ",".join(redact_url(one) for one in urls)
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    # Work on the raw netloc: it keeps IPv6 brackets and a port that does not parse
    # (a bad port is exactly what an error message about this URL has to show).
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return urlunsplit((parts.scheme, f"{user}:***@{hostport}", parts.path, parts.query, ""))


# -- parsers ------------------------------------------------------------------------------


def url(schemes: tuple[str, ...]) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if not isinstance(value, str) or not value:
            raise ValueError("must be a non-empty URL string")
        parts = urlsplit(value)
        if parts.scheme not in schemes:
            raise ValueError(
                f"scheme must be one of {', '.join(schemes)} (got {parts.scheme or 'none'!r})"
            )
        if not parts.hostname and "host=" not in parts.query:
            raise ValueError("has no host")
        problem = host_list_problem(parts.netloc)  # libpq's h1:p1,h2:p2 included
        if problem is not None:
            raise ValueError(problem)
        return value

    return parse


def url_list(schemes: tuple[str, ...]) -> Callable[[Any], str]:
    """One URL or several, comma-separated (TOML: also a list); each checked like a single
    one. The value stays one string, the URLs joined by "," in the order given
    (``scheduler.broker.amqp_urls`` splits it)."""
    one = url(schemes)

    def parse(value: Any) -> str:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list | tuple) or not items:
            raise ValueError("must be a URL or a comma-separated list of URLs")
        urls: list[str] = []
        for number, raw in enumerate(items, start=1):
            item = raw.strip() if isinstance(raw, str) else raw
            try:
                checked = one(item)
            except ValueError as exc:
                where = f"URL {number} of {len(items)}" if len(items) > 1 else "URL"
                raise ValueError(f"{where} {exc}") from None
            if checked in urls:
                raise ValueError(f"lists {redact_url(checked)} twice")
            urls.append(checked)
        return ",".join(urls)

    return parse


def queue_names(value: Any) -> tuple[str, ...]:
    """Job queue names, comma-separated (TOML: a list), each ``[A-Za-z0-9][A-Za-z0-9_.-]{0,99}``
    (the rule of ``jobs.queue``); empty: none."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        raise ValueError("must be a comma-separated list of queue names")
    out: list[str] = []
    for raw in items:
        item = raw.strip() if isinstance(raw, str) else raw
        if item == "":
            continue
        if not isinstance(item, str) or not QUEUE_NAME.match(item):
            raise ValueError(
                f"queue name {raw!r} is invalid: 1-100 characters, letters, digits, '_', '.', "
                "'-', starting with a letter or digit"
            )
        if item not in out:
            out.append(item)
    return tuple(out)


def endpoints(value: Any) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        raise ValueError("must be a comma-separated list of host:port")
    out: list[str] = []
    for raw in items:
        item = str(raw).strip()
        for prefix in ("http://", "https://"):
            if item.startswith(prefix):
                item = item[len(prefix) :]
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"endpoint {raw!r} is not host:port")
        out.append(item)
    if not out:
        raise ValueError("needs at least one endpoint")
    return tuple(out)


def number(
    kind: type,
    *,
    minimum: float | None = None,
    exclusive: bool = False,
    maximum: float | None = None,
) -> Callable:
    def parse(value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError(f"must be a {kind.__name__}, not a boolean")
        try:
            number = kind(value)
        except (TypeError, ValueError, OverflowError):  # int(inf) overflows
            raise ValueError(f"must be a {kind.__name__} (got {value!r})") from None
        if not math.isfinite(number):  # nan passes every comparison below
            raise ValueError(f"must be a finite number (got {value!r})")
        if minimum is not None and (number <= minimum if exclusive else number < minimum):
            relation = ">" if exclusive else ">="
            raise ValueError(f"must be {relation} {minimum} (got {value!r})")
        if maximum is not None and number > maximum:
            raise ValueError(f"must be <= {maximum} (got {value!r})")
        return number

    return parse


def optional_seconds(*, minimum: float, exclusive: bool = False) -> Callable[[Any], Any]:
    """Seconds, or unset (None / empty: the default derived from other settings)."""
    seconds = number(float, minimum=minimum, exclusive=exclusive)

    def parse(value: Any) -> float | None:
        return None if value in (None, "") else float(seconds(value))

    return parse


def optional_port(value: Any) -> int | None:
    if value in (None, "", "0", 0, "off", "none"):
        return None
    port = number(int, minimum=1)(value)
    if port > 65535:
        raise ValueError(f"must be a TCP port 1-65535 (got {value!r})")
    return int(port)


def choice(*options: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = str(value).lower()
        if text not in options:
            raise ValueError(f"must be one of {', '.join(options)} (got {value!r})")
        return text

    return parse


def nonempty_text(value: Any) -> str:
    text = str(value).strip()
    if not text:
        raise ValueError("must not be empty")
    if len(text) > 200:
        raise ValueError("is longer than 200 characters")
    return text


def optional_text(value: Any) -> str | None:
    text = str(value).strip() if value is not None else ""
    return text or None


def key_prefix(value: Any) -> str:
    text = nonempty_text(value).strip("/")
    if not text or any(c.isspace() for c in text):
        raise ValueError(f"must be a non-empty key prefix without spaces (got {value!r})")
    return text


def listen_address(value: Any) -> str:
    """``host:port`` (``[v6]:port`` for IPv6); port 0 picks a free one."""
    text = str(value).strip()
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"must be host:port, e.g. 127.0.0.1:8089 (got {value!r})")
    return text


def listen_host(value: Any) -> str:
    """An address (or name) to bind, IPv6 with or without brackets: ``0.0.0.0``, ``::1``."""
    text = str(value).strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    if not text or any(c.isspace() or c in "/[]" for c in text) or len(text) > 253:
        raise ValueError(f"must be an address to listen on, e.g. 127.0.0.1 (got {value!r})")
    return text


def host_names(value: Any) -> tuple[str, ...]:
    """Host names, comma-separated (TOML: a list), each ``name`` or ``name:port``
    (``[v6]:port``), as a browser sends them in ``Host``; lower-cased; empty: none."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        raise ValueError("must be a comma-separated list of host names")
    out: list[str] = []
    for raw in items:
        item = str(raw).strip().lower()
        if not item:
            continue
        if item.startswith("["):  # [v6] or [v6]:port
            name, closed, rest = item[1:].partition("]")
            port = rest[1:] if rest.startswith(":") else rest
            good = bool(closed and name) and (not rest or rest.startswith(":"))
        else:
            name, colon, port = item.partition(":")
            good = bool(name) and ":" not in port and (not colon or bool(port))
        if port and (not port.isdigit() or not 0 < int(port) < 65536):
            good = False
        if not good or any(c.isspace() or c in "/\\@?#" for c in item):
            raise ValueError(
                f"host {raw!r} is not a host name: give the name a browser uses "
                "(duetime.internal), name:port (duetime.internal:8443) or [::1]:8089, "
                "no scheme or path"
            )
        if item not in out:
            out.append(item)
    return tuple(out)


def proxy_addresses(value: Any) -> tuple[str, ...]:
    """IP addresses or networks (``10.0.0.5``, ``10.0.0.0/24``, ``::1``), comma-separated
    (TOML: a list), as uvicorn's ``forwarded_allow_ips`` takes them; empty: none."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        raise ValueError("must be a comma-separated list of IP addresses or networks")
    out: list[str] = []
    for raw in items:
        item = str(raw).strip()
        if not item:
            continue
        try:
            ipaddress.ip_network(item, strict=False)
        except ValueError:
            raise ValueError(
                f"{raw!r} is not an IP address or network (10.0.0.5, 10.0.0.0/24, ::1); "
                "name the proxy by address, not by host name"
            ) from None
        if item not in out:
            out.append(item)
    return tuple(out)


def shards(value: Any) -> tuple[Shard, ...] | None:
    """``DUETIME_SHARDS`` (``name=url,...``) or a TOML ``[shards]`` table; unset or empty:
    None, the single shard ``main`` at ``database_url`` (``Settings.shard_urls``)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    try:
        if isinstance(value, str):
            return parse_shards_env(value)
        return parse_shards_table(value)
    except ConfigError as exc:
        raise ValueError(f"is invalid: {str(exc).removeprefix('invalid shards: ')}") from None


def default_node_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"
