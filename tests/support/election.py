"""One node's leadership of an unsharded cluster, step by step, for the election tests.

The scenarios of tests/integration/test_election.py (and the etcd parts of test_tls.py,
test_secrets.py, test_election_deadline.py) drive one node through campaign, hold and
resign and assert on each step. ``SingleKey`` gives them those steps on the one
``Elector``, leading the one shard ``main`` on ``<prefix>/leader``:

- ``campaign()`` starts an elector (a fresh one after a resign or a loss) and returns
  the term of the next ``gained`` event;
- ``hold(term)`` waits for that term's ``lost`` event and raises ``LeadershipLost``
  with its reason; the node then stops campaigning (its elector is stopped in the
  background) until ``campaign()`` is called again. Cancelling ``hold`` is a crash: the
  elector's tasks end, nothing is revoked, the lease expires on its own;
- ``resign(term)`` stops the elector: the lease is revoked, the key goes with it;
- ``close()`` is a crash too (nothing revoked), as a process that dies.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any, NoReturn

from scheduler.config.shards import DEFAULT_SHARD, election_key
from scheduler.errors import LeadershipLost
from scheduler.leadership.elector import Elector, LeaderInfo, ShardEvent, ShardTerm
from scheduler.leadership.etcd_client import EtcdTLS

__all__ = ["SingleKey", "Term"]

Term = ShardTerm


class SingleKey:
    """``<prefix>/leader`` as one node sees it, one step at a time (see above)."""

    def __init__(
        self,
        endpoints: Sequence[str],
        prefix: str,
        node_id: str,
        ttl: float,
        safety_margin: float | None = None,
        call_timeout: float = 2.0,
        username: str | None = None,
        password: str | None = None,
        *,
        tls: EtcdTLS | None = None,
    ) -> None:
        self._args: dict[str, Any] = dict(
            endpoints=list(endpoints), prefix=prefix, node_id=node_id,
            shards={DEFAULT_SHARD: election_key(prefix)}, ttl=ttl,
            safety_margin=safety_margin, call_timeout=call_timeout, username=username,
            password=password, tls=tls,
        )  # fmt: skip
        self._queries = self._new()  # refuses a bad configuration, as a node would
        self.key = election_key(prefix)
        self.node_id = node_id
        self.ttl = ttl
        self.safety_margin = self._queries.safety_margin
        self.etcd_ttl = self._queries.etcd_ttl
        self.renew_interval = self._queries.renew_interval
        self._elector: Elector | None = None
        self._events: AsyncIterator[ShardEvent] | None = None
        self._term: ShardTerm | None = None
        self._stopping: asyncio.Task[None] | None = None

    def _new(self) -> Elector:
        args = dict(self._args)
        return Elector(
            args.pop("endpoints"), args.pop("prefix"), args.pop("node_id"), args.pop("shards"),
            **args,
        )  # fmt: skip

    @property
    def state(self) -> str:
        """idle | candidate | follower (another node holds the key) | leader."""
        if self._elector is None:
            return "idle"
        if self._term is not None:
            return "leader"
        view = self._elector.view
        return "follower" if view is not None and view.holder(DEFAULT_SHARD) else "candidate"

    def is_leader(self) -> bool:
        elector, term = self._elector, self._term
        return elector is not None and term is not None and elector.term(DEFAULT_SHARD) == term

    def term_valid_until(self) -> float | None:
        return self._elector.valid_until() if self._elector and self.is_leader() else None

    async def current_leader(self) -> LeaderInfo | None:
        return await (self._elector or self._queries).current_leader(DEFAULT_SHARD)

    async def campaign(self) -> ShardTerm:
        if self._stopping is not None:
            await self._stopping
            self._stopping = None
        if self._elector is None:
            self._elector = self._new()
            self._events = self._elector.events()
            await self._elector.start()
        assert self._events is not None
        async for event in self._events:
            if event.kind == "gained":
                self._term = event.term
                return event.term
        raise LeadershipLost("stopped")

    async def hold(self, term: ShardTerm) -> NoReturn:
        events = self._events
        try:
            if term == self._term and events is not None:
                async for event in events:
                    if event.kind == "lost" and event.term == term:
                        self._term = None
                        self._stopping = asyncio.create_task(self._stop())
                        raise LeadershipLost(event.reason)
            raise LeadershipLost("resigned")
        except asyncio.CancelledError:
            await self._crash()
            raise

    async def resign(self, term: ShardTerm) -> None:
        self._term = None
        await self._stop()

    async def _stop(self) -> None:
        elector, self._elector = self._elector, None
        if elector is not None:
            await elector.stop()

    async def _crash(self) -> None:
        """End the elector's tasks without revoking anything: the lease expires."""
        elector, self._elector = self._elector, None
        if elector is None:
            return
        elector._stopping = True  # grpc may turn a cancellation into an error: loops check it
        pending, elector._tasks = set(elector._tasks), []
        while pending:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=1.0)
        with contextlib.suppress(Exception):
            await elector._kv.close()
            await elector._watch_conn.close()

    async def close(self) -> None:
        if self._stopping is not None:
            with contextlib.suppress(Exception):
                await self._stopping
        await self._crash()
        await self._queries.stop()
