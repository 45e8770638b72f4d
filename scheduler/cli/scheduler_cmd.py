"""``duetime scheduler``: run one scheduler replica until SIGTERM/SIGINT.

The replica campaigns for leadership in etcd, runs the leader's duties
(``scheduler.duties.default_duties``) while it holds the lease, and resigns on the way
out so a standby takes over at once. It leads its share of the shards
(``DUETIME_SHARDS``), each with its own election key, fence and duties; without shards,
the one shard ``main`` on ``<prefix>/leader``. Exit status
0 after a graceful stop, 130 after a second signal, 1 when PostgreSQL cannot be reached
at start.
"""

from __future__ import annotations

import argparse
from typing import Any

from scheduler.cli._util import add_command
from scheduler.config import Settings
from scheduler.duties import default_duties
from scheduler.errors import ConfigError
from scheduler.leadership.replica import Replica
from scheduler.log import get_logger
from scheduler.observability import database_check
from scheduler.service import Service

HELP = "run a scheduler replica (leader election, dispatch and maintenance duties)"


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    parser = add_command(sub, common, "scheduler", HELP, __doc__)
    parser.set_defaults(func=run)


async def run(args: argparse.Namespace, settings: Settings) -> int:
    if settings.database_pooler == "transaction":
        raise ConfigError(
            "the scheduler needs sessions of its own (LISTEN wake-ups, the fence): give it "
            "database_pooler=none and a URL of PostgreSQL itself or of a pool in session mode"
        )
    log = get_logger("duetime.scheduler", node_id=settings.node_id, epoch=None)
    log.info("scheduler_starting", config=settings.redacted())
    async with Service(
        "scheduler", metrics_port=settings.metrics_port, metrics_host=settings.metrics_listen
    ) as service:
        replica = Replica(settings, default_duties)

        def ready() -> None:
            # /readyz: a standby is ready when it can reach PostgreSQL and etcd; the
            # check of an unsharded cluster's one database keeps its name, "db"
            for shard, pool in replica.pools.items():
                name = f"db_{shard}" if replica.report.sharded else "db"
                service.observability.add_check(name, database_check(pool))
            service.observability.add_check("etcd", replica.etcd_check)
            service.ready()

        await replica.run_until_stopped(service.stop_event, on_ready=ready)
    log.info("scheduler_exited")
    return 0
