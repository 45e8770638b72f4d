"""What a worker's staged deliveries cost in memory (DESIGN §14; docs/benchmarks.md,
"Staging ahead"): ``python -m bench.staged_memory [--staged N]``.

Starts one ``duetime worker`` in a sandbox, reads its RSS when idle, publishes N staged
messages straight to its queue's staged twin (run time two minutes ahead, job ids no
row has: they are held, never run), waits until the worker holds them all, and reads
its RSS again. Prints both and the difference per delivery.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from datetime import UTC, datetime, timedelta

import aio_pika

from bench.harness import Sandbox, Services
from scheduler import broker
from scheduler.config import load_settings
from scheduler.messages import JobMessage

#: job ids far above any a sandbox inserts
FIRST_ID = 10**12


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def measure(staged: int, settle: float = 3.0) -> dict[str, float]:
    settings = load_settings()
    services = Services.from_settings(settings, None)
    async with Sandbox(services, "stagedmem") as sb:
        worker = await sb.start_worker(16)
        await asyncio.sleep(settle)
        idle = rss_mb(worker.pid)
        start = datetime.now(UTC) + timedelta(minutes=2)
        name = broker.staged_queue_name(sb.queue)
        connection = await aio_pika.connect(services.amqp_url, timeout=10)
        async with connection:
            channel = await connection.channel(publisher_confirms=True)
            for first in range(0, staged, 1000):
                await asyncio.gather(
                    *(
                        channel.default_exchange.publish(
                            aio_pika.Message(
                                body=JobMessage(
                                    job_id=FIRST_ID + i, due_at=start, attempt=1, epoch=1,
                                    task="bench.record", start_at=start,
                                ).encode()
                            ),
                            routing_key=name,
                        )
                        for i in range(first, min(staged, first + 1000))
                    )
                )  # fmt: skip
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                queue = await channel.declare_queue(name, passive=True)
                if queue.declaration_result.message_count == 0:
                    break
                await asyncio.sleep(0.5)
            await asyncio.sleep(settle)
            held = rss_mb(worker.pid)
    return {
        "staged": staged,
        "idle_rss_mb": round(idle, 1),
        "held_rss_mb": round(held, 1),
        "delta_mb": round(held - idle, 1),
        "per_delivery_kb": round((held - idle) * 1024 / staged, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--staged", type=int, default=20_000)
    print(asyncio.run(measure(parser.parse_args().staged)))


if __name__ == "__main__":
    main()
