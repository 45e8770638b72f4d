"""Configuration: one validated ``Settings`` object from defaults, a TOML file,
the environment and command-line flags (in increasing precedence, DESIGN §7).

Why a hand-rolled schema instead of a settings library: every field needs three
spellings (TOML key, ``DUETIME_*`` variable, ``--flag``), redaction of secrets, and
errors that teach ("unknown key 'lease_tl' in duetime.toml; did you mean
'lease_ttl'?"). The table below is the single source for all three; a bad value
produces exactly one line naming the source it came from, and *all* bad values are
reported together so an operator fixes a file in one pass.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import socket
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from scheduler.errors import ConfigError
from scheduler.secrets import read_credentials  # systemd credentials (security)

__all__ = ["DEFAULT_DB_TIMEOUT", "FIELDS", "Settings", "load_settings", "redact_url"]

#: Seconds any one wait on PostgreSQL may take by default: connecting, a connection from
#: a pool, one statement (x3, client side). Stores built without settings use it too.
DEFAULT_DB_TIMEOUT = 10.0


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


# A comma that starts another URL ("...,amqps://..."): the commas of a libpq multi-host
# netloc ("postgresql://h1:5432,h2:5432/db") are not followed by a scheme.
_URL_LIST_SEPARATOR = re.compile(r",\s*(?=[a-z][a-z0-9+.-]*://)", re.IGNORECASE)


# -- parsers: each takes the raw value (str from env/flags, typed from TOML) -----------


def _url(schemes: tuple[str, ...]) -> Callable[[Any], str]:
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
        try:
            _ = parts.port
        except ValueError as exc:
            raise ValueError(f"has an invalid port ({exc})") from None
        return value

    return parse


def _url_list(schemes: tuple[str, ...]) -> Callable[[Any], str]:
    """One URL or several, comma-separated (TOML: also a list); each checked like a single
    one. The value stays one string, the URLs joined by "," in the order given
    (``scheduler.broker.amqp_urls`` splits it)."""
    one = _url(schemes)

    def parse(value: Any) -> str:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list | tuple) or not items:
            raise ValueError("must be a URL or a comma-separated list of URLs")
        urls: list[str] = []
        for number, raw in enumerate(items, start=1):
            item = raw.strip() if isinstance(raw, str) else raw
            try:
                url = one(item)
            except ValueError as exc:
                where = f"URL {number} of {len(items)}" if len(items) > 1 else "URL"
                raise ValueError(f"{where} {exc}") from None
            if url in urls:
                raise ValueError(f"lists {redact_url(url)} twice")
            urls.append(url)
        return ",".join(urls)

    return parse


def _endpoints(value: Any) -> tuple[str, ...]:
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


def _number(kind: type, *, minimum: float | None = None, exclusive: bool = False) -> Callable:
    def parse(value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError(f"must be a {kind.__name__}, not a boolean")
        try:
            number = kind(value)
        except (TypeError, ValueError):
            raise ValueError(f"must be a {kind.__name__} (got {value!r})") from None
        if minimum is not None and (number <= minimum if exclusive else number < minimum):
            relation = ">" if exclusive else ">="
            raise ValueError(f"must be {relation} {minimum} (got {value!r})")
        return number

    return parse


def _optional_seconds(*, minimum: float, exclusive: bool = False) -> Callable[[Any], Any]:
    """Seconds, or unset (None / empty: the default derived from other settings)."""
    number = _number(float, minimum=minimum, exclusive=exclusive)

    def parse(value: Any) -> float | None:
        return None if value in (None, "") else float(number(value))

    return parse


def _optional_port(value: Any) -> int | None:
    if value in (None, "", "0", 0, "off", "none"):
        return None
    port = _number(int, minimum=1)(value)
    if port > 65535:
        raise ValueError(f"must be a TCP port 1-65535 (got {value!r})")
    return int(port)


def _choice(*options: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = str(value).lower()
        if text not in options:
            raise ValueError(f"must be one of {', '.join(options)} (got {value!r})")
        return text

    return parse


def _text(value: Any) -> str:
    text = str(value).strip()
    if not text:
        raise ValueError("must not be empty")
    if len(text) > 200:
        raise ValueError("is longer than 200 characters")
    return text


def _optional_text(value: Any) -> str | None:
    text = str(value).strip() if value is not None else ""
    return text or None


def _prefix(value: Any) -> str:
    text = _text(value).strip("/")
    if not text or any(c.isspace() for c in text):
        raise ValueError(f"must be a non-empty key prefix without spaces (got {value!r})")
    return text


def _listen(value: Any) -> str:
    """``host:port`` (``[v6]:port`` for IPv6); port 0 picks a free one."""
    text = str(value).strip()
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"must be host:port, e.g. 127.0.0.1:8089 (got {value!r})")
    return text


def _default_node_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class Field:
    name: str
    parse: Callable[[Any], Any]
    help: str
    secret: bool = False


@dataclass(frozen=True)
class Settings:
    """Everything a duetime process needs to know, validated.

    Field docs live in ``FIELDS`` (they double as ``--help`` and the README table).
    """

    database_url: str = "postgresql://postgres@127.0.0.1:5432/duetime"
    amqp_url: str = "amqp://guest:guest@127.0.0.1:5672/"
    etcd_endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    etcd_prefix: str = "duetime"
    etcd_username: str | None = None
    etcd_password: str | None = None
    etcd_ca_file: str | None = None
    etcd_cert_file: str | None = None
    etcd_key_file: str | None = None
    node_id: str = field(default_factory=_default_node_id)
    lease_ttl: float = 10.0
    lease_safety_margin: float | None = None
    etcd_timeout: float = 2.0
    metrics_port: int | None = None
    dashboard_listen: str = "127.0.0.1:8089"
    dashboard_token: str | None = None
    log_level: str = "info"
    log_format: str = "auto"
    db_timeout: float = DEFAULT_DB_TIMEOUT
    amqp_timeout: float = 10.0
    claim_batch_size: int = 500
    poll_interval: float = 1.0
    probe_interval: float = 0.05
    visibility_timeout: float = 60.0
    reconcile_interval: float = 5.0
    max_republishes: int = 10
    planner_horizon: float = 10.0
    partition_days_ahead: int = 14
    retention_days: float = 7.0
    worker_concurrency: int = 16
    worker_grace_period: float = 30.0
    task_timeout: float = 1800.0
    delivery_limit: int = 20
    scheduler_statement_timeout: float | None = None
    scheduler_tcp_user_timeout: float | None = None
    fence_takeover_grace: float = 1.0

    def redacted(self) -> dict[str, Any]:
        """The settings as a dict safe to log or print (no passwords)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            spec = FIELDS[f.name]
            if spec.secret and value:
                value = "***"
            elif f.name.endswith("_url") and isinstance(value, str):
                value = redact_url(value)
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    def __repr__(self) -> str:  # never leak a password through repr() in a traceback
        inner = ", ".join(f"{k}={v!r}" for k, v in self.redacted().items())
        return f"Settings({inner})"

    @property
    def effective_safety_margin(self) -> float:
        """Margin subtracted from the TTL before a leader stops trusting its lease."""
        if self.lease_safety_margin is not None:
            return self.lease_safety_margin
        return min(max(0.25, self.lease_ttl * 0.2), 2.0)

    @property
    def effective_statement_timeout(self) -> float:
        """``statement_timeout`` of scheduler sessions: at most (and by default) one TTL,
        so a frozen leader's running statement ends before its successor needs the fence."""
        if self.scheduler_statement_timeout is not None:
            return self.scheduler_statement_timeout
        return self.lease_ttl

    @property
    def effective_tcp_user_timeout(self) -> float:
        """``tcp_user_timeout`` of scheduler sessions (0: off); default one TTL."""
        if self.scheduler_tcp_user_timeout is not None:
            return self.scheduler_tcp_user_timeout
        return self.lease_ttl


FIELDS: dict[str, Field] = {
    f.name: f
    for f in [
        Field("database_url", _url(("postgresql", "postgres")), "PostgreSQL URL (libpq form)"),
        Field(
            "amqp_url",
            _url_list(("amqp", "amqps")),
            "RabbitMQ URL, or the nodes of a cluster comma-separated; its vhost isolates clusters",
        ),
        Field("etcd_endpoints", _endpoints, "etcd endpoints, comma-separated host:port"),
        Field("etcd_prefix", _prefix, "key prefix isolating clusters sharing an etcd"),
        Field("etcd_username", _optional_text, "etcd user (auth enabled clusters)"),
        Field("etcd_password", _optional_text, "etcd password", secret=True),
        # TLS to etcd (scheduler/etcd_client.py): on when a CA file is set.
        Field("etcd_ca_file", _optional_text, "CA file (PEM) for etcd; set: TLS to etcd"),
        Field("etcd_cert_file", _optional_text, "client cert (PEM) for etcd --client-cert-auth"),
        Field("etcd_key_file", _optional_text, "key (PEM) of etcd_cert_file"),
        Field("node_id", _text, "this process's node id (default host-pid)"),
        Field("lease_ttl", _number(float, minimum=1.0), "leader lease TTL in seconds"),
        Field(
            "lease_safety_margin",
            lambda v: None if v in (None, "") else _number(float, minimum=0.0)(v),
            "seconds before lease expiry at which a leader stops acting (default 20% of TTL)",
        ),
        Field("etcd_timeout", _number(float, minimum=0.0, exclusive=True), "etcd call timeout"),
        Field("metrics_port", _optional_port, "Prometheus /metrics port (off when unset)"),
        Field("dashboard_listen", _listen, "host:port of `duetime dashboard`"),
        Field(
            "dashboard_token",
            _optional_text,
            "token the dashboard asks for (login form or Bearer); unset: loopback only",
            secret=True,
        ),
        Field("log_level", _choice("debug", "info", "warning", "error"), "log level"),
        Field("log_format", _choice("auto", "json", "console"), "auto: JSON unless a TTY"),
        Field("db_timeout", _number(float, minimum=0.0, exclusive=True), "PostgreSQL timeout"),
        Field("amqp_timeout", _number(float, minimum=0.0, exclusive=True), "RabbitMQ timeout"),
        Field("claim_batch_size", _number(int, minimum=1), "jobs claimed per transaction"),
        Field(
            "poll_interval",
            _number(float, minimum=0.0, exclusive=True),
            "backstop poll when no wake-up arrives",
        ),
        Field(
            "probe_interval",
            _number(float, minimum=0.0, exclusive=True),
            "how often the dispatcher re-reads the earliest pending run time",
        ),
        Field(
            "visibility_timeout",
            _number(float, minimum=1.0),
            "seconds a dispatched job may go without a sign of life before it is re-published",
        ),
        Field("reconcile_interval", _number(float, minimum=0.1), "reconciler period"),
        Field(
            "max_republishes",
            _number(int, minimum=1),
            "re-publishes of a silent dispatched job before it goes dead",
        ),
        Field("planner_horizon", _number(float, minimum=1.0), "seconds of fire times planned"),
        Field("partition_days_ahead", _number(int, minimum=1), "daily partitions created ahead"),
        Field("retention_days", _number(float, minimum=0.0), "days finished jobs are kept"),
        Field("worker_concurrency", _number(int, minimum=1), "handlers run at once per worker"),
        Field(
            "worker_grace_period",
            _number(float, minimum=0.0),
            "seconds in-flight handlers get after SIGTERM",
        ),
        Field(
            "task_timeout",
            _number(float, minimum=0.0, exclusive=True),
            "seconds a handler may run when its task sets no timeout",
        ),
        Field("delivery_limit", _number(int, minimum=1), "broker redeliveries before dead-letter"),
        # Zombie leaders (scheduler/replica.py session_settings, scheduler/fence.py).
        Field(
            "scheduler_statement_timeout",
            _optional_seconds(minimum=0.0, exclusive=True),
            "statement_timeout of scheduler sessions (default and maximum: lease_ttl)",
        ),
        Field(
            "scheduler_tcp_user_timeout",
            _optional_seconds(minimum=0.0),
            "seconds PostgreSQL keeps sending to a scheduler that stopped reading (default "
            "lease_ttl; 0: off)",
        ),
        Field(
            "fence_takeover_grace",
            _number(float, minimum=0.0),
            "seconds a new leader waits for an older epoch's open transactions before it "
            "terminates their sessions (less than lease_ttl)",
        ),
    ]
}

assert set(FIELDS) == {f.name for f in dataclasses.fields(Settings)}, "FIELDS out of sync"

ENV_PREFIX = "DUETIME_"


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _suggest(key: str, *, env: bool = False) -> str:
    close = difflib.get_close_matches(key, FIELDS, n=1)
    if not close:
        return ""
    return f"; did you mean {env_name(close[0])}?" if env else f"; did you mean {close[0]!r}?"


def _invalid(errors: list[str]) -> ConfigError:
    """One line for one bad value (the CLI prints it after 'duetime: error:'), else a list."""
    if len(errors) == 1:
        return ConfigError(f"invalid configuration: {errors[0]}")
    return ConfigError("invalid configuration:\n  " + "\n  ".join(errors))


def _read_toml(path: Path) -> Mapping[str, Any]:
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
    # Accept either top-level keys or a [duetime] table.
    if set(data) == {"duetime"} and isinstance(data["duetime"], dict):
        data = data["duetime"]
    return data


def load_settings(
    *,
    config_file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Build settings: defaults < TOML file < environment < overrides (flags).

    Raises ``ConfigError`` listing every bad value, one per line, each naming its source.
    """
    env = os.environ if env is None else env
    raw: dict[str, tuple[Any, str]] = {}
    errors: list[str] = []

    path = config_file or env.get(ENV_PREFIX + "CONFIG")
    if path:
        path = Path(path)
        for key, value in _read_toml(path).items():
            if key not in FIELDS:
                errors.append(f"unknown key {key!r} in {path}{_suggest(key)}")
                continue
            raw[key] = (value, f"{path}: {key}")

    known_env = {env_name(n) for n in FIELDS} | {ENV_PREFIX + "CONFIG"}
    for key, value in env.items():
        if not key.startswith(ENV_PREFIX) or key.startswith(ENV_PREFIX + "TEST_"):
            continue
        if key not in known_env:
            name = key[len(ENV_PREFIX) :].lower()
            errors.append(f"unknown environment variable {key}{_suggest(name, env=True)}")
            continue
        if key != ENV_PREFIX + "CONFIG":
            raw[key[len(ENV_PREFIX) :].lower()] = (value, key)

    # -- systemd LoadCredential= (scheduler/secrets.py): credentials override the
    # environment and the TOML file; flags below still override them. ------------------
    raw.update(read_credentials(env))

    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key not in FIELDS:
            raise ConfigError(f"unknown setting {key!r}{_suggest(key)}")
        raw[key] = (value, "--" + key.replace("_", "-"))

    values: dict[str, Any] = {}
    for key, (value, source) in raw.items():
        spec = FIELDS[key]
        try:
            values[key] = spec.parse(value)
        except ValueError as exc:
            shown = "***" if spec.secret else value
            if key.endswith("_url") and isinstance(value, str):
                shown = redact_url(value)
            errors.append(f"{source}={shown!s}: {key} {exc}")
    if errors:
        raise _invalid(errors)
    settings = Settings(**values)
    tls_files = (settings.etcd_ca_file, settings.etcd_cert_file, settings.etcd_key_file)
    if settings.etcd_ca_file is None and any(tls_files):
        errors.append("etcd_cert_file/etcd_key_file need etcd_ca_file (it turns TLS on)")
    if (settings.etcd_cert_file is None) != (settings.etcd_key_file is None):
        errors.append("etcd_cert_file and etcd_key_file must be set together")
    if errors:
        raise _invalid(errors)
    ttl = settings.lease_ttl
    margin = settings.effective_safety_margin
    if margin >= ttl:
        errors.append(f"lease_safety_margin {margin} must be smaller than lease_ttl {ttl}")
    if settings.effective_statement_timeout > ttl:
        errors.append(
            f"scheduler_statement_timeout {settings.effective_statement_timeout} must be at "
            f"most lease_ttl {ttl} (a frozen leader's statement must end before its "
            "successor needs the fence)"
        )
    if settings.fence_takeover_grace >= ttl:
        errors.append(
            f"fence_takeover_grace {settings.fence_takeover_grace} must be smaller than "
            f"lease_ttl {ttl}"
        )
    if errors:
        raise _invalid(errors)
    return settings
