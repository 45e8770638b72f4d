"""``duetime limits set|list|remove``: concurrency and rate limits the dispatcher enforces.

``duetime limits set task:send_email --max-running 5``: never more than 5 jobs of task
send_email dispatched (published or running) at once in the whole cluster;
``--rate 100/s`` (or ``/min``, ``/h``): at most 100 of them start in any second; with
``--per-key``, per distinct ``limit_key``; ``queue:NAME`` limits a whole queue. The
leader's dispatcher reads the limits within a second and applies them to jobs already
pending (docs/operations.md, "Limits"). With shards, ``set`` and ``remove`` act on every
shard (each shard's dispatcher enforces its own rows) unless ``--shard`` names one.
"""

from __future__ import annotations

import argparse
from typing import Any

from scheduler.cli._util import add_shard_option, opened, print_json, print_table
from scheduler.cli.queues import _shards, _where
from scheduler.config import Settings
from scheduler.errors import InvalidInput
from scheduler.jobspec import parse_limit_target, parse_rate
from scheduler.store.limits import MAX_RUNNING_LIMIT, LimitStore

LIST_COLUMNS = (
    "target", "max_running", "rate", "per_key", "fair", "running", "started", "due", "updated_at"
)  # fmt: skip


def _max_running(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 1 <= value <= MAX_RUNNING_LIMIT:
        raise argparse.ArgumentTypeError(f"must be between 1 and {MAX_RUNNING_LIMIT}")
    return value


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    limits = sub.add_parser("limits", help="concurrency limits on tasks and queues")
    lsub = limits.add_subparsers(dest="limits_command", metavar="ACTION", required=True)

    set_ = lsub.add_parser("set", parents=[common], help="set or change a limit")
    set_.add_argument("target", help="task:NAME or queue:NAME")
    set_.add_argument(
        "--max-running",
        type=_max_running,
        help="at most this many jobs of the target dispatched at once, cluster-wide",
    )
    set_.add_argument(
        "--rate",
        metavar="N/PERIOD",
        help="at most N starts of the target per second, minute or hour (100/s, 5/min, 1000/h)",
    )
    set_.add_argument(
        "--per-key", action="store_true", help="the limit applies to each limit_key apart"
    )
    set_.add_argument(
        "--fair",
        action="store_true",
        help="a queue's due jobs start round-robin between limit keys, not by run time",
    )
    add_shard_option(set_)
    set_.set_defaults(func=run_set)

    remove = lsub.add_parser("remove", parents=[common], help="remove a limit")
    remove.add_argument("target")
    add_shard_option(remove)
    remove.set_defaults(func=run_remove)

    lst = lsub.add_parser("list", parents=[common], help="every limit and its use now")
    lst.add_argument("--json", action="store_true")
    add_shard_option(lst)
    lst.set_defaults(func=run_list)


async def run_set(args: argparse.Namespace, settings: Settings) -> int:
    kind, _ = parse_limit_target(args.target)
    if args.rate is not None:
        parse_rate(args.rate)
    if args.max_running is None and args.rate is None and not args.fair:
        raise InvalidInput("give --max-running N or --rate N/s, or --fair on a queue")
    if args.per_key and args.max_running is None and args.rate is None:
        raise InvalidInput("--per-key needs --max-running or --rate")
    if args.fair and kind != "queue":
        raise InvalidInput("--fair applies to a queue (queue:NAME)")
    rules = []
    scope = " per limit_key" if args.per_key else ""
    if args.max_running is not None:
        rules.append(f"at most {args.max_running} running{scope}")
    if args.rate is not None:
        count, period = parse_rate(args.rate)
        unit = {1: "second", 60: "minute", 3600: "hour"}[period]
        rules.append(f"at most {count} starts per {unit}{scope}")
    if args.fair:
        rules.append("round-robin between limit keys")
    for shard in _shards(settings, args.shard):
        async with opened(settings, LimitStore, shard=shard) as store:
            await store.set(
                args.target,
                args.max_running,
                per_key=args.per_key,
                fair=args.fair,
                rate=args.rate,
            )
        print(f"limit {args.target}: {', '.join(rules)}{_where(shard)}")
    return 0


async def run_remove(args: argparse.Namespace, settings: Settings) -> int:
    parse_limit_target(args.target)
    for shard in _shards(settings, args.shard):
        async with opened(settings, LimitStore, shard=shard) as store:
            removed = await store.remove(args.target)
        if not removed:
            raise InvalidInput(f"no limit on {args.target}{_where(shard)}")
        print(f"limit {args.target} removed{_where(shard)}")
    return 0


async def run_list(args: argparse.Namespace, settings: Settings) -> int:
    shards = _shards(settings, args.shard)
    out: list[dict[str, Any]] = []
    for shard in shards:
        async with opened(settings, LimitStore, shard=shard) as store:
            for row in await store.list():
                item = row.to_dict()
                if shard is not None:
                    item["shard"] = shard
                out.append(item)
    if args.json:
        print_json(out)
        return 0
    if not out:
        print("no limits set (duetime limits set task:NAME --max-running N | --rate N/s)")
        return 0
    columns = (("shard",) if shards != [None] else ()) + LIST_COLUMNS
    table = [
        {
            **item,
            "max_running": "" if item["max_running"] is None else item["max_running"],
            "rate": item["rate"] or "",
            "started": item["started"] if item["rate"] else "",
            "per_key": "yes" if item["per_key"] else "",
            "fair": "yes" if item["fair"] else "",
        }
        for item in out
    ]
    print_table(table, columns)
    return 0
