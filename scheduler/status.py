"""What ``duetime status`` knows, and whether it is healthy (usable from monitoring).

Two sources, read independently so either can be down:

- PostgreSQL (``scheduler.store.status.StatusStore``): the fence row (leader node,
  epoch, elected_at, renewed_at), per-queue counts, and schedules when migration 0002
  created that table. One read-only REPEATABLE READ transaction, so the figures agree
  with each other, and ages computed by the database clock.
- etcd (``read_election_key``): the election key ``<prefix>/leader`` — value = node id,
  create_revision = epoch (DESIGN §4) — with a short timeout. etcd being unreachable
  from here is reported as a warning, not a crash: the fence alone still tells whether
  a leader is alive, because a leader that cannot reach etcd stops renewing it.

``evaluate`` turns both into problems (exit 1) and warnings (exit 0):

- ``no_leader``: etcd answers and the election key is absent, or no leader ever fenced;
- ``leader_stale``: the fence was last renewed more than 3 × lease TTL ago (the leader
  renews it at least once per TTL; three missed renewals is not a hiccup);
- ``backlog_too_old``: a pending job has been due for longer than ``max_backlog_age``;
- ``broker_unreachable``: RabbitMQ did not answer (``scheduler.broker_view``: one
  connection, a passive declare per job queue, bounded by a timeout): nothing can be
  dispatched or consumed;
- ``no_consumers``: a queue holds jobs dispatched longer than ``max_unstarted_age`` ago
  that no worker has started, and its broker queue has no consumer: nothing executes
  them. With consumers, the same age is a warning (``unstarted_too_old``: workers busy or
  slow), not a verdict.

A third source, RabbitMQ, is read after the database (it needs the queue names) and
only when the caller asks (``broker=None`` judges without it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

import asyncpg

from scheduler.broker_view import BrokerView, read_broker
from scheduler.config import Settings
from scheduler.config.shards import election_key as shard_election_key
from scheduler.errors import ConfigError
from scheduler.log import scrub
from scheduler.store.limits import LimitRow, LimitStore
from scheduler.store.rows import DbSnapshot
from scheduler.store.status import StatusStore

if TYPE_CHECKING:
    import aetcd

T = TypeVar("T")

STALE_RENEWALS = 3  # fence renewals a leader may miss before status calls it gone
#: Seconds a dispatched job may wait for a worker to start it before a queue without
#: consumers is a problem (``no_consumers``).
DEFAULT_MAX_UNSTARTED_AGE = 60.0

#: Undeclared queues named one by one in the warnings; the rest are summed up.
MAX_HELD_FINDINGS = 5


@dataclass(frozen=True, slots=True)
class EtcdView:
    key: str
    reachable: bool
    endpoint: str | None = None
    leader: str | None = None  # node id stored in the key; None when absent
    epoch: int | None = None  # the key's create_revision
    lease_remaining: float | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Finding:
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class StatusReport:
    snapshot: DbSnapshot
    etcd: EtcdView
    max_backlog_age: float
    stale_after: float
    problems: tuple[Finding, ...] = ()
    warnings: tuple[Finding, ...] = field(default=())
    broker: BrokerView | None = None  # None: RabbitMQ was not asked
    max_unstarted_age: float = DEFAULT_MAX_UNSTARTED_AGE

    @property
    def healthy(self) -> bool:
        return not self.problems

    @property
    def reason(self) -> str | None:
        """The first problem, in one line (what a monitoring check shows)."""
        return self.problems[0].message if self.problems else None

    @property
    def exit_code(self) -> int:
        return 0 if self.healthy else 1

    def to_dict(self) -> dict[str, Any]:
        snap = self.snapshot
        return jsonable(
            {
                "healthy": self.healthy,
                "problems": [asdict(p) for p in self.problems],
                "warnings": [asdict(w) for w in self.warnings],
                "checked_at": snap.db_now,
                "thresholds": {
                    "max_backlog_age": self.max_backlog_age,
                    "leader_stale_after": self.stale_after,
                    "max_unstarted_age": self.max_unstarted_age,
                },
                "leader": asdict(snap.fence),
                "etcd": asdict(self.etcd),
                "broker": asdict(self.broker) if self.broker is not None else None,
                "queues": [asdict(q) for q in snap.queues],
                "schedules": asdict(snap.schedules) if snap.schedules is not None else None,
                "waiting": snap.waiting,
            }
        )


def jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, float):
        return round(value, 3)
    return value


def election_key(prefix: str) -> str:
    """The election key of an unsharded cluster (DESIGN §4): ``<prefix>/leader``, as the
    elector writes it (``scheduler.config.shards.election_key``)."""
    return shard_election_key(prefix)


class EtcdUnanswered(Exception):
    """No configured etcd endpoint answered in time (the message says why, per endpoint)."""


async def ask_etcd(
    settings: Settings, op: Callable[[aetcd.Client], Awaitable[T]], *, timeout: float
) -> tuple[str, T]:
    """``op`` on the first etcd endpoint that answers within ``timeout`` (twice that for
    connecting and ``op`` together): ``(endpoint, result)``, else ``EtcdUnanswered``."""
    # imported lazily: grpc start-up costs ~100 ms the DB path never needs
    from scheduler.leadership.etcd_client import etcd_tls, make_client

    try:
        tls = etcd_tls(settings)
    except ConfigError as exc:  # an unusable CA/cert/key file: report it, like etcd down
        raise EtcdUnanswered(str(exc)) from None
    errors: list[str] = []
    for endpoint in settings.etcd_endpoints:
        host, _, port = endpoint.rpartition(":")
        client = make_client(
            host,
            int(port),
            username=settings.etcd_username,
            password=settings.etcd_password,
            timeout=timeout,  # grpc takes float seconds
            tls=tls,
        )
        try:
            async with asyncio.timeout(timeout * 2):
                await client.connect()
                return endpoint, await op(client)
        except Exception as exc:  # aetcd.ClientError, grpc errors, TimeoutError, OSError
            detail = str(exc) or f"no answer within {timeout:g}s"
            errors.append(scrub(f"{endpoint}: {type(exc).__name__}: {detail}")[:300])
        finally:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(timeout):
                    await client.close()
    raise EtcdUnanswered("; ".join(errors) or "no endpoints configured")


async def lease_remaining(client: aetcd.Client, lease_id: int) -> float | None:
    """Seconds left on ``lease_id`` (None: no lease, or etcd says it is gone)."""
    if not lease_id:
        return None
    info = await client.get_lease_info(lease_id, keys=False)
    return float(info.TTL) if info.TTL >= 0 else None


async def read_election_key(settings: Settings, *, timeout: float | None = None) -> EtcdView:
    """Read the election key from the first etcd endpoint that answers in time."""
    key = election_key(settings.etcd_prefix)

    async def read(client: aetcd.Client) -> tuple[Any, float | None]:
        kv = await client.get(key.encode())
        return kv, (await lease_remaining(client, kv.lease) if kv is not None else None)

    try:
        endpoint, (kv, remaining) = await ask_etcd(
            settings, read, timeout=settings.etcd_timeout if timeout is None else timeout
        )
    except EtcdUnanswered as exc:
        return EtcdView(key, False, error=str(exc))
    if kv is None:
        return EtcdView(key, True, endpoint)
    return EtcdView(
        key,
        True,
        endpoint,
        leader=kv.value.decode("utf-8", "replace"),
        epoch=kv.create_revision,
        lease_remaining=remaining,
    )


def evaluate(
    snapshot: DbSnapshot,
    etcd: EtcdView,
    *,
    lease_ttl: float,
    max_backlog_age: float,
    broker: BrokerView | None = None,
    max_unstarted_age: float = DEFAULT_MAX_UNSTARTED_AGE,
    limits: Sequence[LimitRow] = (),
) -> StatusReport:
    """Judge a snapshot (and what RabbitMQ said, when ``broker`` is given; ``limits``
    with their use): problems make ``duetime status`` exit 1."""
    problems: list[Finding] = []
    warnings: list[Finding] = []
    stale_after = STALE_RENEWALS * lease_ttl
    fence = snapshot.fence
    if etcd.reachable and etcd.leader is None:
        problems.append(Finding("no_leader", f"no leader: election key {etcd.key} is absent"))
    if fence.epoch == 0 or fence.renewed_age is None:
        problems.append(Finding("no_leader", "no leader has ever fenced the database"))
    elif fence.renewed_age > stale_after:
        problems.append(
            Finding(
                "leader_stale",
                f"no live leader: fence (epoch {fence.epoch}, {fence.leader_node}) last renewed "
                f"{fence.renewed_age:.1f}s ago, more than {STALE_RENEWALS} x TTL = "
                f"{stale_after:g}s",
            )
        )
    if not etcd.reachable:
        warnings.append(
            Finding(
                "etcd_unreachable",
                f"etcd unreachable ({etcd.error}); leader judged from the database fence only",
            )
        )
    elif etcd.epoch is not None and fence.epoch and etcd.epoch != fence.epoch:
        if etcd.epoch > fence.epoch:
            text = (
                f"etcd leader {etcd.leader} (epoch {etcd.epoch}) has not fenced the database "
                f"yet (fence epoch {fence.epoch}); normal for a moment after an election"
            )
        else:
            text = (
                f"etcd epoch {etcd.epoch} is older than the fence epoch {fence.epoch}: etcd's "
                "revision history was reset (restored or wiped?); see the 'etcd down' runbook"
            )
        warnings.append(Finding("epoch_mismatch", text))
    elif etcd.leader is not None and fence.leader_node and etcd.leader != fence.leader_node:
        warnings.append(
            Finding(
                "node_mismatch",
                f"etcd names {etcd.leader} but the fence names {fence.leader_node} "
                f"for epoch {fence.epoch}",
            )
        )
    held = [q for q in snapshot.queues if not q.declared and q.pending]
    for q in held[:MAX_HELD_FINDINGS]:
        warnings.append(
            Finding(
                "queue_undeclared",
                f"held: queue {q.queue} is not declared ({q.pending} pending, {q.held} due); "
                f"`duetime queues add {q.queue}` releases them",
            )
        )
    for q in (q for q in snapshot.queues if q.paused):
        warnings.append(
            Finding(
                "queue_paused",
                f"paused: queue {q.queue} dispatches nothing new ({q.pending} pending, "
                f"{q.dispatched} running); `duetime queues resume {q.queue}` resumes it",
            )
        )
    if len(held) > MAX_HELD_FINDINGS:
        warnings.append(
            Finding(
                "queue_undeclared",
                f"held: {len(held) - MAX_HELD_FINDINGS} more undeclared queues hold jobs "
                "(duetime queues list)",
            )
        )
    warnings += limits_holding(limits)
    worst = max(
        (
            q
            for q in snapshot.queues
            if q.oldest_overdue is not None and q.declared and not q.paused
        ),
        key=lambda q: q.oldest_overdue or 0.0,
        default=None,
    )
    if worst is not None and (worst.oldest_overdue or 0.0) > max_backlog_age:
        problems.append(
            Finding(
                "backlog_too_old",
                f"queue {worst.queue}: oldest due job is {worst.oldest_overdue:.1f}s late "
                f"(threshold {max_backlog_age:g}s, {worst.due_now} due now)",
            )
        )
    if broker is not None:
        found = judge_broker(snapshot, broker, max_unstarted_age)
        problems += [f for f in found if f.code in BROKER_PROBLEMS]
        warnings += [f for f in found if f.code not in BROKER_PROBLEMS]
    return StatusReport(
        snapshot,
        etcd,
        max_backlog_age,
        stale_after,
        tuple(problems),
        tuple(warnings),
        broker,
        max_unstarted_age,
    )


def limits_holding(limits: Sequence[LimitRow]) -> list[Finding]:
    """A line per limit that is full (its running cap, or its rate's window) while due
    jobs of its target wait: the jobs it holds back (a warning: holding back is what a
    limit is for)."""
    found = []
    for row in limits:
        lim, cap, rate = row.limit, row.limit.max_running, row.limit.rate_count
        capped = cap is not None and row.running >= cap
        rated = rate is not None and row.started >= rate
        if row.due == 0 or not (capped or rated):
            continue
        if lim.per_key:  # `due` spans every key; some may still have room
            use = []
            if capped:
                use.append(f"runs {row.running} of {cap}")
            if rated:
                use.append(f"started {row.started} of {lim.rate}")
            text = (
                f"limit {lim.target}: its busiest key {' and '.join(use)}; "
                f"{row.due} due jobs of the target wait"
            )
        else:
            use = []
            if capped:
                use.append(f"{row.running} of {cap} running")
            if rated:
                use.append(f"{row.started} of {lim.rate} started")
            text = f"limit {lim.target} holds {row.due} due jobs: {', '.join(use)}"
        found.append(Finding("limit_holding", text))
    return found


async def read_limits(pool: asyncpg.Pool, timeout: float) -> list[LimitRow]:
    """The limits with their use; none before migration 0016."""
    try:
        return await LimitStore(pool, acquire_timeout=timeout).list()
    except (asyncpg.UndefinedTableError, asyncpg.UndefinedColumnError):
        return []


BROKER_PROBLEMS = frozenset({"broker_unreachable", "no_consumers"})


def judge_broker(
    snapshot: DbSnapshot, broker: BrokerView, max_unstarted_age: float
) -> list[Finding]:
    """Does anything execute? Findings about RabbitMQ and the dispatched jobs waiting on
    it (codes in ``BROKER_PROBLEMS`` are problems, the others warnings)."""
    if not broker.reachable:
        return [Finding("broker_unreachable", f"RabbitMQ unreachable ({broker.error})")]
    found: list[Finding] = []
    for q in snapshot.queues:
        age = q.oldest_unstarted
        if age is None or age <= max_unstarted_age:
            continue
        consumers = broker.consumers(q.queue)
        text = (
            f"queue {q.queue}: {q.unstarted} dispatched job(s) not started, the oldest "
            f"dispatched {age:.1f}s ago (threshold {max_unstarted_age:g}s)"
        )
        if consumers == 0:
            found.append(Finding("no_consumers", f"{text}, and no worker consumes it"))
        elif consumers is not None:
            found.append(Finding("unstarted_too_old", f"{text}, with {consumers} consumer(s)"))
    return found


async def collect_status(
    settings: Settings,
    pool: asyncpg.Pool,
    *,
    max_backlog_age: float,
    etcd_timeout: float | None = None,
    max_unstarted_age: float = DEFAULT_MAX_UNSTARTED_AGE,
    broker_timeout: float | None = None,
) -> StatusReport:
    """Read PostgreSQL and etcd concurrently, then RabbitMQ (the queues the database
    names), and judge the result.

    A PostgreSQL failure propagates (the caller reports it); an etcd failure becomes a
    warning inside the report, a RabbitMQ failure a problem (``broker_unreachable``).
    """
    etcd_task = asyncio.create_task(read_election_key(settings, timeout=etcd_timeout))
    try:
        snapshot = await StatusStore(pool, acquire_timeout=settings.db_timeout).snapshot()
        limits = await read_limits(pool, settings.db_timeout)
    except BaseException:
        etcd_task.cancel()
        with contextlib.suppress(BaseException):
            await etcd_task
        raise
    broker = await read_broker(
        settings,
        [q.queue for q in snapshot.queues],
        settings.amqp_timeout if broker_timeout is None else broker_timeout,
    )
    etcd = await etcd_task
    return evaluate(
        snapshot,
        etcd,
        lease_ttl=settings.lease_ttl,
        max_backlog_age=max_backlog_age,
        broker=broker,
        max_unstarted_age=max_unstarted_age,
        limits=limits,
    )
