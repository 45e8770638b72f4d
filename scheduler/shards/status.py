"""``duetime status`` of a sharded cluster: leader, fence epoch and backlog per shard.

Each shard is judged exactly like the single database (``scheduler.status.evaluate``):
its election key ``<prefix>/shards/<name>/leader`` stands where ``<prefix>/leader``
stands, its own database's fence row and queue counts where the one database's stand.
What differs is only how the parts are read and reported:

- every shard's database is read concurrently, each with its own one-connection pool
  and the usual timeouts, so a shard that cannot be reached is reported as such (with
  its error, as a ``database_unreachable`` problem) and the other shards are still
  shown;
- etcd is read once for all shards, at one revision: the members (``<prefix>/members/
  <node>``, one per live replica, on that replica's lease) and every shard's election
  key, with the seconds left on each lease. etcd being unreachable is one warning for
  the whole report, as it is for one database: each shard is then judged from its fence.
- RabbitMQ, shared by the shards, is read once for the queues of every shard
  (``scheduler.broker_view``) and each shard is judged against it; RabbitMQ being
  unreachable is one problem for the whole report (every shard has it).

The report is healthy when no shard has a problem; a shard's problems are listed
together with the others', named by shard.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from typing import TYPE_CHECKING, Any

from scheduler import db
from scheduler.broker_view import BrokerView, read_broker
from scheduler.config import Settings
from scheduler.config.shards import member_key, shard_key
from scheduler.errors import ServiceUnavailable
from scheduler.log import scrub
from scheduler.status import (
    DEFAULT_MAX_UNSTARTED_AGE,
    STALE_RENEWALS,
    EtcdUnanswered,
    EtcdView,
    Finding,
    StatusReport,
    ask_etcd,
    evaluate,
    jsonable,
    lease_remaining,
    read_limits,
)
from scheduler.store.limits import LimitRow
from scheduler.store.rows import DbSnapshot
from scheduler.store.status import StatusStore

if TYPE_CHECKING:
    import aetcd

__all__ = [
    "Member",
    "ShardStatus",
    "ShardedEtcd",
    "ShardedReport",
    "SnapshotReader",
    "collect_shard_status",
    "read_shard_keys",
]


@dataclass(frozen=True, slots=True)
class Member:
    """A live replica: its member key exists (it vanishes with the replica's lease)."""

    node: str
    lease_remaining: float | None = None


@dataclass(frozen=True, slots=True)
class ShardedEtcd:
    """One read of the members and every shard's election key."""

    reachable: bool
    endpoint: str | None = None
    members: tuple[Member, ...] = ()
    keys: dict[str, EtcdView] = field(default_factory=dict)  # shard -> its election key
    error: str | None = None


@dataclass(frozen=True, slots=True)
class ShardStatus:
    """One shard: its judged report, or why its database could not be read."""

    name: str
    etcd: EtcdView
    report: StatusReport | None = None
    error: str | None = None  # set when the database was unreachable

    @property
    def problems(self) -> tuple[Finding, ...]:
        if self.report is None:
            return (Finding("database_unreachable", self.error or "unreachable"),)
        return self.report.problems

    @property
    def warnings(self) -> tuple[Finding, ...]:
        if self.report is None:
            return ()
        # etcd being unreachable is said once for the whole report, not once per shard
        return tuple(w for w in self.report.warnings if w.code != "etcd_unreachable")

    def backlog(self) -> dict[str, Any] | None:
        """The queues' counts added up: what an operator compares across shards."""
        if self.report is None:
            return None
        queues = self.report.snapshot.queues
        overdue = [q.oldest_overdue for q in queues if q.oldest_overdue is not None]
        unstarted = [q.oldest_unstarted for q in queues if q.oldest_unstarted is not None]
        return {
            "pending": sum(q.pending for q in queues),
            "due_now": sum(q.due_now for q in queues),
            "oldest_overdue": max(overdue, default=None),
            "dispatched": sum(q.dispatched for q in queues),
            "unstarted": sum(q.unstarted for q in queues),
            "oldest_unstarted": max(unstarted, default=None),
            "dead_last_hour": sum(q.dead_last_hour for q in queues),
        }

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "reachable": self.report is not None,
            "error": self.error,
            "healthy": not self.problems,
            "problems": [asdict(p) for p in self.problems],
            "warnings": [asdict(w) for w in self.warnings],
            "etcd": asdict(self.etcd),
            "leader": None,
            "backlog": self.backlog(),
            "queues": [],
            "schedules": None,
        }
        if self.report is not None:
            snap = self.report.snapshot
            out["leader"] = asdict(snap.fence)
            out["queues"] = [asdict(q) for q in snap.queues]
            out["schedules"] = asdict(snap.schedules) if snap.schedules is not None else None
        return out


@dataclass(frozen=True, slots=True)
class ShardedReport:
    shards: tuple[ShardStatus, ...]
    etcd: ShardedEtcd
    checked_at: datetime | None
    max_backlog_age: float
    stale_after: float
    broker: BrokerView | None = None
    max_unstarted_age: float = DEFAULT_MAX_UNSTARTED_AGE

    def findings(self, kind: str) -> list[tuple[str | None, Finding]]:
        """``(shard or None, finding)`` for ``kind`` "problems" or "warnings"."""
        found: list[tuple[str | None, Finding]] = [
            (s.name, f)
            for s in self.shards
            for f in getattr(s, kind)
            if f.code != "broker_unreachable"  # said once, below
        ]
        if kind == "problems" and self.broker is not None and not self.broker.reachable:
            text = f"RabbitMQ unreachable ({self.broker.error})"
            found.insert(0, (None, Finding("broker_unreachable", text)))
        if kind == "warnings" and not self.etcd.reachable:
            text = (
                f"etcd unreachable ({self.etcd.error}); leaders judged from each shard's "
                "database fence only"
            )
            found.insert(0, (None, Finding("etcd_unreachable", text)))
        return found

    @property
    def healthy(self) -> bool:
        return not self.findings("problems")

    @property
    def exit_code(self) -> int:
        return 0 if self.healthy else 1

    def to_dict(self) -> dict[str, Any]:
        def listed(kind: str) -> list[dict[str, Any]]:
            return [
                {**asdict(f), "shard": shard} if shard else asdict(f)
                for shard, f in self.findings(kind)
            ]

        return jsonable(
            {
                "healthy": self.healthy,
                "problems": listed("problems"),
                "warnings": listed("warnings"),
                "checked_at": self.checked_at,
                "thresholds": {
                    "max_backlog_age": self.max_backlog_age,
                    "leader_stale_after": self.stale_after,
                    "max_unstarted_age": self.max_unstarted_age,
                },
                "broker": asdict(self.broker) if self.broker is not None else None,
                "etcd": {
                    "reachable": self.etcd.reachable,
                    "endpoint": self.etcd.endpoint,
                    "error": self.etcd.error,
                },
                "members": [asdict(m) for m in self.etcd.members],
                "shards": [s.to_dict() for s in self.shards],
            }
        )


def _range_end(key: bytes) -> bytes:
    return key[:-1] + bytes([key[-1] + 1])


async def read_shard_keys(
    settings: Settings, shards: list[str], *, timeout: float | None = None
) -> ShardedEtcd:
    """The members and every shard's election key, from the first endpoint that answers."""
    prefix = settings.etcd_prefix.rstrip("/")
    members_start = member_key(prefix, "").encode()
    shards_start = shard_key(prefix, "").removesuffix("/leader").encode()
    keys = {shard_key(prefix, s).encode(): s for s in shards}

    async def read(client: aetcd.Client) -> tuple[list[Member], dict[str, EtcdView]]:
        # one range from the members to the shard keys: both at the same revision
        kvs = list(await client.get_range(members_start, _range_end(shards_start)))
        member_kvs = [kv for kv in kvs if bytes(kv.key).startswith(members_start)]
        shard_kvs = [kv for kv in kvs if bytes(kv.key) in keys]
        leases: dict[int, float | None] = {}
        for kv in [*member_kvs, *shard_kvs]:
            if kv.lease and kv.lease not in leases:
                leases[kv.lease] = await lease_remaining(client, kv.lease)
        members = [
            Member(bytes(kv.key)[len(members_start) :].decode("utf-8", "replace"),
                   leases.get(kv.lease))
            for kv in member_kvs
        ]  # fmt: skip
        views: dict[str, EtcdView] = {}
        for kv in shard_kvs:
            name = keys[bytes(kv.key)]
            views[name] = EtcdView(
                shard_key(prefix, name), True, leader=bytes(kv.value).decode("utf-8", "replace"),
                epoch=kv.create_revision, lease_remaining=leases.get(kv.lease),
            )  # fmt: skip
        return sorted(members, key=lambda m: m.node), views

    try:
        endpoint, (members, views) = await ask_etcd(
            settings, read, timeout=settings.etcd_timeout if timeout is None else timeout
        )
    except EtcdUnanswered as exc:
        return ShardedEtcd(False, error=str(exc))
    full = {
        s: replace(views[s], endpoint=endpoint)
        if s in views
        else EtcdView(shard_key(prefix, s), True, endpoint)
        for s in shards
    }
    return ShardedEtcd(True, endpoint, tuple(members), full)


async def _snapshot(settings: Settings, name: str, url: str) -> DbSnapshot | str:
    """The shard's snapshot, or why it could not be read (scrubbed of passwords)."""
    read = await _read_shard(settings, name, url)
    return read if isinstance(read, str) else read[0]


async def _read_shard(
    settings: Settings, name: str, url: str
) -> tuple[DbSnapshot, list[LimitRow]] | str:
    """The shard's snapshot and its limits with their use (``duetime status`` judges
    them as it does the single database's), or why they could not be read."""
    try:
        pool = await db.create_pool(
            url,
            min_size=1,
            max_size=1,
            timeout=settings.db_timeout,
            application_name=f"duetime:{settings.node_id}",
            pooler=settings.database_pooler,
            server_settings={"statement_timeout": str(int(settings.db_timeout * 1000))},
        )
    except ServiceUnavailable as exc:
        return scrub(str(exc))
    try:
        async with asyncio.timeout(settings.db_timeout * 3):
            snap = await StatusStore(pool, acquire_timeout=settings.db_timeout).snapshot()
            return snap, await read_limits(pool, settings.db_timeout)
    except Exception as exc:  # asyncpg errors, OSError, TimeoutError: report, never crash
        return scrub(f"shard {name}: {type(exc).__name__}: {exc}")[:500]
    finally:
        await pool.close()


#: Reads one shard's snapshot, or says why it could not (``settings, name, url``).
SnapshotReader = Callable[[Settings, str, str], Awaitable[DbSnapshot | str]]


async def collect_shard_status(
    settings: Settings,
    *,
    max_backlog_age: float,
    etcd_timeout: float | None = None,
    snapshot: SnapshotReader | None = None,
    max_unstarted_age: float = DEFAULT_MAX_UNSTARTED_AGE,
    broker_timeout: float | None = None,
) -> ShardedReport:
    """Read every shard's database and etcd concurrently and judge each shard.

    ``snapshot``: how a shard's database is read (default: a one-connection pool of its
    own, which reads the shard's limits too, judged like the single database's; a
    long-running process such as the dashboard passes one that uses its pools, and
    shows the limits on a page of their own).
    """
    urls = settings.shard_urls
    names = list(urls)
    etcd_task = asyncio.create_task(read_shard_keys(settings, names, timeout=etcd_timeout))
    limits: dict[str, list[LimitRow]] = {}
    if snapshot is None:
        reads = await asyncio.gather(*(_read_shard(settings, n, urls[n]) for n in names))
        snapshots: list[DbSnapshot | str] = []
        for name, read in zip(names, reads, strict=True):
            snapshots.append(read if isinstance(read, str) else read[0])
            if not isinstance(read, str):
                limits[name] = read[1]
    else:
        snapshots = list(await asyncio.gather(*(snapshot(settings, n, urls[n]) for n in names)))
    broker = await read_broker(
        settings,
        {q.queue for snap in snapshots if not isinstance(snap, str) for q in snap.queues},
        settings.amqp_timeout if broker_timeout is None else broker_timeout,
    )
    etcd = await etcd_task
    shards: list[ShardStatus] = []
    for name, snap in zip(names, snapshots, strict=True):
        view = etcd.keys.get(name) or EtcdView(
            shard_key(settings.etcd_prefix.rstrip("/"), name), False, error=etcd.error
        )
        if isinstance(snap, str):
            shards.append(ShardStatus(name, view, error=snap))
            continue
        report = evaluate(
            snap,
            view,
            lease_ttl=settings.lease_ttl,
            max_backlog_age=max_backlog_age,
            broker=broker,
            max_unstarted_age=max_unstarted_age,
            limits=limits.get(name, ()),
        )
        shards.append(ShardStatus(name, view, report=report))
    checked = [s.report.snapshot.db_now for s in shards if s.report is not None]
    return ShardedReport(
        tuple(shards),
        etcd,
        max(checked, default=None),
        max_backlog_age,
        STALE_RENEWALS * settings.lease_ttl,
        broker,
        max_unstarted_age,
    )
