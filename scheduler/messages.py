"""The job message (contract, DESIGN §5), encoded by the dispatcher, decoded by workers.

Body: persistent JSON ``{job_id, due_at, attempt, task, payload, idempotency_key,
epoch}``; ``message_id`` is ``<job_id>:<attempt>``. Decoding is strict about the
contract fields (types, ranges) and tolerant of extra fields, so a newer producer can
add fields without breaking older workers. Nothing in a message is ever executed,
imported or unpickled: ``task`` is only a key into the worker's registry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from scheduler.errors import DuetimeError

CONTENT_TYPE = "application/json"
# A payload the database accepts (<= 1 MiB stored, migration 0005) can encode to ~6x
# that (control characters become \u001f); the body limit must never refuse a job the
# database accepted, or its message would be dead-lettered and re-published forever.
MAX_BODY_BYTES = 8 * 1024 * 1024
BIGINT_MAX = 2**63 - 1
INT_MAX = 2**31 - 1
FIELDS = ("job_id", "due_at", "attempt", "task", "payload", "idempotency_key", "epoch")


class MalformedMessage(DuetimeError):
    """A message that cannot be a job: dead-lettered, never retried."""


@dataclass(frozen=True, slots=True)
class JobMessage:
    job_id: int
    due_at: datetime
    attempt: int
    task: str
    payload: dict[str, Any]
    idempotency_key: str
    epoch: int

    @property
    def message_id(self) -> str:
        return f"{self.job_id}:{self.attempt}"

    def encode(self) -> bytes:
        return json.dumps(
            {
                "job_id": self.job_id,
                "due_at": self.due_at.isoformat(),
                "attempt": self.attempt,
                "task": self.task,
                "payload": self.payload,
                "idempotency_key": self.idempotency_key,
                "epoch": self.epoch,
            },
            separators=(",", ":"),
            ensure_ascii=False,
        ).encode("utf-8")


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
    task, key, payload = data["task"], data["idempotency_key"], data["payload"]
    if not isinstance(task, str) or not task.strip() or len(task) > 200 or not _text_ok(task):
        raise MalformedMessage(f"field 'task' must be a non-empty string, got {task!r:.60}")
    if not isinstance(key, str) or not 1 <= len(key) <= 500 or not _text_ok(key):
        raise MalformedMessage("field 'idempotency_key' must be a string of 1-500 characters")
    if not isinstance(payload, dict):
        raise MalformedMessage(f"field 'payload' must be an object, got {type(payload).__name__}")
    raw_due = data["due_at"]
    try:
        due_at = datetime.fromisoformat(raw_due) if isinstance(raw_due, str) else None
    except ValueError:
        due_at = None
    if due_at is not None and due_at.tzinfo is not None:
        try:
            due_at.astimezone(UTC)
        except OverflowError:
            due_at = None
    if due_at is None or due_at.tzinfo is None:
        raise MalformedMessage(
            f"field 'due_at' must be an ISO 8601 time with offset: {raw_due!r:.60}"
        )
    return JobMessage(
        job_id=_int(data, "job_id", 1, BIGINT_MAX),
        due_at=due_at,
        attempt=_int(data, "attempt", 1, INT_MAX),
        task=task,
        payload=payload,
        idempotency_key=key,
        epoch=_int(data, "epoch", 0, BIGINT_MAX),
    )
