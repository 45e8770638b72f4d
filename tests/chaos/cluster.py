"""A cluster of ``duetime scheduler`` processes, observed only from outside.

Three independent views of "who leads", which the tests cross-check:

- etcd: the value and create_revision (epoch) of ``<prefix>/leader``;
- PostgreSQL: the ``leader_fence`` row, plus an audit table filled by a trigger with
  every *committed* update of that row (epoch before/after, the writer's
  ``application_name`` = ``duetime:<node_id>``, ``clock_timestamp()``), so a test can
  prove that no write of a stale leader landed after a newer epoch was fenced;
- the processes themselves: their JSON log lines (``leading``/``stepping_down``, with
  node_id and epoch) and their ``duetime_is_leader`` gauge on ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import aetcd
import asyncpg

from tests.support.etcd import free_port
from tests.support.procs import ChildProcess, Processes, duetime_argv
from tests.support.wait import wait_for

AUDIT_SQL = """
CREATE TABLE IF NOT EXISTS public.fence_audit (
    id          bigserial   PRIMARY KEY,
    at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    app         text        NOT NULL DEFAULT current_setting('application_name'),
    old_epoch   bigint,
    new_epoch   bigint,
    leader_node text,
    renewed_at  timestamptz
);
CREATE OR REPLACE FUNCTION public.fence_audit_fn() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO public.fence_audit (old_epoch, new_epoch, leader_node, renewed_at)
    VALUES (OLD.epoch, NEW.epoch, NEW.leader_node, NEW.renewed_at);
    RETURN NEW;
END $$;
DROP TRIGGER IF EXISTS fence_audit ON duetime.leader_fence;
CREATE TRIGGER fence_audit AFTER UPDATE ON duetime.leader_fence
    FOR EACH ROW EXECUTE FUNCTION public.fence_audit_fn();
"""


def parse_ts(text: str) -> float:
    """A log line's ISO timestamp as epoch seconds (comparable with ``time.time()``)."""
    return datetime.fromisoformat(text).timestamp()


@dataclass
class Node:
    name: str  # the node id
    proc: ChildProcess
    metrics_port: int
    starts: int = 1

    def campaigning(self) -> bool:
        """Its latest start got as far as campaigning (standby or leader)."""
        events = self.events("replica_started", "campaigning")
        started = sum(1 for e in events if e["event"] == "replica_started")
        return started == self.starts and events[-1]["event"] == "campaigning"

    def events(self, *names: str) -> list[dict[str, Any]]:
        """This process's JSON log lines (optionally only these events), in order."""
        out = []
        for line in self.proc.output().splitlines():
            if not line.startswith("{"):
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:  # a line cut by kill -9
                continue
            if not names or event.get("event") in names:
                out.append(event)
        return out

    def leading_epoch(self) -> int | None:
        """The epoch this process last said it leads, unless it stepped down since."""
        current: int | None = None
        for event in self.events("leading", "stepping_down"):
            current = event["epoch"] if event["event"] == "leading" else None
        return current

    def terms(self, until: float | None = None) -> list[tuple[float, float, int]]:
        """(start, end, epoch) of each term this process led, from its logs; a term
        still open ends at ``until`` (default now)."""
        out: list[tuple[float, float, int]] = []
        start: tuple[float, int] | None = None
        for event in self.events("leading", "stepping_down"):
            if event["event"] == "leading":
                start = (parse_ts(event["timestamp"]), event["epoch"])
            elif start is not None:
                out.append((start[0], parse_ts(event["timestamp"]), start[1]))
                start = None
        if start is not None:
            out.append((start[0], until if until is not None else time.time(), start[1]))
        return out


class SchedulerCluster:
    """Spawns replicas into ``procs`` and reads etcd / PostgreSQL / logs / metrics."""

    def __init__(
        self,
        procs: Processes,
        env: Mapping[str, str],
        *,
        dsn: str,
        etcd_endpoint: str,
        prefix: str,
        ttl: float,
    ) -> None:
        self.procs = procs
        self.env = dict(env)
        self.env.update(
            DUETIME_DATABASE_URL=dsn,
            DUETIME_ETCD_PREFIX=prefix,
            DUETIME_LEASE_TTL=str(ttl),
            DUETIME_LOG_FORMAT="json",
        )
        self.dsn = dsn
        self.ttl = ttl
        self.key = f"{prefix}/leader".encode()
        host, _, port = etcd_endpoint.rpartition(":")
        self._etcd = aetcd.Client(host=host, port=int(port), timeout=1)
        self._db: asyncpg.Connection | None = None
        self.nodes: dict[str, Node] = {}

    async def __aenter__(self) -> SchedulerCluster:
        self._db = await asyncpg.connect(self.dsn, timeout=5)
        await self._db.execute(AUDIT_SQL)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.procs.kill_all()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._etcd.close(), 2)
        if self._db is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._db.close(), 2)

    # -- processes -------------------------------------------------------------------

    def spawn(self, name: str, **env: str) -> Node:
        port = free_port()
        proc = self.procs.spawn(
            duetime_argv("scheduler"),
            name=name,
            env={**self.env, "DUETIME_NODE_ID": name, "DUETIME_METRICS_PORT": str(port), **env},
        )
        node = Node(name, proc, port)
        self.nodes[name] = node
        return node

    def restart(self, node: Node) -> None:
        """Start a stopped/killed replica again (same node id, output appended)."""
        node.proc.start()
        node.starts += 1

    def alive(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.proc.running()]

    async def wait_all_up(self, timeout: float) -> None:
        """Every replica is running and has campaigned since its latest start."""

        def up() -> bool:
            return all(n.proc.running() and n.campaigning() for n in self.nodes.values())

        try:
            await wait_for(up, timeout=timeout, message="every replica campaigning")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.describe()}") from None

    # -- views ---------------------------------------------------------------------

    async def key_holder(self) -> tuple[str, int] | None:
        """(node id, epoch) from the election key in etcd, or None when vacant."""
        kv = await asyncio.wait_for(self._etcd.get(self.key), 2)
        if kv is None:
            return None
        return bytes(kv.value).decode(), kv.create_revision

    async def fence(self) -> asyncpg.Record:
        assert self._db is not None
        row = await self._db.fetchrow(
            "SELECT epoch, leader_node, elected_at, renewed_at FROM duetime.leader_fence "
            "WHERE shard = 0"
        )
        assert row is not None
        return row

    async def audit(self) -> list[asyncpg.Record]:
        assert self._db is not None
        return list(await self._db.fetch("SELECT * FROM public.fence_audit ORDER BY id"))

    async def is_leader_gauge(self, node: Node) -> float | None:
        """``duetime_is_leader`` from the node's /metrics (None if unreachable)."""
        url = f"http://127.0.0.1:{node.metrics_port}/metrics"

        def fetch() -> str:
            with urllib.request.urlopen(url, timeout=1) as response:
                return str(response.read().decode())

        try:
            text = await asyncio.to_thread(fetch)
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith("duetime_is_leader "):
                return float(line.split()[1])
        return None

    async def leader_now(self, exclude: Sequence[str] = ()) -> tuple[Node, int] | None:
        """The node that leads by all views: holds the key, the fence carries its epoch
        and node id, and its own log says it leads that epoch."""
        holder = await self.key_holder()
        if holder is None or holder[0] in exclude or holder[0] not in self.nodes:
            return None
        name, epoch = holder
        fence = await self.fence()
        if (fence["epoch"], fence["leader_node"]) != (epoch, name):
            return None
        node = self.nodes[name]
        if node.leading_epoch() != epoch:
            return None
        return node, epoch

    async def wait_leader(
        self, timeout: float, exclude: Sequence[str] = (), message: str = "a leader"
    ) -> tuple[Node, int]:
        async def probe() -> tuple[Node, int] | None:
            return await self.leader_now(exclude)

        try:
            found = await wait_for(probe, timeout=timeout, interval=0.01, message=message)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.describe()}") from None
        assert found is not None
        return found

    def describe(self) -> str:
        """Log tails of every node, for failure messages."""
        parts = []
        for node in self.nodes.values():
            parts.append(f"--- {node.name} ({node.proc!r})\n{node.proc.tail(25)}")
        return "\n".join(parts)

    async def stop_all(self) -> None:
        await self.procs.stop_all(timeout=5)
