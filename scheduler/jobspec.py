"""What a producer asks for, validated before it reaches the database (pure).

The database refuses bad rows too (CHECK constraints, for producers using plain SQL);
validating here first gives API and CLI users an error that names their mistake
instead of a constraint name.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from scheduler.errors import InvalidInput

QUEUE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
MAX_TASK_LENGTH = 200
MAX_KEY_LENGTH = 500
MAX_UNIQUE_KEY_LENGTH = 200
MAX_ATTEMPTS_LIMIT = 1000

#: The rules of CHECK jobs_tags_invalid and jobs_meta_invalid (migration 0022).
MAX_TAGS = 32
MAX_TAG_LENGTH = 64
MAX_META_BYTES = 65536
#: What a tag may not contain: ASCII whitespace and control characters, C1 controls, and
#: the comma (tags are given comma-separated on the dashboard, and the CHECK joins them
#: with commas).
TAG_FORBIDDEN = re.compile("[\x00-\x20\x7f-\x9f,]")

#: Largest rate count of a limit (CHECK limits_rate_invalid, migration 0018).
MAX_RATE_COUNT = 1_000_000

#: A limit's rate periods in seconds by unit (CHECK limits_rate_invalid allows these).
RATE_PERIODS = {"s": 1, "min": 60, "h": 3600}
DEFAULT_QUEUE = "default"
DEFAULT_MAX_ATTEMPTS = 5
# asyncpg sends datetime.min/max as -infinity/infinity, which the jobs_due_at_not_finite
# CHECK refuses with a constraint name; a plain range check gives the user a clear error.
EARLIEST_DUE = datetime(1970, 1, 1, tzinfo=UTC)
LATEST_DUE = datetime(9999, 1, 1, tzinfo=UTC)


def validate_task(task: str) -> str:
    if not isinstance(task, str) or not task.strip():
        raise InvalidInput("task name must be a non-empty string")
    if len(task) > MAX_TASK_LENGTH:
        raise InvalidInput(f"task name is longer than {MAX_TASK_LENGTH} characters")
    return task


def validate_payload(payload: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(payload, dict):
        raise InvalidInput(f"payload must be a JSON object (a dict), not {type(payload).__name__}")
    return payload


def validate_max_attempts(max_attempts: int) -> int:
    if isinstance(max_attempts, bool) or not isinstance(max_attempts, int):
        raise InvalidInput("max_attempts must be an integer")
    if not 1 <= max_attempts <= MAX_ATTEMPTS_LIMIT:
        raise InvalidInput(f"max_attempts must be between 1 and {MAX_ATTEMPTS_LIMIT}")
    return max_attempts


def validate_unique_key(key: str) -> str:
    """The rule of CHECK jobs_unique_key_invalid (migration 0014): 1-200 characters and
    no control characters, which would make keys unreadable in logs and the CLI."""
    if not isinstance(key, str) or not 1 <= len(key) <= MAX_UNIQUE_KEY_LENGTH:
        raise InvalidInput(f"unique_key must be 1-{MAX_UNIQUE_KEY_LENGTH} characters")
    if any(unicodedata.category(ch) == "Cc" for ch in key):
        raise InvalidInput("unique_key must not contain control characters")
    return key


def validate_limit_key(key: str) -> str:
    """The rule of CHECK jobs_limit_key_invalid (migration 0016), the one unique keys
    have: 1-200 characters, no control characters."""
    if not isinstance(key, str) or not 1 <= len(key) <= MAX_UNIQUE_KEY_LENGTH:
        raise InvalidInput(f"limit_key must be 1-{MAX_UNIQUE_KEY_LENGTH} characters")
    if any(unicodedata.category(ch) == "Cc" for ch in key):
        raise InvalidInput("limit_key must not contain control characters")
    return key


def validate_tags(tags: Any) -> tuple[str, ...]:
    """The rule of CHECK jobs_tags_invalid (migration 0022): a list (or tuple) of at most
    ``MAX_TAGS`` strings, each 1-``MAX_TAG_LENGTH`` characters without whitespace, comma
    or control character. Returned as a tuple (a ``JobSpec`` is frozen)."""
    if isinstance(tags, str) or not isinstance(tags, list | tuple):
        raise InvalidInput(
            f"tags must be a list of strings, not {type(tags).__name__} (e.g. tags=['tenant:42'])"
        )
    if len(tags) > MAX_TAGS:
        raise InvalidInput(f"a job has at most {MAX_TAGS} tags (got {len(tags)})")
    for tag in tags:
        validate_tag(tag)
    return tuple(tags)


def validate_tag(tag: Any) -> str:
    """One tag, by the rule of ``validate_tags``."""
    if not isinstance(tag, str) or not 1 <= len(tag) <= MAX_TAG_LENGTH:
        raise InvalidInput(f"a tag must be a string of 1-{MAX_TAG_LENGTH} characters (got {tag!r})")
    if TAG_FORBIDDEN.search(tag):
        raise InvalidInput(
            f"tag {tag!r} contains whitespace, a comma or a control character "
            "(use e.g. 'tenant:42', 'import-2026-12')"
        )
    return tag


def validate_meta(meta: Any) -> dict[str, Any]:
    """The rule of CHECK jobs_meta_invalid (migration 0022): a JSON object of at most
    ``MAX_META_BYTES``. Measured here as JSON text (the database measures the stored
    jsonb, which is about as long); values JSON cannot hold are refused here too."""
    if not isinstance(meta, dict):
        raise InvalidInput(f"meta must be a JSON object (a dict), not {type(meta).__name__}")
    try:
        text = json.dumps(meta, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"meta is not valid JSON: {exc}") from None
    size = len(text.encode())
    if size > MAX_META_BYTES:
        raise InvalidInput(f"meta is {size} bytes as JSON; at most {MAX_META_BYTES} (64 KiB)")
    return meta


def parse_limit_target(target: str) -> tuple[str, str]:
    """``task:NAME`` or ``queue:NAME`` as (kind, name), by the rule of CHECK
    limits_target_invalid (migration 0016): a task name without control characters, a
    queue name as ``validate_queue`` has it."""
    kind, sep, name = target.partition(":") if isinstance(target, str) else ("", "", "")
    if not sep or kind not in ("task", "queue"):
        raise InvalidInput(f"limit target must be task:NAME or queue:NAME (got {target!r})")
    if kind == "queue":
        validate_queue(name)
    else:
        validate_task(name)
        if any(unicodedata.category(ch) == "Cc" for ch in name):
            raise InvalidInput("a limited task name must not contain control characters")
    return kind, name


def parse_rate(text: str) -> tuple[int, int]:
    """``N/s``, ``N/min`` or ``N/h`` (also ``sec``, ``second``, ``m``, ``minute``,
    ``hour``) as (count, period seconds), by the rule of CHECK limits_rate_invalid."""
    count, sep, unit = text.partition("/") if isinstance(text, str) else ("", "", "")
    count, unit = count.strip(), unit.strip().lower()
    unit = {"sec": "s", "second": "s", "m": "min", "minute": "min", "hour": "h"}.get(unit, unit)
    if not sep or unit not in RATE_PERIODS or not (count.isascii() and count.isdigit()):
        raise InvalidInput(f"a rate is N/s, N/min or N/h (got {text!r})")
    n = int(count)
    if not 1 <= n <= MAX_RATE_COUNT:
        raise InvalidInput(f"a rate's count must be between 1 and {MAX_RATE_COUNT}")
    return n, RATE_PERIODS[unit]


def validate_queue(queue: str) -> str:
    if not isinstance(queue, str) or not QUEUE_NAME.match(queue):
        raise InvalidInput(
            f"invalid queue name {queue!r}: 1-100 characters, letters, digits, '_', '.', '-',"
            " starting with a letter or digit"
        )
    return queue


@dataclass(frozen=True, slots=True)
class JobSpec:
    task: str
    payload: dict[str, Any] = field(default_factory=dict)
    due_at: datetime | None = None  # None: now (database time)
    queue: str = DEFAULT_QUEUE
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    idempotency_key: str | None = None
    #: what the job is about (``JobFilter(tags=...)``); a list is kept as a tuple
    tags: Sequence[str] = ()
    #: the producer's own data kept with the job, not passed to the handler
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate_task(self.task)
        validate_payload(self.payload)
        object.__setattr__(self, "tags", validate_tags(self.tags))
        validate_meta(self.meta)
        validate_queue(self.queue)
        validate_max_attempts(self.max_attempts)
        if self.due_at is not None:
            if not isinstance(self.due_at, datetime):
                raise InvalidInput("due_at must be a datetime")
            if self.due_at.tzinfo is None:
                raise InvalidInput("due_at must be timezone-aware (e.g. UTC)")
            if not EARLIEST_DUE <= self.due_at < LATEST_DUE:
                raise InvalidInput(
                    f"due_at {self.due_at.isoformat()} is out of range (years 1970 to 9998)"
                )
        key = self.idempotency_key
        if key is not None and not (isinstance(key, str) and 1 <= len(key) <= MAX_KEY_LENGTH):
            raise InvalidInput(f"idempotency_key must be 1-{MAX_KEY_LENGTH} characters")


def resolve_due(
    *, due_at: datetime | None, delay: timedelta | float | None, now: datetime
) -> datetime | None:
    """``due_at`` or ``now + delay`` (not both); None means 'now' in database time."""
    if due_at is not None and delay is not None:
        raise InvalidInput("give either due_at or delay, not both")
    if delay is None:
        return due_at
    seconds = delay.total_seconds() if isinstance(delay, timedelta) else float(delay)
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidInput(f"delay must be a finite number of seconds >= 0 (got {seconds})")
    try:
        return now + timedelta(seconds=seconds)
    except OverflowError:
        raise InvalidInput(f"delay of {seconds:g} seconds is too large") from None
