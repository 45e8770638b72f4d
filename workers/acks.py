"""Settling deliveries with the broker: each exactly once, acks in as few frames as possible.

RabbitMQ's ``basic.ack(multiple=True)`` settles every delivery of a channel up to a tag,
so one frame can ack a whole batch, but only when no unsettled delivery lies below that
tag: a staged delivery held until its run time, a handler still running, a nack on its
way. ``DeliveryTags`` keeps each channel's unsettled tags so that the lowest one is found
in O(log n), whatever is held: a worker may hold 20,000 staged deliveries (the default
``worker_stage_limit``), and a flush that scanned them all took 0.74 ms instead of 0.15
(docs/benchmarks.md, "Acks with thousands of deliveries held").
"""

from __future__ import annotations

import asyncio
import heapq
from typing import Any

from aio_pika.abc import AbstractIncomingMessage

from scheduler.log import get_logger

__all__ = ["AckCoalescer", "DeliveryTags", "Settlement"]

log = get_logger("duetime.worker")


class DeliveryTags:
    """One channel's unsettled delivery tags, and the lowest of them.

    A set says which tags are unsettled; a min-heap orders them, its settled entries
    dropped lazily when they reach the top. Settling out of order (a long handler below
    thousands of short ones) leaves settled entries inside the heap: it is rebuilt from
    the set once they outnumber the live ones, so memory stays proportional to what is
    unsettled.
    """

    __slots__ = ("_heap", "_live")

    def __init__(self) -> None:
        self._live: set[int] = set()
        self._heap: list[int] = []

    def __len__(self) -> int:
        return len(self._live)

    def add(self, tag: int) -> None:
        if tag not in self._live:
            self._live.add(tag)
            heapq.heappush(self._heap, tag)

    def discard(self, tag: int) -> None:
        self._live.discard(tag)
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = list(self._live)
            heapq.heapify(self._heap)

    def lowest(self) -> int | None:
        """The lowest unsettled tag, or None when every delivery is settled."""
        heap, live = self._heap, self._live
        while heap and heap[0] not in live:
            heapq.heappop(heap)
        return heap[0] if heap else None


class AckCoalescer:
    """Sends the acks that become due in one event-loop turn as few frames as possible.

    ``received`` records each delivery's tag on its channel; ``ack`` queues one and
    returns once its frame was written. The flush, per channel: the lowest tag still
    unsettled is the barrier; every queued tag below it is covered by one
    ``basic.ack(multiple=True)`` on the highest of them, the rest are acked one by one.
    Nacks and rejects are never coalesced (``done`` removes their tag). Tags belong to a
    channel: after a reconnect old deliveries' acks fail and are only logged (the broker
    redelivers them, the executor finds them settled).
    """

    def __init__(self) -> None:
        self._unsettled: dict[int, DeliveryTags] = {}  # channel key -> its tags
        self._channel_of: dict[int, int] = {}  # id(message) -> its channel key
        self._queued: list[tuple[AbstractIncomingMessage, asyncio.Future[None]]] = []
        self._flushing = False
        # one flush at a time: a multiple-ack computed by one flush must reach the broker
        # before the next flush computes (else a later frame could cover a tag first and
        # the broker would close the channel on the now unknown tag)
        self._send_lock = asyncio.Lock()
        self._flushes: set[asyncio.Task[None]] = set()
        self.frames = 0  # ack frames sent (tests, benchmarks)

    def received(self, message: AbstractIncomingMessage) -> None:
        # the channel is read now: aio-pika raises on ``message.channel`` once it closed
        if message.delivery_tag is None:
            return
        try:
            key = id(message.channel)
        except Exception:
            return
        self._channel_of[id(message)] = key
        tags = self._unsettled.get(key)
        if tags is None:
            tags = self._unsettled[key] = DeliveryTags()
        tags.add(message.delivery_tag)

    def done(self, message: AbstractIncomingMessage) -> None:
        key = self._channel_of.pop(id(message), None)
        tags = self._unsettled.get(key) if key is not None else None
        if tags is not None:
            tags.discard(message.delivery_tag or 0)
            if not tags:
                del self._unsettled[key]  # type: ignore[arg-type]

    async def ack(self, message: AbstractIncomingMessage) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queued.append((message, future))
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().call_soon(self._start_flush)
        await future

    def _start_flush(self) -> None:
        task = asyncio.create_task(self._flush(), name="acks:flush")
        self._flushes.add(task)
        task.add_done_callback(self._flush_done)

    def _flush_done(self, task: asyncio.Task[None]) -> None:
        self._flushes.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a send failure is logged by _send already

    async def _flush(self) -> None:
        async with self._send_lock:
            await self._flush_queued()

    async def close(self, timeout: float) -> None:
        """Send every ack already queued, before the channels close: a delivery task
        cancelled while its ack waited in the queue (a stop cancels those not running)
        leaves the frame to a flush, and a channel closed under that flush would drop
        it, so the broker would redeliver a settled job. Bounded by ``timeout`` (an
        unreachable broker); what is not sent by then is redelivered, as after a crash."""
        try:
            async with asyncio.timeout(timeout):
                await self._flush()  # after the flush in progress (the send lock): the rest
        except TimeoutError:
            log.warning("acks_unsent_at_close", queued=len(self._queued), timeout=timeout)
        finally:  # flushes still scheduled have nothing left to send
            tasks = list(self._flushes)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _flush_queued(self) -> None:
        queued, self._queued = self._queued, []
        self._flushing = False
        try:
            by_channel: dict[int | None, list[tuple[AbstractIncomingMessage, Any]]] = {}
            for message, future in queued:
                key = self._channel_of.get(id(message))
                by_channel.setdefault(key, []).append((message, future))
            for key, items in by_channel.items():
                items.sort(key=lambda item: item[0].delivery_tag or 0)
                for message, _ in items:  # acked now: none of them is a barrier
                    self.done(message)
                barrier: int | None = 0  # a channel never seen: nothing is merged
                if key is not None:
                    tags = self._unsettled.get(key)
                    barrier = tags.lowest() if tags is not None else None
                below = [i for i in items if barrier is None or (i[0].delivery_tag or 0) < barrier]
                above = items[len(below) :]
                if len(below) > 1:
                    await self._send(below[-1][0], below, multiple=True)
                    below = []
                for item in below + above:
                    await self._send(item[0], [item], multiple=False)
        finally:  # whatever happened, nobody waits forever for an ack
            for _, future in queued:
                if not future.done():
                    future.set_result(None)

    async def _send(
        self,
        message: AbstractIncomingMessage,
        covered: list[tuple[AbstractIncomingMessage, asyncio.Future[None]]],
        *,
        multiple: bool,
    ) -> None:
        self.frames += 1
        try:
            await message.ack(multiple=multiple)
        except Exception as exc:
            log.warning(
                "settle_failed",
                action="ack",
                message_id=message.message_id,
                covered=len(covered),
                error=repr(exc),
            )
        finally:
            for _, future in covered:
                if not future.done():
                    future.set_result(None)


class Settlement:
    """Settles one delivery (ack, nack or reject) exactly once.

    Marked done *before* the frame is sent: a cancellation that lands while aio-pika
    waits for the write to drain must not make us send a second, conflicting frame for
    the same delivery tag (RabbitMQ closes the channel on that). A failure to send
    (channel gone after a broker reconnect) is logged, not raised: the broker redelivers
    and the ledger recognises the delivery as settled.
    """

    __slots__ = ("acks", "done", "message")

    def __init__(self, message: AbstractIncomingMessage, acks: AckCoalescer) -> None:
        self.message = message
        self.acks = acks
        self.done = False

    async def __call__(self, action: str, **kwargs: Any) -> None:
        if self.done or self.message.processed:
            return
        self.done = True
        if action == "ack":
            await self.acks.ack(self.message)
            return
        try:
            await getattr(self.message, action)(**kwargs)
        except Exception as exc:
            log.warning(
                "settle_failed",
                action=action,
                message_id=self.message.message_id,
                error=repr(exc),
            )
        finally:  # only now: until the frame is out, no multiple-ack may cover this tag
            self.acks.done(self.message)
