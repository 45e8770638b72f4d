"""Leader election on etcd: which shards this node may lead, and for how long it may
believe it. An unsharded cluster is the one shard ``main``; nothing below differs.

**Keys.** The node grants one etcd lease and puts ``<prefix>/members/<node>`` on it
(value: the node id). Each shard has its election key (value: the node id, a contract
operators and tests read): ``<prefix>/leader`` for the one shard of an unsharded
cluster, ``<prefix>/shards/<name>/leader`` when sharded
(``scheduler.config.shards.election_key``). A key is created on the node's lease with
one transaction: *if its create_revision is 0 (absent), put it, else read it*. etcd
applies transactions one at a time, so at most one node creates each incarnation of a
key. One lease per node, not per shard: the etcd lease load grows with replicas, not
shards, and a dead node's member key and every shard key it held vanish in one
revision when its lease expires, so no observer ever sees a dead node's shards unled
while the node still looks alive.

**Epochs.** A shard's *epoch* is the create_revision of the key this node created.
Revisions come from etcd's single, strictly increasing counter, so every later
incarnation has a larger epoch: it is the fencing token the leader writes to
PostgreSQL. Giving a shard up deletes the key only if its create_revision is still the
epoch, so a late delete can never remove a newer leader.

**Trust window.** The lease is renewed every TTL/3 (less if the margin is huge, so two
refreshes can fail before the window closes) and trusted until ``sent_at + TTL -
safety_margin`` of the last successful refresh (``lease.LeaseDeadline``). Every shard
this node leads shares that window: ``is_leader(shard)`` is false once it closes, and
all shards are reported lost at that moment, before etcd could let another node
create any of the keys. A lease etcd says is gone (TTL <= 0) loses everything at once
too; the node then grants a new lease, registers again and campaigns afresh (every new
key incarnation has a new epoch). A key that is deleted or replaced behind this node's
back is reported lost when the next read shows it. The window is the first line of
defence, not the guarantee: CLOCK_MONOTONIC stops while a VM is suspended, and a
process can stall between checking ``is_leader`` and committing. The database fence
(``leader_fence``) is what makes a zombie harmless.

**Campaign with trust to spare.** A campaign needs at least a renew interval of the
window left (``campaign_floor``), so the next renewal lands before the window closes;
the keepalive renews a new lease as soon as it is registered. A lease granted late (the
request held by a network that has just healed, or by an etcd that is restarting)
earns a window measured from when it was *sent*, which may be nearly spent on arrival:
when the grant took more than half a renew interval, the node refreshes the lease once
before it campaigns. Without that, every
node that came back from an outage would win a shard, lose it within milliseconds and
register again, and leadership would change hands several times after each outage.

**What to lead.** ``assignment`` decides from each read which shards to campaign for
and which to hand over. The read is one range request over the prefix (members and
shard keys at one revision), repeated every ``poll_interval`` and at once when a watch
on the prefix reports any change, so a resignation or an expiry is acted on in
milliseconds and a broken watch costs at most one poll interval. Handing over deletes
the shard's key incarnation after the owner was told and had ``handler_timeout`` to
stop that shard's duties; the standby the plan chose campaigns on the DELETE it sees.
With one shard there is nothing to balance, so no node waits to settle: every node
that does not lead it campaigns the moment it is unled.

**Bounds.** A dead node's shards are unled when etcd expires its lease (at most TTL
after its last refresh, plus etcd's expiry sweep of up to 0.5 s); the watch wakes the
nodes the plan names and one transaction each re-leads them: within TTL + 1 s. A
stopping node revokes its lease, so its shards are re-led within one watch event, one
read and one transaction. A node that joins gets its share once the others have seen
the same membership for ``settle`` (default ``min(1 s, TTL/2)``, 0 for one shard): one
read, one delete per surplus shard and one transaction by the newcomer.

**Keys we do not adopt.** A key holding our node id on another lease (a previous
process with this node id: a fast restart) is left to expire. We cannot prove its
holder is gone: a paused process with the same node id would wake up holding the same
epoch, and a fence cannot tell two holders of one epoch apart. A graceful shutdown
revokes the lease and avoids the wait. A key on our *own* lease that we hold no term
for (a transaction whose reply was lost) is deleted, never adopted, and campaigned for
again.

**The owner.** ``handler(event)`` is awaited for every ``gained`` and ``lost`` event
(bounded by ``handler_timeout``; an exception is logged), and ``events()`` yields the
same events to one consumer. Every background task is owned and cancelled by
``stop()``, which reports each led shard lost and revokes the lease (every key at once,
so standbys take over immediately). etcd errors are retried with jittered back-off on
the next endpoint, except a refusal of our credentials: waiting cannot fix it, so the
events end with ``fatal`` (``ServiceUnavailable(transient=False)``, naming the user,
never the password). Every etcd call has a deadline (``etcd_client.EtcdConnection``:
gRPC keepalive notices a frozen etcd under an idle watch in 5-7 s, a killed one at
once). The loops also check a stop flag: grpc can turn the cancellation of a call into
an RPC error, which a retry loop would otherwise take for an etcd failure and carry on.

The keys, the trust window and the hand-over are one state machine over one lease: its
loops share the terms and the window they guard, so they stay in one class.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import aetcd

from scheduler.backoff import bounded_jitter
from scheduler.clock import SYSTEM_CLOCK, Clock
from scheduler.config.shards import SHARD_NAME, member_key, shard_key
from scheduler.errors import ConfigError, ServiceUnavailable, describe
from scheduler.leadership.assignment import DEFAULT_GRACE, Assigner, View
from scheduler.leadership.etcd_client import (
    ETCD_ERRORS,
    EtcdConnection,
    EtcdTLS,
    refused_credentials,
)
from scheduler.leadership.lease import LeaseDeadline, default_safety_margin
from scheduler.log import get_logger

__all__ = ["Elector", "LeaderInfo", "ShardEvent", "ShardTerm"]

log = get_logger(__name__)


def _range_end(key: bytes) -> bytes:
    """The end of the range of keys starting with ``key``."""
    return key[:-1] + bytes([key[-1] + 1])


class LeaderInfo(NamedTuple):
    node_id: str
    epoch: int


@dataclass(frozen=True)
class ShardTerm:
    """This node's leadership of one shard. ``epoch`` is the shard's fencing token."""

    shard: str
    epoch: int
    lease_id: int
    node_id: str
    elected_at: float  # clock.monotonic() when the key was created


@dataclass(frozen=True)
class ShardEvent:
    kind: Literal["gained", "lost"]
    term: ShardTerm
    reason: str  # gained: "campaign"; lost: rebalance, lease_*, key_*, stopped

    @property
    def shard(self) -> str:
        return self.term.shard


Handler = Callable[[ShardEvent], Awaitable[None]]


class Elector:
    """Campaign for, hold and hand over this node's share of ``shards``.

    ``shards`` names the shards (each on ``<prefix>/shards/<name>/leader``) or maps
    each to its election key."""

    def __init__(
        self,
        endpoints: Sequence[str],
        prefix: str,
        node_id: str,
        shards: Sequence[str] | Mapping[str, str],
        *,
        ttl: float = 10.0,
        safety_margin: float | None = None,
        call_timeout: float = 2.0,
        poll_interval: float = 0.5,
        settle: float | None = None,
        grace: float | None = None,
        handler: Handler | None = None,
        handler_timeout: float | None = None,
        clock: Clock | None = None,
        username: str | None = None,
        password: str | None = None,
        tls: EtcdTLS | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if not endpoints:
            raise ConfigError("at least one etcd endpoint is required")
        if not node_id or "/" in node_id:
            raise ConfigError(f"node_id must be non-empty and without '/' (got {node_id!r})")
        names = list(shards)
        bad = [s for s in names if SHARD_NAME.fullmatch(s) is None]
        if not names or bad or len(set(names)) != len(names):
            raise ConfigError(f"shards must be unique names [a-z0-9_-]{{1,32}} (got {names})")
        keys = (
            dict(shards)
            if isinstance(shards, Mapping)
            else {s: shard_key(prefix, s) for s in names}
        )
        margin = default_safety_margin(ttl) if safety_margin is None else safety_margin
        if ttl <= 0 or not 0 <= margin < ttl:
            raise ConfigError(
                f"need lease ttl > 0 and 0 <= safety margin < ttl (got {ttl}, {margin})"
            )
        if call_timeout <= 0 or not 0 < poll_interval <= ttl:
            raise ConfigError(
                f"need call_timeout > 0 and 0 < poll_interval <= ttl "
                f"(got {call_timeout}, {poll_interval})"
            )
        self.prefix = prefix.rstrip("/")
        self.node_id = node_id
        self.shards = tuple(names)
        self.ttl = ttl
        self.safety_margin = margin
        self.etcd_ttl = max(1, math.ceil(ttl))
        self.renew_interval = min(ttl / 3, (ttl - margin) / 2)
        self.campaign_floor = self.renew_interval
        """The least trust a campaign starts with: a whole renew interval, so the next
        renewal has time to land before the window closes."""
        self.call_timeout = call_timeout
        self.poll_interval = poll_interval
        self.handler_timeout = call_timeout if handler_timeout is None else handler_timeout
        self._clock: Clock = clock or SYSTEM_CLOCK
        self._rng = rng or random.Random()
        alone = len(names) == 1  # nothing to balance: nobody waits for an unled shard
        if settle is None:
            settle = 0.0 if alone else min(1.0, ttl / 2)
        if grace is None:
            grace = 0.0 if alone else DEFAULT_GRACE
        self._assigner = Assigner(node_id, self._clock, settle=settle, grace=grace)

        def connection() -> EtcdConnection:  # one for requests, one for the watch
            return EtcdConnection(
                endpoints, call_timeout=call_timeout, username=username, password=password,
                tls=tls,
            )  # fmt: skip

        self._kv, self._watch_conn = connection(), connection()
        self._member_key = member_key(self.prefix, node_id).encode()
        self._shard_keys = {s: k.encode() for s, k in keys.items()}
        self._by_key = {k: s for s, k in self._shard_keys.items()}
        self._handler = handler
        self._events: asyncio.Queue[ShardEvent | None] = asyncio.Queue()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._lease_id: int | None = None
        self._unrevoked: set[int] = set()  # leases given up while etcd was unreachable
        self._lease_changed = asyncio.Event()
        self._deadline: LeaseDeadline | None = None
        self._terms: dict[str, ShardTerm] = {}
        self._seen: dict[str, Any] = {}  # shard -> its key as the last read showed it
        self._hold_off: dict[str, float] = {}  # shard -> monotonic time to campaign again
        self._stopping = False
        self.fatal: BaseException | None = None
        """Set when etcd refused our credentials: the node stopped campaigning for good."""
        self.view: View | None = None
        """The last read of the cluster (None before the first)."""
        self._log = log.bind(node_id=node_id, etcd_prefix=self.prefix)

    # -- what the owner asks ----------------------------------------------------------

    def is_leader(self, shard: str) -> bool:
        """True only while this node holds ``shard``'s key inside the lease's window."""
        return shard in self._terms and self._trusted()

    def term(self, shard: str) -> ShardTerm | None:
        return self._terms.get(shard) if self._trusted() else None

    def leading(self) -> dict[str, ShardTerm]:
        """The shards this node may act for right now, with their terms."""
        return dict(self._terms) if self._trusted() else {}

    async def hand_over(self, shard: str, reason: str, *, hold_off: float = 0.0) -> None:
        """Give ``shard`` up now if this node leads it: the owner is told (a ``lost``
        event with ``reason``), then the key's incarnation is deleted, so the node the
        plan names next campaigns on the DELETE it sees. For ``hold_off`` seconds this
        node does not campaign for the shard again (an owner that failed to lead it, e.g.
        a fence that is ahead, should not take it straight back). A shard not led is
        left alone, apart from the hold-off."""
        if hold_off > 0:
            self._hold_off[shard] = self._clock.monotonic() + hold_off
        await self._resign(shard, reason)
        self._wake.set()

    def valid_until(self) -> float | None:
        """The monotonic instant the trust window closes; None while it is closed."""
        deadline = self._deadline
        return deadline.valid_until if deadline is not None and self._trusted() else None

    async def current_leader(self, shard: str) -> LeaderInfo | None:
        """Who holds ``shard``'s key as etcd sees it now, or None (one bounded get).

        Raises ``ServiceUnavailable`` when etcd cannot answer in time."""
        key = self._shard_keys[shard]
        try:
            kv = await self._kv.call(lambda c: c.get(key))
        except ETCD_ERRORS as exc:
            if refused_credentials(exc):
                raise self._refused(exc) from None
            raise ServiceUnavailable(f"etcd did not answer: {describe(exc)}") from exc
        if kv is None:
            return None
        return LeaderInfo(bytes(kv.value).decode(errors="replace"), kv.create_revision)

    async def check(self) -> None:
        """One bounded read of this node's member key (readiness); raises when etcd
        does not answer."""
        await self._kv.call(lambda c: c.get(self._member_key))

    def _held_off(self, shard: str) -> bool:
        until = self._hold_off.get(shard)
        if until is None:
            return False
        if self._clock.monotonic() < until:
            return True
        del self._hold_off[shard]
        return False

    def _trusted(self) -> bool:
        return self._deadline is not None and not self._deadline.expired(self._clock.monotonic())

    async def events(self) -> AsyncIterator[ShardEvent]:
        """Gained/lost events until ``stop()``; raises ``fatal`` if that ended it."""
        while True:
            event = await self._events.get()
            if event is None:
                if self.fatal is not None:
                    raise self.fatal
                return
            yield event

    # -- start / stop -------------------------------------------------------------------

    async def start(self) -> None:
        """Start the background tasks (returns at once; campaigning happens in them)."""
        if self._tasks:
            raise RuntimeError("Elector already started")
        self._tasks = [
            asyncio.create_task(self._run(), name=f"shards-run-{self.node_id}"),
            asyncio.create_task(self._keepalive(), name=f"shards-keepalive-{self.node_id}"),
            asyncio.create_task(self._watch(), name=f"shards-watch-{self.node_id}"),
        ]

    async def stop(self) -> None:
        """Report every led shard lost, revoke the lease, cancel the tasks. Safe to call
        before ``start`` and twice."""
        if self._stopping:
            return
        self._stopping = True
        self._wake.set()
        pending, self._tasks = set(self._tasks), []
        while pending:
            for task in pending:
                task.cancel()  # again on later passes: a library may turn one into an error
            _, pending = await asyncio.wait(pending, timeout=self.call_timeout)
        await self._lose_all("stopped")
        lease_id, self._lease_id, self._deadline = self._lease_id, None, None
        if lease_id is not None:
            await self._revoke_quietly(lease_id)
        await self._kv.close()
        await self._watch_conn.close()
        self._events.put_nowait(None)

    async def __aenter__(self) -> Elector:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- the loop: read, decide, act ----------------------------------------------------

    async def _run(self) -> None:
        failures = 0
        while not self._stopping:
            try:
                await self._round()
                failures = 0
                delay = self.poll_interval
            except ETCD_ERRORS as exc:
                if refused_credentials(exc):
                    self.fatal = self._refused(exc)
                    self._log.error("election_etcd_refused", error=describe(exc))
                    self._events.put_nowait(None)
                    return
                failures += 1
                delay = bounded_jitter(failures, base=0.1, cap=self.poll_interval, rng=self._rng)
                self._log.warning("election_etcd_error", attempt=failures, error=describe(exc))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()
            self._wake.clear()

    def _refused(self, exc: BaseException) -> ServiceUnavailable:
        """The one line for credentials etcd refused (the password is never in it)."""
        username = self._kv.username
        who = f"user {username!r}" if username else "no user name (etcd_username unset)"
        return ServiceUnavailable(
            f"etcd at {self._kv.endpoint} refused {who} on {self.prefix}/: {exc}; check "
            "etcd_username/etcd_password and the user's role",
            transient=False,
        )

    async def _round(self) -> None:
        if self._lease_id is None or not self._trusted():
            await self._register()
        elif self._unrevoked:
            await self._revoke_given_up()
        view, revision = await self._read()
        if self.node_id not in view.members and self._lease_id is not None:
            lease_id = self._lease_id  # our member key was deleted: others must see us
            await self._kv.call(
                lambda c: c.put(self._member_key, self.node_id.encode(), lease=lease_id)
            )
            self._log.warning("member_key_restored", lease_id=lease_id)
        self.view = view
        await self._check_terms(view, revision)
        decision = self._assigner.decide(view, leading=set(self._terms))
        for shard in sorted(decision.resign):
            await self._resign(shard, "rebalance")
        room = decision.room
        for shard in decision.campaign:
            if room <= 0 or self._stopping:
                break
            if view.holder(shard) is None and shard not in self._terms:
                if self._held_off(shard):
                    continue
                if await self._acquire(shard):
                    room -= 1

    async def _register(self) -> None:
        """A fresh lease with the member key on it (the old one, if any, is revoked)."""
        old, self._lease_id, self._deadline = self._lease_id, None, None
        await self._lose_all("lease_unconfirmed")
        if old is not None:
            self._unrevoked.add(old)
        await self._revoke_given_up()
        sent_at = self._clock.monotonic()
        lease = await self._kv.call(lambda c: c.lease(self.etcd_ttl))
        try:
            await self._kv.call(
                lambda c: c.put(self._member_key, self.node_id.encode(), lease=lease.id)
            )
        except BaseException:
            await self._revoke_quietly(lease.id)
            raise
        deadline = LeaseDeadline(self.ttl, self.safety_margin)
        deadline.renewed(sent_at, lease.ttl)
        if self._clock.monotonic() - sent_at > self.renew_interval / 2:
            # The grant was held up (a partition that just healed delivers it late): the
            # window it earned is nearly spent, and a node that campaigned on it would win
            # a shard and lose it again within milliseconds, handing leadership around
            # after every outage. One refresh sent now earns a whole window first.
            try:
                await self._confirm(lease.id, deadline)
            except BaseException:
                await self._revoke_quietly(lease.id)
                raise
        self._lease_id, self._deadline = lease.id, deadline
        self._lease_changed.set()  # the keepalive renews it from now, not after a nap
        self._log.info("member_registered", lease_id=lease.id, granted_ttl=lease.ttl)

    async def _revoke_given_up(self) -> None:
        """Revoke every lease given up while etcd could not be told (tried again each
        round until etcd confirms): a restarted etcd renews the leases it kept, so our
        old keys would otherwise block their shards for another TTL after it is back."""
        for stale in sorted(self._unrevoked):
            if await self._revoke_quietly(stale):
                self._unrevoked.discard(stale)

    async def _confirm(self, lease_id: int, deadline: LeaseDeadline) -> None:
        """One refresh of a lease this node just registered, renewing ``deadline``."""
        sent_at = self._clock.monotonic()
        reply = await self._kv.call(lambda c: c.refresh_lease(lease_id))
        if reply is None or reply.TTL <= 0:
            raise aetcd.ClientError(f"lease {lease_id:x} expired before it was confirmed")
        deadline.renewed(sent_at, int(reply.TTL))

    async def _read(self) -> tuple[View, int]:
        start = f"{self.prefix}/".encode()
        result = await self._kv.call(lambda c: c.get_range(start, _range_end(start)))
        members: set[str] = set()
        leaders: dict[str, str | None] = {}
        self._seen = {}
        member_prefix = member_key(self.prefix, "").encode()
        for kv in result:
            key = bytes(kv.key)
            if key.startswith(member_prefix):
                members.add(key[len(member_prefix) :].decode(errors="replace"))
            elif key in self._by_key:
                shard = self._by_key[key]
                holder = bytes(kv.value).decode(errors="replace")
                if holder == self.node_id and kv.lease != self._lease_id:
                    holder = f"{holder}@old-lease-{kv.lease:x}"  # not ours: let it expire
                leaders[shard] = holder
                self._seen[shard] = kv
        return View(frozenset(members), self.shards, leaders), result.header.revision

    async def _check_terms(self, view: View, revision: int) -> None:
        """Drop terms whose key the read shows gone or replaced; delete orphans of ours."""
        for shard, term in list(self._terms.items()):
            if revision < term.epoch:
                continue  # a read older than the key: says nothing about it
            kv = self._seen.get(shard)
            if kv is None:
                await self._lose(shard, "key_deleted")
            elif kv.create_revision != term.epoch or kv.lease != term.lease_id:
                await self._lose(shard, "key_replaced")
        for shard, kv in self._seen.items():
            if kv.lease == self._lease_id and shard not in self._terms:
                self._log.warning("election_key_orphan_deleted", shard=shard,
                                  epoch=kv.create_revision)  # fmt: skip
                await self._delete_incarnation(shard, kv.create_revision)
                self._wake.set()

    async def _acquire(self, shard: str) -> bool:
        lease_id, key, deadline = self._lease_id, self._shard_keys[shard], self._deadline
        if lease_id is None or deadline is None:
            return False
        if deadline.remaining(self._clock.monotonic()) < self.campaign_floor:
            return False  # a term that would end before the next renewal: wait for it
        won, responses = await self._kv.call(
            lambda c: c.transaction(
                compare=[c.transactions.create(key) == 0],
                success=[
                    c.transactions.put(key, self.node_id.encode(), lease=lease_id),
                    c.transactions.get(key),
                ],
                failure=[],
            )
        )
        if not won:
            return False
        _, kv = responses[1][0]
        if lease_id != self._lease_id or not self._trusted():
            # The lease changed while the transaction was in flight: not ours to trust.
            await self._delete_incarnation(shard, kv.create_revision)
            return False
        term = ShardTerm(shard, kv.create_revision, lease_id, self.node_id,
                         self._clock.monotonic())  # fmt: skip
        self._terms[shard] = term
        self._log.info("leadership_acquired", shard=shard, epoch=term.epoch)
        await self._emit(ShardEvent("gained", term, "campaign"))
        return True

    async def _resign(self, shard: str, reason: str) -> None:
        term = self._terms.get(shard)
        if term is None:
            return
        await self._lose(shard, reason)  # the owner stops the shard's duties first
        await self._delete_incarnation(shard, term.epoch)
        self._log.info("leadership_resigned", shard=shard, epoch=term.epoch)

    async def _delete_incarnation(self, shard: str, epoch: int) -> None:
        key = self._shard_keys[shard]
        try:
            await self._kv.call(
                lambda c: c.transaction(
                    compare=[c.transactions.create(key) == epoch],
                    success=[c.transactions.delete(key)],
                    failure=[],
                )
            )
        except ETCD_ERRORS as exc:  # the key then goes with the lease
            self._log.warning("election_key_delete_failed", shard=shard, error=describe(exc))

    async def _lose(self, shard: str, reason: str) -> None:
        term = self._terms.pop(shard, None)
        if term is None:
            return
        self._log.warning("leadership_lost", shard=shard, epoch=term.epoch, reason=reason)
        await self._emit(ShardEvent("lost", term, reason))

    async def _lose_all(self, reason: str) -> None:
        """Every term ends at once; the owner is told of all of them concurrently, so one
        slow handler does not delay stopping the other shards' duties."""
        terms, self._terms = self._terms, {}
        for shard, term in sorted(terms.items()):
            self._log.warning("leadership_lost", shard=shard, epoch=term.epoch,
                              reason=reason)  # fmt: skip
        await asyncio.gather(
            *(self._emit(ShardEvent("lost", term, reason)) for _, term in sorted(terms.items()))
        )

    async def _emit(self, event: ShardEvent) -> None:
        self._events.put_nowait(event)
        if self._handler is None:
            return
        try:
            await asyncio.wait_for(self._handler(event), self.handler_timeout)
        except Exception as exc:
            self._log.error("election_handler_failed", shard=event.shard, kind=event.kind,
                            error=describe(exc))  # fmt: skip

    # -- the lease ----------------------------------------------------------------------

    async def _keepalive(self) -> None:
        """Renew every renew_interval; drop every shard the moment the window closes."""
        failures = 0
        while not self._stopping:
            lease_id, deadline = self._lease_id, self._deadline
            now = self._clock.monotonic()
            if lease_id is None or deadline is None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(self.poll_interval, self.renew_interval)):
                        await self._lease_changed.wait()
                self._lease_changed.clear()
                continue
            if deadline.expired(now):
                if self._terms:
                    self._log.warning("lease_unconfirmed", failed_renewals=failures)
                await self._lose_all("lease_unconfirmed")
                self._wake.set()
                await self._clock.sleep(min(self.poll_interval, self.renew_interval))
                continue
            sent_at = now
            try:
                reply = await self._refresh(lease_id, deadline, now, failures)
                if reply is None:
                    raise aetcd.ClientError("lease keepalive stream closed without a reply")
            except ETCD_ERRORS as exc:
                failures += 1
                remaining = deadline.remaining(self._clock.monotonic())
                self._log.warning(
                    "lease_renew_failed", attempt=failures, error=describe(exc),
                    trust_remaining=round(remaining, 3),
                )  # fmt: skip
                await self._clock.sleep(min(
                    bounded_jitter(failures, base=0.05, cap=self.renew_interval, rng=self._rng),
                    remaining,
                ))  # fmt: skip
                continue
            if lease_id != self._lease_id:
                continue
            if reply.TTL <= 0:
                self._log.warning("lease_expired", lease_id=lease_id)
                self._lease_id, self._deadline = None, None
                await self._lose_all("lease_expired")
                self._wake.set()
                continue
            deadline.renewed(sent_at, int(reply.TTL))
            failures = 0
            now = self._clock.monotonic()
            next_renew = sent_at + self.renew_interval
            await self._clock.sleep(max(0.0, min(next_renew, deadline.valid_until or now) - now))

    async def _refresh(
        self, lease_id: int, deadline: LeaseDeadline, now: float, failures: int
    ) -> Any:
        """One refresh, given no longer than the trust window has left. The window's end
        must be noticed when it comes, not a call timeout (or the close of a connection
        that a partition left hanging, up to another second) later: if it closes first,
        every term is lost at that instant and the call is left to finish."""
        budget = min(self.call_timeout, deadline.remaining(now))
        refresh = asyncio.create_task(
            self._kv.call(lambda c: c.refresh_lease(lease_id), budget), name="elector:refresh"
        )
        try:
            await asyncio.wait({refresh}, timeout=deadline.remaining(now))
            if not refresh.done():  # the wait ended with the window (to timer precision)
                if self._terms:
                    self._log.warning("lease_unconfirmed", failed_renewals=failures + 1)
                await self._lose_all("lease_unconfirmed")
                self._wake.set()
            return await refresh
        finally:
            if not refresh.done():
                refresh.cancel()

    async def _revoke_quietly(self, lease_id: int) -> bool:
        """Revoke ``lease_id``; False unless etcd confirmed it gone (revoked, or "not
        found": expired already)."""
        try:
            await self._kv.call(lambda c: c.revoke_lease(lease_id))
        except ETCD_ERRORS as exc:
            self._log.info("lease_revoke_failed", lease_id=lease_id, error=describe(exc))
            return "not found" in str(exc)
        self._log.info("lease_revoked", lease_id=lease_id)
        return True

    # -- the watch: wake the loop on any change -----------------------------------------

    async def _watch(self) -> None:
        failures = 0
        prefix = f"{self.prefix}/".encode()
        while not self._stopping:
            client = self._watch_conn.client()
            watch = None
            try:
                watch = await asyncio.wait_for(client.watch_prefix(prefix), self.call_timeout)
                failures = 0
                async with asyncio.timeout(self.ttl):  # renew even if the stream died silently
                    async for _event in watch:
                        self._wake.set()
                        if self._stopping:
                            return
            except TimeoutError as exc:
                if watch is None:
                    await self._watch_conn.discard(client, exc)
                    failures += 1
            except ETCD_ERRORS as exc:
                await self._watch_conn.discard(client, exc)
                failures += 1
            finally:
                if watch is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(watch.cancel(), self.call_timeout)
            if failures:
                await self._clock.sleep(
                    bounded_jitter(failures, base=0.1, cap=self.poll_interval, rng=self._rng)
                )
