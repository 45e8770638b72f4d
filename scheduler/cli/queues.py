"""``duetime queues add|list|remove|pause|resume``: the queues jobs may be dispatched to.

Only a declared queue becomes a RabbitMQ queue (``duetime.<name>``, created by the
leader's first publish to it); jobs a producer writes for any other name stay pending,
held, until an operator declares it here (docs/operations.md, "Queues"). A paused queue
dispatches nothing new; its running jobs finish. With shards, ``add``, ``remove``,
``pause`` and ``resume`` act on every shard (queues are shared by all of them) unless
``--shard`` names one; ``list`` shows each shard's view.
"""

from __future__ import annotations

import argparse
from typing import Any

from scheduler.cli._util import add_shard_option, opened, print_json, print_table
from scheduler.config import Settings
from scheduler.errors import InvalidInput
from scheduler.jobspec import validate_queue
from scheduler.store.queues import LIST_LIMIT, QueueStore

LIST_COLUMNS = ("queue", "declared", "paused", "pending", "dispatched", "held", "created_at")


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    queues = sub.add_parser("queues", help="declare the queues jobs are dispatched to")
    qsub = queues.add_subparsers(dest="queues_command", metavar="ACTION", required=True)

    add = qsub.add_parser("add", parents=[common], help="declare a queue (releases held jobs)")
    add.add_argument("name", help="queue name: [A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
    add_shard_option(add)
    add.set_defaults(func=run_add)

    remove = qsub.add_parser(
        "remove", parents=[common], help="undeclare a queue (its pending jobs are held)"
    )
    remove.add_argument("name")
    add_shard_option(remove)
    remove.set_defaults(func=run_remove)

    for action, text in (
        ("pause", "dispatch nothing new from a queue (running jobs finish)"),
        ("resume", "dispatch a paused queue's jobs again"),
    ):
        cmd = qsub.add_parser(action, parents=[common], help=text)
        cmd.add_argument("name")
        add_shard_option(cmd)
        cmd.set_defaults(func=run_pause, paused=action == "pause")

    lst = qsub.add_parser(
        "list", parents=[common], help="declared queues, and undeclared ones holding jobs"
    )
    lst.add_argument("--json", action="store_true")
    add_shard_option(lst)
    lst.set_defaults(func=run_list)


def _shards(settings: Settings, shard: str | None) -> list[str | None]:
    """The shards a command acts on: the one named, else all (None: unsharded)."""
    urls = settings.shard_urls
    if shard is not None:
        if shard not in urls:
            raise InvalidInput(f"unknown shard {shard!r} (shards: {', '.join(urls)})")
        return [shard]
    return list(urls) if len(urls) > 1 else [None]


def _where(shard: str | None) -> str:
    return f" in shard {shard}" if shard else ""


async def run_add(args: argparse.Namespace, settings: Settings) -> int:
    name = validate_queue(args.name)
    for shard in _shards(settings, args.shard):
        async with opened(settings, QueueStore, shard=shard) as store:
            added = await store.add(name)
        state = "declared" if added else "already declared"
        print(f"queue {name} {state}{_where(shard)}")
    return 0


async def run_remove(args: argparse.Namespace, settings: Settings) -> int:
    name = validate_queue(args.name)
    for shard in _shards(settings, args.shard):
        async with opened(settings, QueueStore, shard=shard) as store:
            removed, pending, dispatched = await store.remove(name)
        if not removed:
            raise InvalidInput(f"queue {name} is not declared{_where(shard)}")
        print(
            f"queue {name} removed{_where(shard)}: {pending} pending jobs now held, "
            f"{dispatched} dispatched left to finish; the RabbitMQ queue duetime.{name} is "
            "left as it is"
        )
    return 0


async def run_pause(args: argparse.Namespace, settings: Settings) -> int:
    name = validate_queue(args.name)
    for shard in _shards(settings, args.shard):
        async with opened(settings, QueueStore, shard=shard) as store:
            found = await store.set_paused(name, args.paused)
        if not found:
            raise InvalidInput(f"queue {name} is not declared{_where(shard)}")
        state = "paused: nothing new is dispatched" if args.paused else "resumed"
        print(f"queue {name} {state}{_where(shard)}")
    return 0


async def run_list(args: argparse.Namespace, settings: Settings) -> int:
    shards = _shards(settings, args.shard)
    out: list[dict[str, Any]] = []
    for shard in shards:
        async with opened(settings, QueueStore, shard=shard) as store:
            rows = await store.list()
        for row in rows:
            item = row.to_dict()
            if shard is not None:
                item["shard"] = shard
            out.append(item)
        if len(rows) == LIST_LIMIT:
            out.append({"name": f"... (first {LIST_LIMIT} shown)", "shard": shard})
    if args.json:
        print_json([item for item in out if "declared" in item])
        return 0
    columns = (("shard",) if shards != [None] else ()) + LIST_COLUMNS
    table = [
        {
            **item,
            "queue": item["name"],
            "declared": (
                ("yes" if item["declared"] else "NO: jobs held") if "declared" in item else ""
            ),
            # an undeclared name cannot be paused: it dispatches nothing anyway
            "paused": ("PAUSED" if item["paused"] else "no") if item.get("declared") else None,
        }
        for item in out
    ]
    if not table:
        print("no queues declared (duetime queues add NAME)")
        return 0
    print_table(table, columns)
    return 0
