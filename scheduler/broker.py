"""RabbitMQ topology and connections, shared by the dispatcher and the workers.

Topology (declared idempotently by whoever connects first):

- one durable **quorum** queue per *declared* job queue (``duetime.queues``: the
  dispatcher claims nothing else), named ``duetime.<queue>`` (contract),
  with ``x-delivery-limit`` (a message redelivered that often is poison) and a
  dead-letter exchange; and, once the dispatcher stages jobs ahead of their run time
  or a worker consumes staged jobs (DESIGN §14), its twin ``duetime.<queue>:staged``;
- ``duetime.dlx`` (fanout) → ``duetime.dead-letter`` (quorum): unparseable messages and
  messages over the delivery limit end up here, visible, never silently dropped.

Publishing goes through the default exchange with ``mandatory=True`` on a channel with
publisher confirms and ``on_return_raises=True``: a message no queue accepts is an
error the dispatcher sees, not a silent return.

**A cluster** (``amqp_url`` listing several nodes, comma-separated): every connection
is a ``ClusterConnection``, aio-pika's robust connection over a list of URLs. It opens
on the first node that answers, in the order given; when the connection is lost it
reconnects starting with the *next* node (the lost one is probably down), trying each
node once per round with no pause between them, then aio-pika's
``reconnect_interval`` before the next round. Channels, queues and consumers are
restored on the new node as aio-pika restores them after any reconnect, so the
publisher and the consumer carry on without knowing. Quorum queues keep their
messages on a majority of nodes, so the node a client talks to does not matter.
aio-pika itself reconnects only to the URL a connection was made with, and has no
hook for choosing another: ``ClusterConnection`` overrides the robust connection's
private connect step (checked at import, so an aio-pika that renames it fails loudly
instead of silently losing failover).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractQueue, AbstractRobustConnection
from aio_pika.exceptions import CONNECTION_EXCEPTIONS
from aio_pika.robust_connection import RobustConnection
from yarl import URL

from scheduler.config import redact_url
from scheduler.errors import InvalidInput, ServiceUnavailable
from scheduler.jobspec import validate_queue
from scheduler.log import get_logger
from scheduler.startup import is_permanent_cause

log = get_logger(__name__)

QUEUE_PREFIX = "duetime."
DEAD_LETTER_EXCHANGE = "duetime.dlx"
DEAD_LETTER_QUEUE = "duetime.dead-letter"

#: Longest wait for the broker to answer a close or a consumer cancel. A healthy broker
#: answers in milliseconds; an unreachable one never does, and a stop (SIGTERM, a lost
#: term) must not wait for it: the connection is dropped instead.
CLOSE_TIMEOUT = 1.0
#: Seconds to wait for a connection that never opened to be closed, and for a close
#: that ran out of time to end once cancelled.
ABANDON_TIMEOUT = 0.5

# RobustConnection's one connect step (name-mangled private method): its reconnect
# loop calls it for every attempt; ClusterConnection overrides it to pick the node.
_CONNECT_STEP = "_RobustConnection__connect_transport"
if not callable(getattr(RobustConnection, _CONNECT_STEP, None)):
    raise ImportError(
        f"aio-pika {aio_pika.__version__} has no RobustConnection.{_CONNECT_STEP}: "
        "scheduler.broker.ClusterConnection needs it to move to another broker node"
    )
_robust_connect_step = getattr(RobustConnection, _CONNECT_STEP)


def amqp_urls(amqp_url: str) -> tuple[str, ...]:
    """The broker URLs of an ``amqp_url`` setting: one, or a cluster's nodes
    comma-separated (validated by ``scheduler.config`` when it comes from settings)."""
    urls = tuple(part.strip() for part in amqp_url.split(","))
    if not all(urls):
        raise InvalidInput(f"empty URL in the RabbitMQ URL list {redact_url(amqp_url)!r}")
    return urls


def queue_name(queue: str) -> str:
    """Broker queue for a job queue: ``duetime.<queue>`` (validated)."""
    return QUEUE_PREFIX + validate_queue(queue)


#: Suffix of a job queue's *staged* queue, ``duetime.<queue>:staged`` (DESIGN §14): the
#: messages of jobs handed out before their run time. A queue name cannot hold ``:``, so
#: no job queue is ever named like one.
STAGED_SUFFIX = ":staged"


def staged_queue_name(queue: str) -> str:
    """Broker queue for the staged jobs of a job queue: ``duetime.<queue>:staged``."""
    return queue_name(queue) + STAGED_SUFFIX


def job_queue_names(queue: str) -> tuple[str, str]:
    """Every broker queue of a job queue: its own and its staged twin. What to delete
    when the job queue goes (a worker declares both when it starts)."""
    return queue_name(queue), staged_queue_name(queue)


def job_queue_arguments(delivery_limit: int) -> dict[str, Any]:
    return {
        "x-queue-type": "quorum",
        "x-delivery-limit": delivery_limit,
        "x-dead-letter-exchange": DEAD_LETTER_EXCHANGE,
    }


class ClusterConnection(RobustConnection):
    """A robust connection to whichever node of ``urls`` answers (module docstring).

    ``url`` is the node in use (the last one tried while reconnecting); ``failures``
    holds ``(url, exception)`` of every node that failed in the last round that found
    none.
    """

    def __init__(self, urls: Sequence[str], **kwargs: Any) -> None:
        if not urls:
            raise ValueError("ClusterConnection needs at least one URL")
        nodes = [URL(url) for url in urls]
        super().__init__(nodes[0], **kwargs)
        # Per node, the options aio-pika derives from a URL's query (TLS files, heartbeat)
        # and the keyword arguments, as RobustConnection.__init__ derived them for the first.
        shared: dict[str, Any] = {
            k: self.kwargs[k] for k in ("context", "client_properties") if k in self.kwargs
        }
        own = {
            k: v
            for k, v in kwargs.items()
            if v is not None and k not in ("loop", "ssl_context", "client_properties")
        }
        self.nodes: list[tuple[URL, dict[str, Any]]] = [(nodes[0], self.kwargs)]
        for node in nodes[1:]:
            options = self._parse_parameters({**dict(node.query), **own})
            options.pop("reconnect_interval", None)
            options.pop("fail_fast", None)
            self.nodes.append((node, {**options, **shared}))
        self.failures: list[tuple[str, BaseException]] = []
        self._current: int | None = None  # index of the node of the last connection

    async def _RobustConnection__connect_transport(self) -> None:
        """One reconnect round: every node once, starting after the last one used."""
        start = 0 if self._current is None else self._current + 1
        failures: list[tuple[str, BaseException]] = []
        for step in range(len(self.nodes)):
            index = (start + step) % len(self.nodes)
            self.url, self.kwargs = self.nodes[index]
            try:
                await _robust_connect_step(self)
            except CONNECTION_EXCEPTIONS as exc:
                failures.append((redact_url(str(self.url)), exc))
                if len(self.nodes) > 1:
                    log.warning(
                        "amqp_node_unreachable",
                        url=redact_url(str(self.url)),
                        error=f"{type(exc).__name__}: {exc}",
                    )
                continue
            if len(self.nodes) > 1:
                log.info(
                    "amqp_node_connected",
                    url=redact_url(str(self.url)),
                    moved=self._current is not None and index != self._current,
                )
            self._current, self.failures = index, []
            return
        self.failures = failures
        raise failures[-1][1]


#: What a first connection attempt that reached no broker raises. aiormq raises
#: ``StopAsyncIteration`` when the connection is already at its end as the handshake
#: reads the broker's first frame (an endpoint that accepts and resets at once, as a
#: broker restarting or a load balancer with nothing behind it does), which uvloop makes
#: likely: left out, it ended a starting worker with a traceback instead of a retry.
#: aio-pika's own reconnect loop counts it among its ``CONNECTION_EXCEPTIONS`` too.
_CONNECT_FAILURES = (OSError, TimeoutError, aiormq.exceptions.AMQPError, StopAsyncIteration)


async def connect(
    url: str,
    *,
    timeout: float = 10.0,
    name: str = "duetime",
    reconnect_interval: float | None = None,
) -> AbstractRobustConnection:
    """A robust (auto-reconnecting) connection to ``url``, one broker URL or a cluster's
    comma-separated (``ClusterConnection``); fails fast with a clear error if no node
    can be reached at all on the first attempt (``timeout`` applies per node).

    ``reconnect_interval`` (seconds) overrides aio-pika's default of 5 s between
    reconnection rounds (a ``?reconnect_interval=`` in the first URL also works).
    """
    extra: dict[str, Any] = {}
    if reconnect_interval is not None:
        extra["reconnect_interval"] = reconnect_interval
    connection = ClusterConnection(
        amqp_urls(url), client_properties={"connection_name": name}, **extra
    )
    try:
        await connection.connect(timeout=timeout)
    except BaseException as exc:
        # Whatever ended the attempt (a refusal, a timeout, or the caller's cancellation:
        # a stop while the broker is unreachable), the connection's reconnect task must
        # not outlive it. That task takes a cancellation it did not ask for as a reason
        # to reconnect, so left behind it would keep the event loop, and the process,
        # alive after shutdown.
        await _abandon(connection)
        if not isinstance(exc, _CONNECT_FAILURES):
            raise
        failures = connection.failures or [(redact_url(url), exc)]
        if len(failures) == 1:
            where, error = failures[0]
            detail = f"{where}: {_reason(error)}"
        else:
            detail = "any node: " + "; ".join(
                f"{where}: {_reason(error)}" for where, error in failures
            )
        raise ServiceUnavailable(
            f"cannot connect to RabbitMQ at {detail}",
            transient=not all(_permanent(error) for _, error in failures),
        ) from None
    return connection


def _permanent(exc: BaseException) -> bool:
    """A refusal waiting will not fix; aiormq wraps TLS failures (a certificate that does
    not verify) in ``AMQPConnectionError``, raised from the ``ssl`` error."""
    return (
        is_permanent_cause(exc)
        or _vhost_refused(exc)
        or (exc.__cause__ is not None and is_permanent_cause(exc.__cause__))
    )


def _vhost_refused(exc: BaseException) -> bool:
    """RabbitMQ answered ``connection.open`` with ``connection.close``: the vhost does not
    exist (NOT_ALLOWED) or this user may not use it (ACCESS_REFUSED). aiormq reports it as
    an ``InvalidFrameError`` naming the frame, with no reply code to read."""
    return isinstance(exc, aiormq.exceptions.InvalidFrameError) and "got <Connection.Close" in str(
        exc
    )


def _reason(exc: BaseException) -> str:
    if _vhost_refused(exc):
        return "the broker refused the vhost (it does not exist, or this user may not use it)"
    if isinstance(exc, StopAsyncIteration):
        return "the connection was closed before the broker's first frame"
    return f"{type(exc).__name__}: {exc}"


async def _abandon(connection: ClusterConnection) -> None:
    """Stop the reconnect task of a connection that never opened (nothing was open, so
    there is nothing to close politely: a short bound)."""
    await close_connection(connection, ABANDON_TIMEOUT)


async def close_connection(connection: AbstractRobustConnection, timeout: float) -> bool:
    """Close ``connection`` within ``timeout`` seconds, even when the caller is being
    cancelled; False (logged) when it failed or took too long.

    Why not a plain ``wait_for(connection.close())``: a caller cancelled before the close
    starts would cancel it unstarted, and aio-pika's reconnect task, which only closing
    stops, would outlive the connection and keep the process alive after shutdown. The
    close runs in a task of its own, shielded from the caller's cancellation, and is
    cancelled only once the bound is spent; by then the reconnect task was cancelled
    (that is the close's first step), and cancelling the close ends the polite part
    aiormq adds (sending ``Connection.Close`` and waiting up to 2 s for the answer,
    which a partitioned broker never sends).
    """
    closing = asyncio.ensure_future(connection.close())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    cancelled = False
    while not closing.done() and (remaining := deadline - loop.time()) > 0:
        try:
            await asyncio.wait({closing}, timeout=remaining)
        except asyncio.CancelledError:
            cancelled = True  # finish the bounded close first, then let it through
    if not closing.done():
        closing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait({closing}, timeout=ABANDON_TIMEOUT)
    if cancelled:
        raise asyncio.CancelledError
    if closing.done() and not closing.cancelled() and closing.exception() is None:
        return True
    failed = closing.done() and not closing.cancelled()
    log.warning(
        "amqp_close_failed",
        timeout=timeout,
        error=repr(closing.exception()) if failed else "timed out",
    )
    return False


async def declare_dead_letter(channel: AbstractChannel) -> AbstractQueue:
    exchange = await channel.declare_exchange(
        DEAD_LETTER_EXCHANGE, aio_pika.ExchangeType.FANOUT, durable=True
    )
    queue = await channel.declare_queue(
        DEAD_LETTER_QUEUE, durable=True, arguments={"x-queue-type": "quorum"}
    )
    await queue.bind(exchange)
    return queue


async def declare_job_queue(
    channel: AbstractChannel, queue: str, *, delivery_limit: int, staged: bool = False
) -> AbstractQueue:
    """Declare ``duetime.<queue>`` (``staged``: ``duetime.<queue>:staged``, the same kind
    of queue) and the dead-letter topology.

    A queue that already exists with other arguments makes RabbitMQ close the channel
    (PRECONDITION_FAILED); that is turned into an error saying which queue and why.
    """
    name = staged_queue_name(queue) if staged else queue_name(queue)
    await declare_dead_letter(channel)
    try:
        return await channel.declare_queue(
            name, durable=True, arguments=job_queue_arguments(delivery_limit)
        )
    except aiormq.exceptions.ChannelPreconditionFailed as exc:
        raise InvalidInput(
            f"RabbitMQ queue {name} exists with different arguments than duetime needs "
            f"(quorum, x-delivery-limit={delivery_limit}, DLX {DEAD_LETTER_EXCHANGE}): {exc}"
        ) from None
