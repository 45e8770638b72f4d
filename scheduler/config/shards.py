"""Which shards exist: ``DUETIME_SHARDS`` or a TOML ``[shards]`` table.

A shard is one PostgreSQL database holding the whole duetime schema, named so that the
name can sit in an etcd key (``<prefix>/shards/<name>/leader``), a metric label and a
message body without quoting: ``[a-z0-9_-]{1,32}``. Without either setting there is one
shard, ``main``, at the database URL, and nothing about a single-database cluster
changes.

The environment form is ``name=url,name=url``. A PostgreSQL URL may itself contain
commas only in its host list (libpq's ``h1:5432,h2:5432``, a primary and its standby)
and its query string (``?options=...``), so pairs are split on a comma that is followed
by ``name=`` and a URL scheme, never on a comma inside a URL. Errors list
every bad pair at once (passwords redacted), like ``load_settings`` does.

It is the shard vocabulary every floor above configuration shares (messages, the
publisher, the duties, the elector, the workers), which is why it sits here and imports
nothing from the rest of ``scheduler.config``: ``loading`` calls ``shards_from`` when it
reads ``DUETIME_SHARDS`` and the ``[shards]`` table.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from scheduler.errors import ConfigError
from scheduler.log import scrub

__all__ = ["DEFAULT_SHARD", "SHARD_NAME", "Shard", "election_key", "host_list_problem",
           "member_key", "parse_shards", "parse_shards_env", "parse_shards_table",
           "shard_key", "shards_from"]  # fmt: skip

DEFAULT_SHARD = "main"
SHARD_NAME = re.compile(r"[a-z0-9_-]{1,32}")
_SCHEMES = ("postgresql", "postgres")
# A pair starts at the beginning or after a comma, with "name=" and a URL scheme.
_PAIR_START = re.compile(r"(?:^|,)\s*([^=,\s]*)\s*=\s*(?=[a-z][a-z0-9+.-]*://)", re.IGNORECASE)
# One host of a libpq host list: a name or address, or a bracketed IPv6 address, and an
# optional port.
_LISTED_HOST = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[^\s:/?#@\[\],]+)(?::(\d{1,5}))?")


def member_key(prefix: str, node_id: str) -> str:
    """The etcd key that says ``node_id`` is alive (on its lease)."""
    return f"{prefix.rstrip('/')}/members/{node_id}"


def shard_key(prefix: str, shard: str) -> str:
    """The election key of ``shard`` in a sharded cluster."""
    return f"{prefix.rstrip('/')}/shards/{shard}/leader"


def election_key(prefix: str, shard: str = DEFAULT_SHARD, *, sharded: bool = False) -> str:
    """The election key of ``shard``: ``<prefix>/leader`` for the one shard of an
    unsharded cluster (a contract operators, tests and ``duetime status`` read: DESIGN
    §4), ``shard_key`` when sharded."""
    if sharded:
        return shard_key(prefix, shard)
    if shard != DEFAULT_SHARD:
        raise ValueError(f"an unsharded cluster has only the shard {DEFAULT_SHARD!r}")
    return f"{prefix.rstrip('/')}/leader"


@dataclass(frozen=True, repr=False)
class Shard:
    """One shard. ``repr`` redacts the password so a traceback cannot leak it."""

    name: str
    url: str

    def __repr__(self) -> str:
        return f"Shard({self.name!r}, {scrub(self.url)!r})"


def host_list_problem(netloc: str) -> str | None:
    """Why the hosts of a URL's ``netloc`` do not parse, or None when they do.

    libpq and asyncpg accept several hosts, comma-separated, each with its own port
    (``user@h1:5432,h2:5432``: with ``target_session_attrs=read-write`` a connection
    goes to whichever accepts writes, so a Patroni switchover needs no reconfiguration).
    ``urlsplit`` knows one host only (its ``.port`` fails on ``5432,h2:5432``), so a
    host list is checked host by host; a single host is checked by ``urlsplit`` as
    before."""
    hosts = netloc.rpartition("@")[2]
    if "," not in hosts:
        try:
            _ = urlsplit(f"//{netloc}").port
        except ValueError as exc:
            return f"has an invalid port ({exc})"
        return None
    for host in hosts.split(","):
        match = _LISTED_HOST.fullmatch(host)
        if match is None:
            return f"has an invalid host {host!r} in its host list"
        if match.group(1) is not None and not 0 < int(match.group(1)) < 65536:
            return f"has an invalid port in its host list ({host!r}: out of range 1-65535)"
    return None


def _check_url(url: Any) -> str | None:
    """Why ``url`` is not a usable PostgreSQL URL, or None when it is."""
    if not isinstance(url, str) or not url.strip():
        return "must be a non-empty postgresql:// URL"
    try:
        parts = urlsplit(url.strip())
    except ValueError as exc:
        return f"is not a valid URL ({exc})"
    hosts_problem = host_list_problem(parts.netloc)
    if hosts_problem is not None:
        return f"is not a valid URL ({hosts_problem})"
    if parts.scheme not in _SCHEMES:
        return f"scheme must be postgresql or postgres (got {parts.scheme or 'none'!r})"
    if not parts.hostname and "host=" not in parts.query:
        return "has no host"
    if "," in parts.path:
        return "has a comma outside its query string (pairs are separated by commas)"
    return None


def _check_name(name: Any) -> str | None:
    if not isinstance(name, str) or SHARD_NAME.fullmatch(name) is None:
        return f"shard name {name!r} must match [a-z0-9_-]{{1,32}}"
    return None


def parse_shards(pairs: list[tuple[Any, Any]], source: str) -> tuple[Shard, ...]:
    """Validate ``(name, url)`` pairs from ``source``; ``ConfigError`` lists every fault."""
    errors: list[str] = []
    seen: set[str] = set()
    shards: list[Shard] = []
    if not pairs:
        errors.append(f"{source}: names no shard (leave it unset for the single shard "
                      f"{DEFAULT_SHARD!r})")  # fmt: skip
    for name, url in pairs:
        problem = _check_name(name)
        if problem is None and name in seen:
            problem = f"shard name {name!r} appears twice"
        url_problem = _check_url(url)
        if url_problem is not None:
            shown = scrub(url) if isinstance(url, str) else repr(url)
            problem = (problem + "; " if problem else "") + f"url {shown} {url_problem}"
        if problem is not None:
            errors.append(f"{source}: {problem}")
            continue
        seen.add(name)
        shards.append(Shard(name, url.strip()))
    if errors:
        if len(errors) == 1:
            raise ConfigError(f"invalid shards: {errors[0]}")
        raise ConfigError("invalid shards:\n  " + "\n  ".join(errors))
    return tuple(shards)


def parse_shards_env(value: str, source: str = "DUETIME_SHARDS") -> tuple[Shard, ...]:
    """``name=url,name=url`` to shards (see the module docstring for the comma rule)."""
    text = value.strip()
    starts = list(_PAIR_START.finditer(text))
    pairs: list[tuple[Any, Any]] = []
    if not starts or starts[0].start() != 0:
        head = text if not starts else text[: starts[0].start()]
        if head.strip(", "):
            # Something before the first recognisable pair: report it as it is.
            bad_name, sep, bad_url = head.partition("=")
            if not sep:
                raise ConfigError(
                    f"invalid shards: {source}: {scrub(head.strip())!r} is not name=postgresql-url"
                )
            pairs.append((bad_name.strip(), bad_url.strip()))
    for i, match in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
        pairs.append((match.group(1), text[match.end() : end].strip()))
    return parse_shards(pairs, source)


def parse_shards_table(table: Any, source: str = "[shards]") -> tuple[Shard, ...]:
    """A TOML ``[shards]`` table (``name = "url"``) to shards."""
    if not isinstance(table, Mapping):
        raise ConfigError(f'invalid shards: {source} must be a table of name = "url"')
    return parse_shards(list(table.items()), source)


def shards_from(
    database_url: str,
    env_value: str | None = None,
    toml_table: Any = None,
    *,
    toml_source: str = "[shards]",
) -> tuple[Shard, ...]:
    """The configured shards: the environment wins over the TOML table; neither set
    gives the single shard ``main`` at ``database_url``."""
    if env_value is not None and env_value.strip():
        return parse_shards_env(env_value)
    if toml_table is not None:
        return parse_shards_table(toml_table, toml_source)
    return (Shard(DEFAULT_SHARD, database_url),)
