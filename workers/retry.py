"""Failure policy (pure): what a failed attempt turns into.

A handler that raises gets, in a new transaction after its own was rolled back:

- ``Fail(reason)`` → ``dead`` at once, whatever attempts remain (bad input that no
  retry can fix);
- otherwise, if ``attempt >= max_attempts`` → ``dead`` (the budget is spent);
- ``Retry(in_=…)`` → ``pending`` with the next attempt after exactly that delay. It
  still **counts as an attempt**: a handler that keeps asking for a retry ends ``dead``
  when the budget is spent, so "poll until ready" loops are bounded by ``max_attempts``;
- any other exception (a timeout included) → ``pending`` with the next attempt after
  the task's ``RetryPolicy`` delay: exponential with full jitter, capped.

Every delay is bounded by ``MAX_RETRY_DELAY`` (366 days): a handler asking for
``Retry(in_=1e13)`` waits that long at most instead of overflowing the database's
interval arithmetic, which would make the failure unrecordable and requeue the delivery
forever.

``last_error`` is ``"ExcType: message"`` cut to ``MAX_ERROR_CHARS``; the traceback
goes to the log, not the database. An exception whose ``str()`` raises is described by
its type alone.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from datetime import timedelta

from scheduler.backoff import exponential_delay

MAX_ERROR_CHARS = 2000
#: The longest delay any retry gets (seconds); also bounded again in execution.sql.
MAX_RETRY_DELAY = 366 * 86400.0


class Retry(Exception):
    """Raise from a handler to retry after a chosen delay (counts as an attempt)."""

    def __init__(self, in_: float | timedelta, reason: str | None = None) -> None:
        seconds = in_.total_seconds() if isinstance(in_, timedelta) else float(in_)
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"Retry delay must be a finite number of seconds >= 0, not {in_!r}")
        self.delay = seconds
        self.reason = reason
        super().__init__(reason or f"retry requested in {seconds:g}s")


class Fail(Exception):
    """Raise from a handler to mark the job ``dead`` now, without further attempts."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Delay before retry number ``n`` (1 = first retry): ``min(cap, base * factor**(n-1))``,
    drawn uniformly from ``[0, that]`` when ``jitter`` (full jitter), so jobs that failed
    together (a downstream outage) do not come back together."""

    base: float = 5.0
    factor: float = 3.0
    cap: float = 3600.0
    jitter: bool = True

    def __post_init__(self) -> None:
        for name in ("base", "factor", "cap"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"RetryPolicy.{name} must be a number, not {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"RetryPolicy.{name} must be finite, not {value!r}")
        if self.base <= 0:
            raise ValueError(f"RetryPolicy.base must be > 0 seconds (got {self.base})")
        if self.factor < 1:
            raise ValueError(f"RetryPolicy.factor must be >= 1 (got {self.factor})")
        if self.cap < self.base:
            raise ValueError(f"RetryPolicy.cap ({self.cap}) must be >= base ({self.base})")
        if self.cap > MAX_RETRY_DELAY:
            raise ValueError(
                f"RetryPolicy.cap ({self.cap}) must be <= {MAX_RETRY_DELAY:g} s (366 days)"
            )

    def delay(self, failures: int, *, rng: random.Random | None = None) -> float:
        return exponential_delay(
            failures, base=self.base, factor=self.factor, cap=self.cap, jitter=self.jitter, rng=rng
        )


DEFAULT_RETRY = RetryPolicy()


@dataclass(frozen=True, slots=True)
class RetryLater:
    delay: float
    error: str


@dataclass(frozen=True, slots=True)
class GiveUp:
    error: str


Decision = RetryLater | GiveUp


def describe(exc: BaseException) -> str:
    """``"ExcType: message"`` (just the type when the message is empty), truncated."""
    try:
        message = str(exc)
    except Exception as failed:  # a hostile __str__: never let it stop the outcome
        message = f"<str() raised {type(failed).__name__}>"
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return truncate(text)


def truncate(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """Cut to ``limit`` characters and make it storable: PostgreSQL text holds no NUL and
    only valid UTF-8 (a lone surrogate would fail the outcome's UPDATE)."""
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def decide(
    exc: BaseException,
    *,
    attempt: int,
    max_attempts: int,
    policy: RetryPolicy = DEFAULT_RETRY,
    rng: random.Random | None = None,
) -> Decision:
    """The outcome of attempt ``attempt`` (1-based) that raised ``exc``."""
    error = describe(exc)
    if isinstance(exc, Fail) or attempt >= max_attempts:
        return GiveUp(error)
    if isinstance(exc, Retry):
        return RetryLater(min(exc.delay, MAX_RETRY_DELAY), error)
    return RetryLater(min(policy.delay(attempt, rng=rng), MAX_RETRY_DELAY), error)
