r"""Shared CLI helpers: argument parsers that give one-line errors, table/JSON output.

Everything a command prints about rows goes through ``say``/``print_table`` (text, with
``printable``) or ``print_json`` (JSON escapes control characters itself): a task name,
queue, key, error or payload is data anyone who can insert a row chose, and raw terminal
escapes in it (``\x1b]0;title\x07`` retitles the window, ``\x1b[2J`` clears the
screen, OSC 52 writes the clipboard, bidi overrides reorder what the reader sees) must
reach the terminal as visible text, never as control sequences."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import asyncpg

from scheduler import db
from scheduler.clock import SYSTEM_CLOCK, Clock
from scheduler.config import Settings
from scheduler.errors import InvalidInput
from scheduler.jobspec import validate_tag

T = TypeVar("T", int, float)
S = TypeVar("S")

#: C0 and C1 controls, DEL, and the format characters that reorder or break lines.
_UNPRINTABLE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]"
)
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    return _NAMED.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def printable(text: str) -> str:
    r"""``text`` with every control character written as an escape (``\x1b``, ``\n``,
    ``\u202e``), so it prints as what it is."""
    return _UNPRINTABLE.sub(_escape, text)


def say(text: str = "") -> None:
    """Print one line of a command's output, control characters escaped (``printable``)."""
    print(printable(text))


_DURATION = re.compile(r"(?P<n>\d+(?:\.\d+)?)\s*(?P<unit>ms|s|m|h|d|w)")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> timedelta:
    """'90s', '5m', '1h30m', '2d', '250ms' → timedelta (positive)."""
    compact = text.strip().lower().replace(" ", "")
    pos, total = 0, 0.0
    for match in _DURATION.finditer(compact):
        if match.start() != pos:
            break
        total += float(match.group("n")) * _UNITS[match.group("unit")]
        pos = match.end()
    if not compact or pos != len(compact):
        raise InvalidInput(f"invalid duration {text!r}: use e.g. 30s, 5m, 1h30m, 2d")
    try:
        return timedelta(seconds=total)
    except OverflowError:
        raise InvalidInput(f"invalid duration {text!r}: too large") from None


def parse_when(text: str, *, clock: Clock = SYSTEM_CLOCK) -> datetime:
    """ISO 8601 time; a time without an offset is taken as UTC; "now" is ``clock``'s."""
    raw = text.strip()
    if raw.lower() == "now":
        return clock.now()
    try:
        value = datetime.fromisoformat(raw.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise InvalidInput(
            f"invalid time {text!r}: use ISO 8601, e.g. 2026-12-01T09:30:00+01:00"
        ) from None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def parse_payload(text: str | None, *, flag: str = "--payload") -> dict[str, Any]:
    """A JSON object given as ``flag`` (``--payload``, ``--meta``)."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"{flag} is not valid JSON: {exc.msg} at position {exc.pos}") from None
    except (ValueError, RecursionError) as exc:  # int digit limit, nesting depth
        raise InvalidInput(f"{flag} is not acceptable JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidInput(f"{flag} must be a JSON object, not {type(value).__name__}")
    problem = _jsonb_problem(value)
    if problem:
        raise InvalidInput(f"{flag} {problem}")
    return value


def _jsonb_problem(value: Any) -> str | None:
    """What PostgreSQL's jsonb would refuse that Python's json accepts, if anything."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"contains {value}, which JSON (and jsonb) cannot store"
    if isinstance(value, str) and "\x00" in value:
        return "contains \\u0000, which jsonb cannot store"
    if isinstance(value, dict):
        items: list[Any] = [*value.keys(), *value.values()]
    elif isinstance(value, list):
        items = value
    else:
        return None
    for item in items:
        problem = _jsonb_problem(item)
        if problem:
            return problem
    return None


def bounded(
    kind: Callable[[str], T], noun: str, minimum: float, *, exclusive: bool = False
) -> Callable[[str], T]:
    """An argparse ``type``: ``kind(text)``, at least (or, ``exclusive``, more than)
    ``minimum``; a bad value is one line naming it, e.g. ``'x' is not an integer``."""
    relation = ">" if exclusive else ">="

    def parse(text: str) -> T:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if value < minimum or (exclusive and value == minimum):
            raise argparse.ArgumentTypeError(f"{text!r} must be {relation} {minimum:g}")
        return value

    return parse


positive_int = bounded(int, "an integer", 1)
#: seconds >= 0, and seconds > 0
seconds = bounded(float, "a number of seconds", 0)
positive_seconds = bounded(float, "a number of seconds", 0, exclusive=True)


def add_command(
    sub: Any,
    common: argparse.ArgumentParser,
    name: str,
    help: str,
    description: str | None,
    epilog: str | None = None,
) -> Any:
    """A sub-command whose ``--help`` shows ``description`` (its module's docstring) and
    ``epilog`` as written, with the flags every command accepts. Returns the sub-parser
    (a ``scheduler.cli.Parser``)."""
    return sub.add_parser(
        name,
        parents=[common],
        help=help,
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


MAX_ID = 2**63 - 1  # ids are bigint


def job_id(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"job id must be an integer, not {text!r}") from None
    if not 1 <= value <= MAX_ID:
        raise argparse.ArgumentTypeError(f"job id must be between 1 and {MAX_ID}, not {text!r}")
    return value


def job_tag(text: str) -> str:
    """``--tag``: one tag, by the rule of CHECK jobs_tags_invalid (``validate_tag``)."""
    try:
        return validate_tag(text)
    except InvalidInput as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def after_id(text: str) -> int:
    """``--after``: like a job id, but 0 (before the first job) is allowed."""
    return 0 if text.strip() == "0" else job_id(text)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"
    if isinstance(value, dict | list):
        text = json.dumps(value, separators=(",", ":"))
        return text if len(text) <= 40 else text[:37] + "..."
    return str(value)


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    cells = [[printable(_cell(r.get(c))) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    say("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip())
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


def print_json(value: Any) -> None:
    r"""``value`` as indented JSON (ASCII: every control character is a ``\u`` escape)."""
    print(json.dumps(value, indent=2, default=str, sort_keys=True))


def add_actions(
    sub: Any,
    common: argparse.ArgumentParser,
    actions: Sequence[tuple[str, str, Callable[..., Any]]],
    target: str,
    **target_options: Any,
) -> None:
    """Sub-commands ``(name, help, func)`` that each act on one ``target`` (a job id, a
    schedule) and print it, or ``--json``."""
    for name, helptext, func in actions:
        parser = sub.add_parser(name, parents=[common], help=helptext)
        parser.add_argument(target, **target_options)
        add_shard_option(parser)
        parser.add_argument("--json", action="store_true")
        parser.set_defaults(func=func)


def emit(args: argparse.Namespace, data: Any, text: str) -> int:
    """The outcome of a command: ``data`` as JSON with ``--json``, else ``text``; exit 0."""
    if args.json:
        print_json(data)
    else:
        say(text)
    return 0


def add_shard_option(parser: argparse.ArgumentParser) -> None:
    """``--shard NAME``: which shard's database a command reads or changes (job ids and
    schedule names are per shard)."""
    parser.add_argument(
        "--shard", metavar="NAME", help="the shard to act on (required when shards are set)"
    )


def shard_settings(settings: Settings, shard: str | None) -> Settings:
    """``settings`` pointed at one shard's database. Without shards ``--shard`` may only
    name the one shard ``main``; with several, a command must say which one it means
    (an id alone is ambiguous: every shard numbers its jobs from 1)."""
    urls = settings.shard_urls
    if shard is None:
        if len(urls) > 1:
            raise InvalidInput(f"this cluster has shards {', '.join(urls)}: name one with --shard")
        return settings
    if shard not in urls:
        raise InvalidInput(f"unknown shard {shard!r} (shards: {', '.join(urls)})")
    return dataclasses.replace(settings, database_url=urls[shard])


@asynccontextmanager
async def opened(
    settings: Settings, store: Callable[..., S], *, shard: str | None = None
) -> AsyncIterator[S]:
    """``store`` (``JobStore``, ``ScheduleStore``) on a pool of its own to ``shard``'s
    database (``shard_settings``), closed after: one command, a couple of statements."""
    settings = shard_settings(settings, shard)
    pool: asyncpg.Pool = await db.pool_from_settings(settings, max_size=2, display=True)
    try:
        yield store(pool, acquire_timeout=settings.db_timeout)
    finally:
        await pool.close()


class SettingOverride(argparse.Action):
    """Store a flag's value as an override of the ``Settings`` field ``dest``, so the
    value is validated and shown like every other setting (flags > env > file)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        overrides = dict(getattr(namespace, "settings_overrides", None) or {})
        overrides[self.dest] = values
        namespace.settings_overrides = overrides
