"""``Settings`` and the table of its fields (``FIELDS``): for each setting its parser and
the help text that doubles as ``--help`` and the README table, and which are secrets.

The derived values (``effective_*``) live on ``Settings`` so every reader gets the same
default; the checks across fields are in ``scheduler.config.loading``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from scheduler.config import parsers as p
from scheduler.config.shards import DEFAULT_SHARD, Shard

#: Seconds any one wait on PostgreSQL may take by default: connecting, a connection from
#: a pool, one statement (x3, client side). Stores built without settings use it too.
DEFAULT_DB_TIMEOUT = 10.0

#: The shortest retention accepted. The retention is the idempotency window (a job whose
#: key completed less than this long ago is settled as a duplicate without running) and
#: how long a dead job stays for ``duetime jobs retry``; under a day, a duplicate sent the
#: next morning runs again and failures vanish before anyone looks. ``duetime.prune_ledger``
#: refuses less (migration 0013).
MIN_RETENTION_DAYS = 1.0


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
    node_id: str = field(default_factory=p.default_node_id)
    lease_ttl: float = 10.0
    lease_safety_margin: float | None = None
    etcd_timeout: float = 2.0
    metrics_port: int | None = None
    metrics_listen: str = "127.0.0.1"
    dashboard_listen: str = "127.0.0.1:8089"
    dashboard_token: str | None = None
    dashboard_hosts: tuple[str, ...] = ()
    dashboard_trusted_proxies: tuple[str, ...] = ()
    log_level: str = "info"
    log_format: str = "auto"
    event_loop: str = "auto"
    db_timeout: float = DEFAULT_DB_TIMEOUT
    database_pooler: str = "none"
    amqp_timeout: float = 10.0
    claim_batch_size: int = 500
    poll_interval: float = 1.0
    probe_interval: float = 0.05
    dispatch_buffer: int = 500
    dispatch_buffer_per_consumer: int = 64
    priority_max_wait: float = 300.0
    stage_ahead: float = 2.0
    visibility_timeout: float = 60.0
    reconcile_interval: float = 5.0
    max_republishes: int = 10
    planner_horizon: float = 10.0
    partition_days_ahead: int = 14
    retention_days: float = 7.0
    worker_concurrency: int = 16
    worker_grace_period: float = 30.0
    worker_threads: int = 0
    worker_stage_limit: int = 20000
    worker_prefetch: int = 0
    worker_max_abandoned_threads: int = 8
    task_timeout: float = 1800.0
    result_max_bytes: int = 1024 * 1024
    delivery_limit: int = 20
    scheduler_statement_timeout: float | None = None
    scheduler_tcp_user_timeout: float | None = None
    fence_takeover_grace: float = 1.0
    shards: tuple[Shard, ...] | None = None
    queues: tuple[str, ...] = ()

    def redacted(self) -> dict[str, Any]:
        """The settings as a dict safe to log or print (no passwords)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            spec = FIELDS[f.name]
            if f.name == "shards" and value is not None:
                value = {s.name: p.redact_url(s.url) for s in value}
            elif spec.secret and value:
                value = "***"
            elif f.name.endswith("_url") and isinstance(value, str):
                value = p.redact_url(value)
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    def __repr__(self) -> str:  # never leak a password through repr() in a traceback
        inner = ", ".join(f"{k}={v!r}" for k, v in self.redacted().items())
        return f"Settings({inner})"

    @property
    def shard_urls(self) -> dict[str, str]:
        """Shard name -> PostgreSQL URL, in configured order; without ``shards`` the one
        shard ``main`` at ``database_url``."""
        if self.shards is None:
            return {DEFAULT_SHARD: self.database_url}
        return {s.name: s.url for s in self.shards}

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


#: The table's own bound on a stored result (migration 0019, CHECK jobs_result_too_large).
MAX_RESULT_BYTES = 64 * 1024 * 1024
_result_bytes_number = p.number(int, minimum=1)


def _result_bytes(value: Any) -> int:
    number: int = _result_bytes_number(value)
    if number > MAX_RESULT_BYTES:
        raise ValueError(f"must be <= {MAX_RESULT_BYTES} (got {value!r})")
    return number


FIELDS: dict[str, Field] = {
    f.name: f
    for f in [
        Field("database_url", p.url(("postgresql", "postgres")), "PostgreSQL URL (libpq form)"),
        Field(
            "amqp_url",
            p.url_list(("amqp", "amqps")),
            "RabbitMQ URL, or the nodes of a cluster comma-separated; its vhost isolates clusters",
        ),
        Field("etcd_endpoints", p.endpoints, "etcd endpoints, comma-separated host:port"),
        Field("etcd_prefix", p.key_prefix, "key prefix isolating clusters sharing an etcd"),
        Field("etcd_username", p.optional_text, "etcd user (auth enabled clusters)"),
        Field("etcd_password", p.optional_text, "etcd password", secret=True),
        # TLS to etcd (scheduler/leadership/etcd_client.py): on when a CA file is set.
        Field("etcd_ca_file", p.optional_text, "CA file (PEM) for etcd; set: TLS to etcd"),
        Field("etcd_cert_file", p.optional_text, "client cert (PEM) for etcd --client-cert-auth"),
        Field("etcd_key_file", p.optional_text, "key (PEM) of etcd_cert_file"),
        Field("node_id", p.nonempty_text, "this process's node id (default host-pid)"),
        Field("lease_ttl", p.number(float, minimum=1.0), "leader lease TTL in seconds"),
        Field(
            "lease_safety_margin",
            lambda v: None if v in (None, "") else p.number(float, minimum=0.0)(v),
            "seconds before lease expiry at which a leader stops acting (default 20% of TTL)",
        ),
        Field("etcd_timeout", p.number(float, minimum=0.0, exclusive=True), "etcd call timeout"),
        Field("metrics_port", p.optional_port, "Prometheus /metrics port (off when unset)"),
        Field(
            "metrics_listen",
            p.listen_host,
            "address the metrics port binds (0.0.0.0: every interface, for a remote scraper)",
        ),
        Field("dashboard_listen", p.listen_address, "host:port of `duetime dashboard`"),
        Field(
            "dashboard_token",
            p.optional_text,
            "token the dashboard asks for (login form or Bearer); unset: loopback only",
            secret=True,
        ),
        Field(
            "dashboard_hosts",
            p.host_names,
            "host names the dashboard answers to besides its address (a proxy's name)",
        ),
        Field(
            "dashboard_trusted_proxies",
            p.proxy_addresses,
            "proxy addresses whose X-Forwarded-For/-Proto the dashboard believes (none)",
        ),
        Field("log_level", p.choice("debug", "info", "warning", "error"), "log level"),
        Field("log_format", p.choice("auto", "json", "console"), "auto: JSON unless a TTY"),
        Field(
            "event_loop",
            p.choice("auto", "uvloop", "asyncio"),
            "the commands' event loop; auto: uvloop where it is installed",
        ),
        Field("db_timeout", p.number(float, minimum=0.0, exclusive=True), "PostgreSQL timeout"),
        Field(
            "database_pooler",
            p.choice("none", "transaction"),
            "transaction: database_url is a pool in transaction mode (PgBouncer); "
            "workers, producers, CLI and dashboard only",
        ),
        Field("amqp_timeout", p.number(float, minimum=0.0, exclusive=True), "RabbitMQ timeout"),
        Field("claim_batch_size", p.number(int, minimum=1), "jobs claimed per transaction"),
        Field(
            "poll_interval",
            p.number(float, minimum=0.0, exclusive=True),
            "backstop poll when no wake-up arrives",
        ),
        Field(
            "probe_interval",
            p.number(float, minimum=0.0, exclusive=True),
            "how often the dispatcher re-reads the earliest pending run time",
        ),
        # Who decides the order (docs/architecture.md): the broker holds a short buffer.
        Field(
            "dispatch_buffer",
            p.number(int, minimum=1),
            "ready messages a job queue may hold at least (its target is the larger of this "
            "and consumers x dispatch_buffer_per_consumer); the rest waits in PostgreSQL",
        ),
        Field(
            "dispatch_buffer_per_consumer",
            p.number(int, minimum=0),
            "ready messages per consumer of a job queue the dispatcher keeps it topped up to",
        ),
        Field(
            "priority_max_wait",
            p.number(float, minimum=0.0),
            "seconds a due job waits behind higher priorities at most; after that it starts "
            "before fresher jobs, oldest first",
        ),
        Field(
            "stage_ahead",
            p.number(float, minimum=0.0, maximum=60.0),
            "seconds before their run time jobs are handed to workers, which start them "
            "from their own timers (0: off; jobs under a limit are never staged)",
        ),
        Field(
            "visibility_timeout",
            p.number(float, minimum=1.0),
            "seconds a dispatched job may go without a sign of life before it is re-published",
        ),
        Field("reconcile_interval", p.number(float, minimum=0.1), "reconciler period"),
        Field(
            "max_republishes",
            p.number(int, minimum=1),
            "re-publishes of a silent dispatched job before it goes dead",
        ),
        Field("planner_horizon", p.number(float, minimum=1.0), "seconds of fire times planned"),
        Field("partition_days_ahead", p.number(int, minimum=1), "daily partitions created ahead"),
        Field(
            "retention_days",
            p.number(float, minimum=MIN_RETENTION_DAYS),
            "days finished jobs, ledger rows and fire rows are kept (the idempotency window)",
        ),
        Field("worker_concurrency", p.number(int, minimum=1), "handlers run at once per worker"),
        Field(
            "worker_grace_period",
            p.number(float, minimum=0.0),
            "seconds in-flight handlers get after SIGTERM",
        ),
        Field(
            "worker_threads",
            p.number(int, minimum=0),
            "threads for plain def handlers (0: as many as worker_concurrency)",
        ),
        Field(
            "worker_stage_limit",
            p.number(int, minimum=0, maximum=65535),
            "staged jobs a worker holds until their run time at most (0: it takes none)",
        ),
        Field(
            "worker_prefetch",
            p.number(int, minimum=0, maximum=65535),
            "deliveries per queue a worker holds unacked at most: running, waiting and "
            "settling (0: worker_concurrency + 128; lower it for long jobs)",
        ),
        Field(
            "worker_max_abandoned_threads",
            p.number(int, minimum=0),
            "timed-out handler threads still running a worker tolerates before it restarts",
        ),
        Field(
            "task_timeout",
            p.number(float, minimum=0.0, exclusive=True),
            "seconds a handler may run when its task sets no timeout",
        ),
        Field(
            "result_max_bytes",
            _result_bytes,
            "largest handler result stored, in bytes of JSON (1..67108864); a larger one "
            "fails its attempt",
        ),
        Field("delivery_limit", p.number(int, minimum=1), "broker redeliveries before dead-letter"),
        # Zombie leaders (scheduler/leadership/policy.py session_settings,
        # scheduler/store/fenced.py).
        Field(
            "scheduler_statement_timeout",
            p.optional_seconds(minimum=0.0, exclusive=True),
            "statement_timeout of scheduler sessions (default and maximum: lease_ttl)",
        ),
        Field(
            "scheduler_tcp_user_timeout",
            p.optional_seconds(minimum=0.0),
            "seconds PostgreSQL keeps sending to a scheduler that stopped reading (default "
            "lease_ttl; 0: off)",
        ),
        Field(
            "fence_takeover_grace",
            p.number(float, minimum=0.0),
            "seconds a new leader waits for an older epoch's open transactions before it "
            "terminates their sessions (less than lease_ttl)",
        ),
        # Shards (scheduler/config/shards.py): URLs hold passwords, shown redacted.
        Field(
            "shards",
            p.shards,
            "shards as name=postgresql-url,... (TOML: a [shards] table); unset: one shard "
            "'main' at database_url",
            secret=True,
        ),
        Field(
            "queues",
            p.queue_names,
            "job queues `duetime migrate` declares (comma-separated; TOML: a list), besides "
            "those added with `duetime queues add`; only declared queues are dispatched",
        ),
    ]
}

assert set(FIELDS) == {f.name for f in dataclasses.fields(Settings)}, "FIELDS out of sync"
