"""Producers on several shards: which shard a new job goes to, and one ``JobStore`` each.

A job lives in exactly one shard's database, so the producer API picks the shard when
the job is created, in this order:

1. an explicit ``shard=`` (a job that must sit next to the caller's own rows, or that
   the caller enqueues inside its own transaction with ``conn=``);
2. else, with a unique key, ``shard_for_unique_key``: the same hash of the queue and the
   key (``queue NUL unique_key``). A unique key is enforced by the trigger of one
   database only, so every enqueue of one ``(queue, unique_key)`` must reach the same
   shard or two live jobs could hold it; the queue is part of the hash because the key
   space is per queue. This comes before the idempotency key: a job with both is
   deduplicated by its idempotency key only against that shard, so a producer using
   both derives them from the same thing (one idempotency key, one unique key) or pins
   ``shard=``;
3. else, with an idempotency key, ``shard_for_key``: BLAKE2b (8-byte digest) of the
   UTF-8 key, as a big-endian integer, modulo K over the shard names **sorted**. The
   same key always lands in the same shard, on every producer, whatever order the
   shards are configured in, so two jobs with one key meet the same idempotency ledger
   and the effect is applied once, as on a single database;
4. else round-robin over the shards (per router), spreading keyless jobs evenly.

Resizing: going from K to K+1 shards changes the shard of most keys (modulo, not a
consistent hash), so a key enqueued before the resize and again after it may land in
two different shards, meet two ledgers, and run twice; a unique key held in its old
shard is not seen by the new one either. Deduplication by idempotency key and
uniqueness are per shard; a resize is a moment to let keyed jobs finish first, or to
route the keys that must not run twice explicitly.

Plain-SQL producers are unaffected: they insert into whichever shard's database they
are connected to. The single-shard ``JobStore`` stays the API of one database; the
router only chooses a store and delegates to it.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import asyncpg

from scheduler import db
from scheduler.config import Settings
from scheduler.errors import InvalidInput
from scheduler.jobspec import DEFAULT_MAX_ATTEMPTS, DEFAULT_QUEUE, JobSpec
from scheduler.store.conn import Conn
from scheduler.store.jobs import JobStore, OnConflict
from scheduler.store.rows import Job

__all__ = ["RoutedJob", "ShardRouter", "shard_for_key", "shard_for_unique_key"]


def shard_for_key(key: str, shards: Iterable[str]) -> str:
    """The shard of an idempotency key: BLAKE2b-64 of the key modulo K, over the sorted
    shard names (stable across processes, Python versions and configuration order)."""
    names = sorted(shards)
    if not names:
        raise ValueError("no shards to route to")
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return names[int.from_bytes(digest, "big") % len(names)]


def shard_for_unique_key(queue: str, unique_key: str, shards: Iterable[str]) -> str:
    """The shard of a unique key in ``queue``: ``shard_for_key`` of ``queue NUL key``.
    NUL appears in neither a queue name nor a unique key (both are validated), so two
    different pairs never hash the same text."""
    return shard_for_key(f"{queue}\0{unique_key}", shards)


@dataclass(frozen=True, slots=True)
class RoutedJob:
    """A job and the shard it was written to (job ids are unique per shard only)."""

    shard: str
    job: Job


class ShardRouter:
    """One ``JobStore`` per shard and the routing rule of the module docstring.

    Build it from stores (``ShardRouter({"a": store_a, ...})``) or, owning its pools,
    with ``await ShardRouter.open(settings)`` and ``await router.close()``."""

    def __init__(
        self, stores: Mapping[str, JobStore], *, pools: Iterable[asyncpg.Pool] = ()
    ) -> None:
        if not stores:
            raise ValueError("a router needs at least one shard")
        self._stores = dict(stores)
        self.names = tuple(self._stores)
        self._next = itertools.cycle(self.names)
        self._pools = list(pools)

    @classmethod
    async def open(cls, settings: Settings, *, max_size: int = 2) -> ShardRouter:
        """A pool of at most ``max_size`` connections per shard of ``settings``."""
        stores: dict[str, JobStore] = {}
        pools: list[asyncpg.Pool] = []
        try:
            for name, url in settings.shard_urls.items():
                pool = await db.create_pool(
                    url,
                    min_size=1,
                    max_size=max_size,
                    timeout=settings.db_timeout,
                    application_name=f"duetime:{settings.node_id}",
                    pooler=settings.database_pooler,
                )
                pools.append(pool)
                stores[name] = JobStore(pool, acquire_timeout=settings.db_timeout)
        except BaseException:
            for pool in pools:
                pool.terminate()
            raise
        return cls(stores, pools=pools)

    async def close(self) -> None:
        """Close the pools ``open`` created (stores passed in are the caller's)."""
        pools, self._pools = self._pools, []
        for pool in pools:
            await pool.close()

    async def __aenter__(self) -> ShardRouter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def store(self, shard: str) -> JobStore:
        """The ``JobStore`` of ``shard``; ``InvalidInput`` naming the known shards."""
        store = self._stores.get(shard)
        if store is None:
            raise InvalidInput(f"unknown shard {shard!r} (shards: {', '.join(self.names)})")
        return store

    def route(
        self,
        *,
        shard: str | None = None,
        idempotency_key: str | None = None,
        unique_key: str | None = None,
        queue: str = DEFAULT_QUEUE,
    ) -> str:
        """The shard a new job goes to: explicit, else by ``(queue, unique_key)``, else
        by idempotency key, else round-robin (the module docstring says why)."""
        if shard is not None:
            self.store(shard)  # an unknown name fails here, naming the known ones
            return shard
        if unique_key is not None:
            return shard_for_unique_key(queue, unique_key, self.names)
        if idempotency_key is not None:
            return shard_for_key(idempotency_key, self.names)
        return next(self._next)

    async def enqueue(
        self,
        task: str,
        payload: dict[str, Any] | None = None,
        *,
        shard: str | None = None,
        due_at: datetime | None = None,
        delay: timedelta | float | None = None,
        queue: str = DEFAULT_QUEUE,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        idempotency_key: str | None = None,
        unique_key: str | None = None,
        on_conflict: OnConflict = "skip",
        unique_for: timedelta | None = None,
        priority: int = 0,
        limit_key: str | None = None,
        tags: Sequence[str] = (),
        meta: dict[str, Any] | None = None,
        conn: Conn | None = None,
    ) -> RoutedJob:
        """``JobStore.enqueue`` on the routed shard (``unique_key``, ``on_conflict``,
        ``unique_for``, ``priority``, ``limit_key``, ``tags`` and ``meta`` mean what they
        mean there; a
        limit is enforced per shard, on the rows of the shard the job lands in). ``conn`` (the
        caller's transaction) belongs to one database, so with several shards it needs
        ``shard=`` too; a pinned unique key is unique within that shard only."""
        if conn is not None and shard is None and len(self.names) > 1:
            raise InvalidInput("enqueue with conn= on several shards needs shard= (its database)")
        name = self.route(
            shard=shard, idempotency_key=idempotency_key, unique_key=unique_key, queue=queue
        )
        job = await self._stores[name].enqueue(
            task,
            payload,
            due_at=due_at,
            delay=delay,
            queue=queue,
            max_attempts=max_attempts,
            idempotency_key=idempotency_key,
            unique_key=unique_key,
            on_conflict=on_conflict,
            unique_for=unique_for,
            priority=priority,
            limit_key=limit_key,
            tags=tags,
            meta=meta,
            conn=conn,
        )
        return RoutedJob(name, job)

    async def bulk_enqueue(
        self, specs: Iterable[JobSpec], *, shard: str | None = None
    ) -> dict[str, int]:
        """``JobStore.bulk_enqueue`` per shard, each spec routed like ``enqueue`` (all to
        ``shard`` when given). Returns rows inserted per shard; each shard's COPY is its
        own transaction, so a failure can leave earlier shards' rows written."""
        groups: dict[str, list[JobSpec]] = {}
        for spec in specs:
            name = self.route(shard=shard, idempotency_key=spec.idempotency_key)
            groups.setdefault(name, []).append(spec)
        return {name: await self._stores[name].bulk_enqueue(rows) for name, rows in groups.items()}
