"""``python -m bench.replica``: ``duetime scheduler`` with the planner surely among its duties.

The recurring scenario needs the planner; until ``scheduler.duties.default_duties`` lists
it this runs the same ``Replica`` with the default duties plus ``Planner`` (added only if
missing), configured from the environment like ``duetime scheduler``. Once the planner
is wired in, both are the same process.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Sequence

from scheduler.config import load_settings
from scheduler.duties import default_duties
from scheduler.duties.planner import Planner
from scheduler.duty import LoopDuty
from scheduler.log import configure_logging
from scheduler.replica import Replica, ReplicaContext


def duties_with_planner(ctx: ReplicaContext) -> Sequence[LoopDuty]:
    duties = list(default_duties(ctx))
    if not any(duty.name == Planner.name for duty in duties):
        duties.append(Planner.from_context(ctx))
    return duties


async def main() -> None:
    settings = load_settings()
    configure_logging(settings.log_level, settings.log_format)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await Replica(settings, duties_with_planner).run_until_stopped(stop)


if __name__ == "__main__":
    asyncio.run(main())
