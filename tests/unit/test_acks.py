"""The ack coalescer's bookkeeping (workers/acks.py): the lowest unsettled tag of a
channel, whatever is held, and the frames a flush sends. Pure: the messages here are
plain objects with the three attributes the coalescer reads (tests/integration/
test_worker.py and test_ack_close.py run it against RabbitMQ)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

from workers.acks import AckCoalescer, DeliveryTags


def test_lowest_is_the_smallest_unsettled_tag_under_any_order() -> None:
    rng = random.Random(25)
    tags, reference = DeliveryTags(), set[int]()
    next_tag = 1
    for _ in range(20_000):
        if reference and rng.random() < 0.5:
            tag = rng.choice(sorted(reference)[:50] + sorted(reference)[-50:])
            tags.discard(tag)
            reference.discard(tag)
        else:
            tags.add(next_tag)
            reference.add(next_tag)
            next_tag += 1
        assert tags.lowest() == (min(reference) if reference else None)
        assert len(tags) == len(reference)


def test_settled_entries_do_not_pile_up_below_a_held_tag() -> None:
    """One delivery held (a long handler, a staged job) while 100,000 later ones settle:
    the index keeps about what is unsettled, not every tag it ever saw."""
    tags = DeliveryTags()
    tags.add(1)
    for tag in range(2, 100_002):
        tags.add(tag)
        tags.discard(tag)
    assert tags.lowest() == 1
    assert len(tags._heap) <= 2 * len(tags) + 64


@dataclass
class _Channel:
    frames: list[tuple[int, bool]] = field(default_factory=list)


@dataclass
class _Message:
    channel: _Channel
    delivery_tag: int
    message_id: str = "m"

    async def ack(self, multiple: bool = False) -> None:
        self.channel.frames.append((self.delivery_tag, multiple))


async def test_a_flush_merges_only_below_the_lowest_held_delivery() -> None:
    channel = _Channel()
    acks = AckCoalescer()
    messages: list[Any] = [_Message(channel, tag) for tag in range(1, 20_001)]
    for message in messages:
        acks.received(message)
    # 1-5 settle together: one multiple frame; 7 and 9 lie above 6, still held: one each
    first = [*messages[:5], messages[6], messages[8]]
    await asyncio.gather(*(acks.ack(m) for m in first))
    assert channel.frames == [(5, True), (7, False), (9, False)]
    # 6 and 8 settle: nothing is held below 10 any more
    channel.frames.clear()
    await asyncio.gather(acks.ack(messages[5]), acks.ack(messages[7]))
    assert channel.frames == [(8, True)]
    # the rest in one flush: one frame
    channel.frames.clear()
    await asyncio.gather(*(acks.ack(m) for m in messages[9:]))
    assert channel.frames == [(20_000, True)]
    assert acks._unsettled == {}
