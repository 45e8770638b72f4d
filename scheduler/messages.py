"""The job message (contract, docs/architecture.md), encoded by the dispatcher, decoded
by workers.

This module is the whole message contract: the body, the AMQP properties it travels with,
``message_id`` and a job's effective idempotency key (``effective_key``).

The message is a **pointer**: persistent JSON ``{job_id, due_at, attempt, epoch, task}``
(and ``start_at``, the run time, on a staged job's message: DESIGN §14);
``message_id`` is ``<job_id>:<attempt>``; ``type`` carries the task name for operators'
tools (cut to the 255 bytes an AMQP short string holds). The worker reads the task, the
payload and the idempotency key from the job row, in the statement that locks it (the
row is authoritative), so the payload does not travel through the broker: smaller
messages, and no copy of a payload's personal data in RabbitMQ. ``task`` stays for operators
reading a queue and as a cross-check: a worker that finds another task in the row logs a
security event and runs the row's.

Decoding accepts the older full body too (``payload`` and ``idempotency_key`` present),
so messages already queued during an upgrade still run; they are validated and ignored.
It is strict about the fields it uses (types, ranges) and tolerant of extra fields, so a
newer producer can add fields without breaking older workers. Nothing in a message is
ever executed, imported or unpickled.

``shard`` names the database the job row lives in (``scheduler/shards``): workers run
the delivery against that shard's pool. A body without it (from a dispatcher that
predates shards) is a job of shard ``main``, the one shard of an unsharded cluster; a
shard name that breaks the naming rule makes the message malformed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pamqp import commands as spec

from scheduler.config.shards import DEFAULT_SHARD, SHARD_NAME
from scheduler.errors import DuetimeError

CONTENT_TYPE = "application/json"
# A payload the database accepts (<= 1 MiB stored, migration 0005) can encode to ~6x
# that (control characters become \u001f); the body limit must never refuse a job the
# database accepted, or its message would be dead-lettered and re-published forever.
MAX_BODY_BYTES = 8 * 1024 * 1024
BIGINT_MAX = 2**63 - 1
INT_MAX = 2**31 - 1
FIELDS = ("job_id", "due_at", "attempt", "epoch")
OPTIONAL_FIELDS = ("task", "payload", "idempotency_key")
SHARD_FIELD = "shard"
#: The run time of a staged job (DESIGN §14): the worker holds the message until then.
#: Only staged queues carry it; a worker that does not stage never consumes them.
START_FIELD = "start_at"
PERSISTENT = 2  # AMQP delivery_mode: written to disk (quorum queues always are)
MAX_SHORTSTR = 255  # bytes in an AMQP short string (message properties)


class MalformedMessage(DuetimeError):
    """A message that cannot be a job: dead-lettered, never retried."""


@dataclass(frozen=True, slots=True)
class JobMessage:
    """One delivery's pointer at a job attempt. ``task`` (the dispatcher always sets it),
    ``payload`` and ``idempotency_key`` (older bodies only) are informational: the
    worker runs what the row says. ``shard``: which database holds the row."""

    job_id: int
    due_at: datetime
    attempt: int
    epoch: int
    task: str | None = None
    payload: dict[str, Any] | None = None
    idempotency_key: str | None = None
    shard: str = DEFAULT_SHARD
    start_at: datetime | None = None

    @property
    def message_id(self) -> str:
        return message_id(self.job_id, self.attempt)

    def encode(self) -> bytes:
        body: dict[str, Any] = {
            "job_id": self.job_id,
            "due_at": self.due_at.isoformat(),
            "attempt": self.attempt,
            "epoch": self.epoch,
            SHARD_FIELD: self.shard,
        }
        if self.start_at is not None:
            body[START_FIELD] = self.start_at.isoformat()
        for name in OPTIONAL_FIELDS:
            value = getattr(self, name)
            if value is not None:
                body[name] = value
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")

    def properties(self) -> spec.Basic.Properties:
        """The AMQP properties of this message: persistent, ``message_id``, JSON, and
        ``type`` = the task name cut to 255 bytes (workers read the task from the row,
        never from the message)."""
        return spec.Basic.Properties(
            delivery_mode=PERSISTENT,
            message_id=self.message_id,
            content_type=CONTENT_TYPE,
            message_type=_shortstr(self.task) if self.task is not None else None,
            app_id="duetime",
        )


def encode_job(message: JobMessage) -> tuple[bytes, spec.Basic.Properties]:
    """The body and the properties to publish ``message`` with."""
    return message.encode(), message.properties()


def message_id(job_id: int, attempt: int) -> str:
    """The AMQP ``message_id`` of an attempt's message (contract)."""
    return f"{job_id}:{attempt}"


def effective_key(
    job_id: int,
    idempotency_key: str | None,
    *,
    schedule_id: int | None,
    created_by: str | None,
) -> str:
    """A job's ledger key (contract, migration 0007), the twin of the SQL function
    ``duetime.effective_key`` that the worker's ``begin_deliveries`` calls
    (scheduler/sql/execution.sql); tests/integration/test_effective_key.py checks that
    the two agree.

    - no key (``None`` or empty) → ``job:<id>``;
    - a schedule's own key (``schedule:<schedule_id>:…`` on a row carrying that
      ``schedule_id``, which only the planner, ``schedules trigger`` and the owner can
      set) → the key as written;
    - any other key ``K`` → ``key:<n>:<created_by>:K``, ``n`` the length of
      ``created_by``: a producer's key is scoped by the role that inserted it, so one
      producer's key never deduplicates another's job (docs/security.md).
    """
    if not idempotency_key:
        return f"job:{job_id}"
    if schedule_id is not None and idempotency_key.startswith(f"schedule:{schedule_id}:"):
        return idempotency_key
    owner = created_by or ""
    return f"key:{len(owner)}:{owner}:{idempotency_key}"


def _shortstr(text: str) -> str:
    """``text`` cut to what an AMQP short string holds (255 bytes of UTF-8), on a
    character boundary. A task may have 200 characters, up to 800 bytes: written whole
    into ``type`` it failed every publish of its job (TypeError in pamqp), forever."""
    data = text.encode("utf-8")
    if len(data) <= MAX_SHORTSTR:
        return text
    return data[:MAX_SHORTSTR].decode("utf-8", "ignore")


def _int(body: dict[str, Any], key: str, minimum: int, maximum: int) -> int:
    value = body[key]
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise MalformedMessage(
            f"field {key!r} must be an integer in [{minimum}, {maximum}], got {str(value)[:60]}"
        )
    return value


def _text_ok(value: str) -> bool:
    """PostgreSQL text cannot hold NUL; lone surrogates cannot be encoded as UTF-8."""
    if "\x00" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def decode(body: bytes) -> JobMessage:
    """Parse and validate a message body; raise ``MalformedMessage`` saying what is wrong."""
    if len(body) > MAX_BODY_BYTES:
        raise MalformedMessage(f"body of {len(body)} bytes exceeds {MAX_BODY_BYTES}")
    try:
        data = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise MalformedMessage("body is not UTF-8") from None
    except (json.JSONDecodeError, RecursionError) as exc:
        raise MalformedMessage(f"body is not JSON: {exc}") from None
    except ValueError as exc:  # e.g. an integer over Python's digit limit
        raise MalformedMessage(f"body is not acceptable JSON: {str(exc)[:120]}") from None
    if not isinstance(data, dict):
        raise MalformedMessage(f"body must be a JSON object, got {type(data).__name__}")
    missing = [f for f in FIELDS if f not in data]
    if missing:
        raise MalformedMessage(f"missing field(s): {', '.join(missing)}")
    task, key, payload = data.get("task"), data.get("idempotency_key"), data.get("payload")
    if task is not None and (
        not isinstance(task, str) or not task.strip() or len(task) > 200 or not _text_ok(task)
    ):
        raise MalformedMessage(f"field 'task' must be a non-empty string, got {task!r:.60}")
    if key is not None and (
        not isinstance(key, str) or not 1 <= len(key) <= 500 or not _text_ok(key)
    ):
        raise MalformedMessage("field 'idempotency_key' must be a string of 1-500 characters")
    shard = data.get(SHARD_FIELD, DEFAULT_SHARD)
    if not isinstance(shard, str) or SHARD_NAME.fullmatch(shard) is None:
        raise MalformedMessage(f"field 'shard' must match [a-z0-9_-]{{1,32}}, got {shard!r:.60}")
    if payload is not None and not isinstance(payload, dict):
        raise MalformedMessage(f"field 'payload' must be an object, got {type(payload).__name__}")
    due_at = _time(data["due_at"], "due_at")
    raw_start = data.get(START_FIELD)
    start_at = None if raw_start is None else _time(raw_start, START_FIELD)
    return JobMessage(
        job_id=_int(data, "job_id", 1, BIGINT_MAX),
        due_at=due_at,
        attempt=_int(data, "attempt", 1, INT_MAX),
        epoch=_int(data, "epoch", 0, BIGINT_MAX),
        task=task,
        payload=payload,
        idempotency_key=key,
        shard=shard,
        start_at=start_at,
    )


def _time(raw: Any, name: str) -> datetime:
    """An ISO 8601 time with offset that Python can convert to UTC, or MalformedMessage."""
    try:
        value = datetime.fromisoformat(raw) if isinstance(raw, str) else None
    except ValueError:
        value = None
    if value is not None and value.tzinfo is not None:
        try:
            value.astimezone(UTC)
        except OverflowError:
            value = None
    if value is None or value.tzinfo is None:
        raise MalformedMessage(f"field {name!r} must be an ISO 8601 time with offset: {raw!r:.60}")
    return value
