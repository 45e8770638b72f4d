"""Leader election on etcd: who may dispatch, and for how long it may believe it.

States (``Election.state``)::

    idle ──campaign()──▶ candidate ⇄ follower (watching another node's key)
                             │ won the transaction
                             ▼
                        leader(term) ──hold() raises LeadershipLost──▶ lost
                             └────────resign(term)─────────────────▶ idle

A lost or idle election may ``campaign()`` again; every new term has a new epoch.

**The key.** One key, ``<prefix>/leader``, holds the leader's node id (a contract:
operators and tests read it) and is attached to the leader's etcd lease, so it vanishes
when the lease does. A candidate takes it with one transaction: *if the key's
create_revision is 0 (absent), put it with my lease, else read it*. etcd applies
transactions one at a time, so at most one candidate creates each incarnation of the key.

**Terms and epochs.** The winner's *epoch* is the create_revision of the key it created.
Revisions come from etcd's single, strictly increasing counter, so every later
incarnation has a larger epoch: it is the fencing token the leader writes to
PostgreSQL. A ``Term`` (epoch, lease id, node id) scopes everything a leader does:
``hold(term)`` renews only that term's lease and checks that the key is still that
incarnation (create_revision == epoch); ``resign(term)`` deletes the key only if its
create_revision is still the epoch, so a late resign can never remove a newer leader.

**Campaigning.** A candidate reads the key. If a leader exists it watches for the key's
DELETE from the revision it read (nothing between the read and the watch is missed) and
re-reads every TTL in case a stream broke silently. If the key is absent it grants a
fresh lease and runs the transaction; a lost race revokes that lease at once (no lease
is held while waiting). etcd errors are retried with jittered exponential back-off, on
the next endpoint — except a refusal of our credentials (wrong password, no user name
while auth is on, no permission on the prefix): waiting cannot fix it, so ``campaign()``
raises ``ServiceUnavailable(transient=False)`` naming the user, never the password, and
the replica exits with that one line. A candidate never busy-loops: it waits on a watch,
a back-off, or a call that has a deadline.

**Our own old key.** The key may hold *our* node id on a lease we do not hold: a
previous process with the same node id (a fast restart), or a transaction whose reply
was lost. We never adopt it. We cannot prove its holder is gone — a paused process with
the same node id would wake up holding the same epoch, and a fence cannot tell two
holders of one epoch apart. We wait for that lease to expire (at most one TTL; a
graceful shutdown resigns and avoids the wait) and win a new incarnation and epoch.

**The trust window** of a term (how long the leader may believe its lease after the
last refresh) and its safety margin are ``scheduler.leadership.lease``. ``hold()``
refreshes every TTL/3 (less if the margin is huge), so two refreshes can fail before the
window closes, and raises ``LeadershipLost`` when the window closes without a successful
refresh, when etcd says the lease is gone (TTL <= 0), or when the key is gone or another
incarnation. ``is_leader()``/``term_valid_until()`` let a duty check the window right
before acting: fail closed.

**Limits.** The window is the first line of defence, not the guarantee: CLOCK_MONOTONIC
stops while a VM is suspended, and a process can stall between checking ``is_leader()``
and committing. The database fence (``leader_fence``) is what makes a zombie harmless.

**Connections.** ``scheduler.leadership.etcd_client.EtcdConnection``: plain gRPC, or TLS
when an ``EtcdTLS`` is given, with the same keepalive options either way; every call has
a deadline, and endpoints are tried in turn. gRPC keepalive notices a frozen etcd under
an idle watch in 5-7 s (a killed one at once, by the connection reset); a leader
notices within TTL - margin either way.

**Size.** The module is over ~400 lines on purpose: a quarter is this design, and
campaign, hold and resign read and write one term's state (term, deadline, lost) that a
split would pass between objects. The pure parts are apart already: the trust window
(``lease``) and the etcd connection (``etcd_client``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, NoReturn, Protocol

import aetcd

from scheduler.backoff import bounded_jitter
from scheduler.clock import SYSTEM_CLOCK
from scheduler.errors import (
    ConfigError,
    DuetimeError,
    LeadershipLost,
    ServiceUnavailable,
    describe,
)
from scheduler.leadership.etcd_client import (
    ETCD_ERRORS,
    EtcdConnection,
    EtcdTLS,
    refused_credentials,
)
from scheduler.leadership.lease import LeaseDeadline, default_safety_margin
from scheduler.log import get_logger

__all__ = ["Election", "ElectionError", "LeaderInfo", "LeadershipLost", "Term"]

log = get_logger(__name__)


class ElectionError(DuetimeError):
    """The election API was used out of order (e.g. ``hold`` on a term that ended)."""


class MonotonicClock(Protocol):
    def monotonic(self) -> float: ...


@dataclass(frozen=True)
class Term:
    """One leadership term. ``epoch`` is the fencing token."""

    epoch: int
    lease_id: int
    node_id: str
    elected_at: float  # clock.monotonic() when the campaign was won


class LeaderInfo(NamedTuple):
    node_id: str
    epoch: int


class Election:
    """Campaign for, hold, and resign ``<prefix>/leader``. One instance per replica."""

    def __init__(
        self,
        endpoints: Sequence[str],
        prefix: str,
        node_id: str,
        ttl: float,
        safety_margin: float | None = None,
        call_timeout: float = 2.0,
        clock: MonotonicClock | None = None,
        username: str | None = None,
        password: str | None = None,
        *,
        rng: random.Random | None = None,
        tls: EtcdTLS | None = None,
    ) -> None:
        if not node_id:
            raise ConfigError("node_id must not be empty")
        if call_timeout <= 0:
            raise ConfigError(f"call_timeout must be > 0 (got {call_timeout})")
        margin = default_safety_margin(ttl) if safety_margin is None else safety_margin
        if ttl <= 0 or not 0 <= margin < ttl:
            raise ConfigError(
                f"need lease ttl > 0 and 0 <= safety margin < ttl (got {ttl}, {margin})"
            )
        self.key = f"{prefix.rstrip('/')}/leader"
        self._key = self.key.encode()
        self.node_id = node_id
        self.ttl = ttl
        self.safety_margin = margin
        self.etcd_ttl = max(1, math.ceil(ttl))
        # TTL/3, but at least two attempts inside the window even with a huge margin.
        self.renew_interval = min(ttl / 3, (ttl - margin) / 2)
        self.call_timeout = call_timeout
        self._clock: MonotonicClock = clock or SYSTEM_CLOCK
        self._etcd = EtcdConnection(
            endpoints, call_timeout=call_timeout, username=username, password=password, tls=tls
        )
        self._rng = rng or random.Random()
        self._term: Term | None = None
        self._deadline: LeaseDeadline | None = None
        self._lost: str | None = None
        self.state = "idle"
        """idle | candidate | follower (watching another's key) | leader | lost"""
        self._log = log.bind(node_id=node_id, election_key=self.key)

    # -- state a duty may check ------------------------------------------------------

    @property
    def term(self) -> Term | None:
        return self._term

    def is_leader(self) -> bool:
        """True only inside the trust window of an unlost, unresigned term."""
        return (
            self._term is not None
            and self._lost is None
            and self._deadline is not None
            and not self._deadline.expired(self._clock.monotonic())
        )

    def term_valid_until(self) -> float | None:
        """Monotonic instant the current term stops being trusted; None if not leader."""
        return self._deadline.valid_until if self.is_leader() and self._deadline else None

    # -- campaign ---------------------------------------------------------------------

    async def campaign(self) -> Term:
        """Return once this node is leader. Waits on watches; retries etcd errors forever."""
        if self._term is not None and self._lost is None:
            raise ElectionError(f"already leader in epoch {self._term.epoch}; resign first")
        failures = 0
        cap = min(5.0, max(1.0, self.ttl / 2))
        while True:
            try:
                term = await self._campaign_once()
            except ETCD_ERRORS as exc:
                if refused_credentials(exc):
                    raise self._refused(exc) from None
                failures += 1
                delay = bounded_jitter(failures, base=0.1, cap=cap, rng=self._rng)
                self._log.warning(
                    "election_etcd_error", op="campaign", attempt=failures,
                    error=describe(exc), retry_in=round(delay, 3),
                )  # fmt: skip
                await asyncio.sleep(delay)
                continue
            if term is not None:
                return term
            failures = 0

    async def _campaign_once(self) -> Term | None:
        self.state = "candidate"
        current = await self._etcd.call(lambda c: c.get(self._key))
        if current is None:
            return await self._try_acquire()
        self._note_holder(current)
        await self._wait_for_vacancy(current.header.revision)
        return None

    async def _try_acquire(self) -> Term | None:
        sent_at = self._clock.monotonic()
        lease = await self._etcd.call(lambda c: c.lease(self.etcd_ttl))
        try:
            won, responses = await self._etcd.call(
                lambda c: c.transaction(
                    compare=[c.transactions.create(self._key) == 0],
                    success=[
                        c.transactions.put(self._key, self.node_id.encode(), lease=lease.id),
                        c.transactions.get(self._key),
                    ],
                    failure=[c.transactions.get(self._key)],
                )
            )
        except BaseException:
            await self._revoke_quietly(lease.id)  # if the put landed unseen, this undoes it
            raise
        if not won:
            await self._revoke_quietly(lease.id)
            holders = responses[0] if responses else []
            if holders:
                _, holder = holders[0]
                self._note_holder(holder)
                await self._wait_for_vacancy(holder.header.revision)
            return None
        _, kv = responses[1][0]
        deadline = LeaseDeadline(self.ttl, self.safety_margin)
        deadline.renewed(sent_at, lease.ttl)
        term = Term(kv.create_revision, lease.id, self.node_id, self._clock.monotonic())
        self._term, self._deadline, self._lost = term, deadline, None
        self.state = "leader"
        self._log.info(
            "leadership_acquired", epoch=term.epoch, lease_id=term.lease_id,
            granted_ttl=lease.ttl, trusted_for=round(deadline.remaining(term.elected_at), 3),
        )  # fmt: skip
        return term

    def _note_holder(self, kv: Any) -> None:
        self.state = "follower"
        holder = bytes(kv.value).decode(errors="replace")
        if holder == self.node_id:
            self._log.warning(
                "election_key_held_by_old_lease_of_ours", epoch=kv.create_revision,
                lease_id=kv.lease, note="not adopted; waiting for that lease to expire",
            )  # fmt: skip
        else:
            self._log.info("election_follower", leader=holder, epoch=kv.create_revision)

    async def _wait_for_vacancy(self, read_revision: int) -> None:
        """Return when the key was deleted after ``read_revision``, or after one TTL."""
        client = self._etcd.client()
        watch = None
        try:
            watch = await asyncio.wait_for(
                client.watch(
                    self._key, start_revision=read_revision + 1, kind=aetcd.EventKind.DELETE
                ),
                self.call_timeout,
            )
            async with asyncio.timeout(self.ttl):  # re-check even if a stream dies silently
                async for _event in watch:
                    return
        except aetcd.RevisionCompactedError:
            return  # history is gone: re-read the key instead
        except TimeoutError as exc:
            if watch is None:
                await self._etcd.discard(client, exc)
                raise
            return
        except ETCD_ERRORS as exc:
            await self._etcd.discard(client, exc)
            raise
        finally:
            if watch is not None:  # cleanup only: the client may already be closed
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(watch.cancel(), self.call_timeout)

    # -- hold -------------------------------------------------------------------------

    async def hold(self, term: Term) -> NoReturn:
        """Keep ``term`` alive until it cannot be proven; then raise ``LeadershipLost``."""
        deadline = self._deadline_of(term)
        interval = self.renew_interval
        failures = 0
        while True:
            sent_at = self._clock.monotonic()
            if term != self._term:
                raise self._lose(term, "resigned")
            if deadline.expired(sent_at):
                raise self._lose(term, "lease_unconfirmed", failed_renewals=failures)
            try:
                granted, kv = await self._renew(
                    term, min(self.call_timeout, deadline.remaining(sent_at))
                )
            except ETCD_ERRORS as exc:
                failures += 1
                remaining = deadline.remaining(self._clock.monotonic())
                self._log.warning(
                    "lease_renew_failed", epoch=term.epoch, attempt=failures,
                    error=describe(exc), trust_remaining=round(remaining, 3),
                )  # fmt: skip
                await asyncio.sleep(
                    min(bounded_jitter(failures, base=0.05, cap=interval, rng=self._rng), remaining)
                )
                continue
            if granted <= 0:
                raise self._lose(term, "lease_expired")
            if kv is None:
                raise self._lose(term, "key_deleted")
            if (kv.create_revision, kv.lease, bytes(kv.value)) != (
                term.epoch,
                term.lease_id,
                self.node_id.encode(),
            ):
                raise self._lose(
                    term, "key_replaced", holder=bytes(kv.value).decode(errors="replace"),
                    holder_epoch=kv.create_revision,
                )  # fmt: skip
            deadline.renewed(sent_at, granted)
            if failures:
                self._log.info("lease_renew_recovered", epoch=term.epoch, after_attempts=failures)
            failures = 0
            await asyncio.sleep(max(0.0, sent_at + interval - self._clock.monotonic()))

    async def _renew(self, term: Term, budget: float) -> tuple[int, Any]:
        """Refresh the lease, then read the key: ``(granted ttl, key or None)``."""
        client = self._etcd.client()
        try:
            async with asyncio.timeout(budget):
                reply = await client.refresh_lease(term.lease_id)
                if reply is None:
                    raise aetcd.ClientError("lease keepalive stream closed without a reply")
                if reply.TTL <= 0:
                    return int(reply.TTL), None
                return int(reply.TTL), await client.get(self._key)
        except ETCD_ERRORS as exc:
            await self._etcd.discard(client, exc)
            raise

    def _deadline_of(self, term: Term) -> LeaseDeadline:
        if term != self._term or self._deadline is None:
            raise ElectionError(f"term {term.epoch} is not this election's current term")
        if self._lost is not None:
            raise LeadershipLost(self._lost)
        return self._deadline

    def _lose(self, term: Term, reason: str, **details: Any) -> LeadershipLost:
        if term == self._term:
            self._lost = reason
            self.state = "lost"
        self._log.warning("leadership_lost", epoch=term.epoch, reason=reason, **details)
        return LeadershipLost(reason)

    # -- resign -----------------------------------------------------------------------

    async def resign(self, term: Term) -> None:
        """Give up ``term`` now: stop trusting it, delete the key if still ours, revoke
        the lease. Each step is bounded by the call timeout; etcd being down is logged,
        never raised (the lease then simply expires)."""
        if term == self._term:
            self._term, self._deadline, self._lost = None, None, None
            self.state = "idle"
        deleted = False
        try:
            deleted, _ = await self._etcd.call(
                lambda c: c.transaction(
                    compare=[c.transactions.create(self._key) == term.epoch],
                    success=[c.transactions.delete(self._key)],
                    failure=[],
                )
            )
        except ETCD_ERRORS as exc:
            self._log.warning("resign_delete_failed", epoch=term.epoch, error=describe(exc))
        await self._revoke_quietly(term.lease_id)
        self._log.info("leadership_resigned", epoch=term.epoch, key_deleted=deleted)

    async def _revoke_quietly(self, lease_id: int) -> None:
        try:
            await self._etcd.call(lambda c: c.revoke_lease(lease_id))
        except ETCD_ERRORS as exc:  # "not found" included: the lease is gone either way
            self._log.info("lease_revoke_failed", lease_id=lease_id, error=describe(exc))

    # -- queries ----------------------------------------------------------------------

    async def current_leader(self) -> LeaderInfo | None:
        """The leader's node id and epoch as etcd sees it now, or None (one bounded get).

        Raises ``ServiceUnavailable`` when etcd cannot answer in time."""
        try:
            kv = await self._etcd.call(lambda c: c.get(self._key))
        except ETCD_ERRORS as exc:
            if refused_credentials(exc):
                raise self._refused(exc) from None
            raise ServiceUnavailable(f"etcd did not answer: {describe(exc)}") from exc
        if kv is None:
            return None
        return LeaderInfo(bytes(kv.value).decode(errors="replace"), kv.create_revision)

    def _refused(self, exc: BaseException) -> ServiceUnavailable:
        """The one line for credentials etcd refused (the password is never in it)."""
        username = self._etcd.username
        who = f"user {username!r}" if username else "no user name (etcd_username unset)"
        endpoint = self._etcd.endpoint
        return ServiceUnavailable(
            f"etcd at {endpoint} refused {who} on {self.key}: {exc}; check "
            "etcd_username/etcd_password and the user's role",
            transient=False,
        )

    async def close(self) -> None:
        """Close the etcd connection. Does not resign: call ``resign(term)`` first."""
        await self._etcd.close()

    async def __aenter__(self) -> Election:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
