"""``python -m bench.consume_only --queue Q --count N``: the bare consumer of the baseline.

Consumes ``duetime.<Q>`` with manual acks and no database at all (no ledger, no handler),
prints ``ready`` once consuming, and when N messages were acked (or ``--timeout`` passed)
prints one JSON line: ``{"consumed", "first", "last"}`` (wall-clock epoch seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aio_pika

from scheduler.broker import declare_job_queue


async def main(args: argparse.Namespace) -> dict[str, float | int | None]:
    connection = await aio_pika.connect(args.amqp_url, timeout=10)
    done = asyncio.Event()
    consumed = 0
    first: float | None = None
    last: float | None = None
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=args.prefetch)
        queue = await declare_job_queue(channel, args.queue, delivery_limit=20)

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            nonlocal consumed, first, last
            now = time.time()
            first = first or now
            await message.ack()
            consumed += 1
            last = now
            if consumed >= args.count:
                done.set()

        await queue.consume(on_message)
        print("ready", flush=True)
        try:
            await asyncio.wait_for(done.wait(), args.timeout)
        except TimeoutError:
            pass
    return {"consumed": consumed, "first": first, "last": last}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--amqp-url", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--prefetch", type=int, default=500)
    parser.add_argument("--timeout", type=float, default=300.0)
    print(json.dumps(asyncio.run(main(parser.parse_args()))), flush=True)
