"""The overview's table of shards and the cluster page's election key, for a sharded
cluster, read the way ``duetime status`` reads them (``scheduler.shards.status``).

Each shard's database is read through the dashboard's own pool for it (not a pool per
read, as the one-shot command does), with the overview's bound on counting pending
jobs: above ``PENDING_EXACT_LIMIT`` a shard's pending jobs are not counted (its row says
"at least"). etcd is read once for all shards. A shard that cannot be read is a row
that says so; the other rows and pages are unaffected.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from scheduler.config import Settings
from scheduler.config.shards import shard_key
from scheduler.dashboard.site import Dashboard
from scheduler.log import scrub
from scheduler.shards.status import Member, ShardedReport, collect_shard_status, read_shard_keys
from scheduler.status import EtcdView
from scheduler.store import DashboardStore
from scheduler.store.dashboard import PENDING_EXACT_LIMIT
from scheduler.store.rows import DbSnapshot

__all__ = ["ETCD_TIMEOUT", "MAX_BACKLOG_AGE", "ShardsView", "read_shard_etcd", "read_shards"]

ETCD_TIMEOUT = 1.5  # the overview polls every 5 s: a dead etcd must not hold it long
BROKER_TIMEOUT = 3.0  # RabbitMQ: connection and queue reads together
MAX_BACKLOG_AGE = 60.0  # as the cluster page judges the one database


@dataclass(frozen=True, slots=True)
class ShardsView:
    report: ShardedReport
    uncounted: frozenset[str]  # shards whose pending jobs were too many to count
    pending_limit: int = PENDING_EXACT_LIMIT


async def read_shards(dash: Dashboard) -> ShardsView:
    """Every shard's leader, fence and backlog, judged as ``duetime status`` judges them."""
    uncounted: set[str] = set()
    settings = dash.settings

    async def snapshot(settings: Settings, name: str, url: str) -> DbSnapshot | str:
        try:
            async with asyncio.timeout(settings.db_timeout * 3):
                snap, capped = await DashboardStore(dash.shard(name).pool).status_snapshot()
        except Exception as exc:  # asyncpg errors, OSError, TimeoutError: a row says so
            detail = str(exc) or "no answer in time"
            return scrub(f"{type(exc).__name__}: {detail}")[:300]
        if capped:
            uncounted.add(name)
        return snap

    report = await collect_shard_status(
        settings,
        max_backlog_age=MAX_BACKLOG_AGE,
        etcd_timeout=ETCD_TIMEOUT,
        snapshot=snapshot,
        broker_timeout=BROKER_TIMEOUT,
    )
    return ShardsView(report, frozenset(uncounted))


async def read_shard_etcd(settings: Settings, shard: str) -> tuple[EtcdView, tuple[Member, ...]]:
    """One shard's election key ``<prefix>/shards/<name>/leader``, and the live replicas
    (their member keys), read together."""
    etcd = await read_shard_keys(settings, [shard], timeout=ETCD_TIMEOUT)
    view = etcd.keys.get(shard) or EtcdView(
        shard_key(settings.etcd_prefix, shard), False, error=etcd.error
    )
    return view, etcd.members
