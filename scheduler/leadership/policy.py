"""The replica's pure decisions: why a term ended, when to campaign again, and the
PostgreSQL session settings that keep a frozen leader from holding the fence.

They are apart from ``replica`` (the term loop) so they can be tested without etcd or
PostgreSQL (tests/unit/test_replica_logic.py, test_zombie_settings.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from scheduler.backoff import bounded_jitter
from scheduler.config import Settings
from scheduler.errors import Fenced, LeadershipLost, describe

__all__ = [
    "STEP_DOWN_REASONS",
    "recampaign_delay",
    "session_settings",
    "term_end_reason",
]

# Bounded label values of duetime_leader_transitions_total{reason}; "elected" counts gains.
STEP_DOWN_REASONS = ("stopped", "lease_lost", "fenced", "fence_error", "duty_exited", "error")


def term_end_reason(
    *,
    hold: asyncio.Future[Any] | None,
    duties: Mapping[str, asyncio.Future[Any]],
    stopped: bool,
) -> tuple[str, str]:
    """Why a term ends, as ``(reason, detail)``, from the tasks that have finished.

    ``reason`` is one of ``STEP_DOWN_REASONS`` (a metric label). A finished ``hold``
    always means the lease can no longer be proven (even a bug in it: fail closed).
    """
    if hold is not None and hold.done():
        if hold.cancelled():
            return "lease_lost", "hold cancelled"
        exc = hold.exception()
        if isinstance(exc, LeadershipLost):
            return "lease_lost", exc.reason
        return "lease_lost", f"hold ended: {describe(exc) if exc else 'returned'}"
    for name, task in duties.items():
        if not task.done():
            continue
        if task.cancelled():
            return "duty_exited", f"{name}: cancelled"
        exc = task.exception()
        if isinstance(exc, Fenced):
            return "fenced", f"{name}: {exc}"
        if isinstance(exc, LeadershipLost):
            return "lease_lost", f"{name}: {exc.reason}"
        return "duty_exited", f"{name}: {describe(exc) if exc else 'returned'}"
    if stopped:
        return "stopped", "stop requested"
    raise ValueError("no term task has finished")


def _ms(seconds: float) -> str:
    return f"{max(1, round(seconds * 1000))}ms"


def session_settings(settings: Settings) -> dict[str, str]:
    """PostgreSQL settings of every scheduler session.

    A paused (SIGSTOPped) leader's open transaction holds the fence row FOR SHARE, and
    the next leader's fence update waits for it. Where the zombie's backend stands
    decides what ends it (measured on PostgreSQL 15, Linux 6.x):

    - idle in the transaction (between statements, e.g. waiting for confirms):
      ``idle_in_transaction_session_timeout``, one TTL;
    - running a statement or waiting for a lock: ``statement_timeout``, at most one TTL
      (``Settings.effective_statement_timeout``);
    - sending a result the frozen client no longer reads (state ``active``, wait event
      ``ClientWrite``): neither timeout fires there (a 1 s statement_timeout still held
      the lock after 15 s); ``tcp_user_timeout`` (one TTL by default) makes the kernel
      drop the connection once the client's window stayed shut that long (2 s: gone
      after 2.0-2.5 s). Keepalives and ``client_connection_check_interval`` do not help
      (the frozen client's kernel still answers). Not every kernel enforces the user
      timeout on a zero window, so the new leader also terminates the sessions that
      still block its fence update after ``fence_takeover_grace`` (scheduler/store/fenced.py).
    """
    out = {
        "idle_in_transaction_session_timeout": _ms(max(1.0, settings.lease_ttl)),
        "statement_timeout": _ms(settings.effective_statement_timeout),
    }
    if settings.effective_tcp_user_timeout > 0:
        out["tcp_user_timeout"] = _ms(settings.effective_tcp_user_timeout)
    return out


def recampaign_delay(short_terms: int, ttl: float) -> float:
    """Pause before campaigning again after ``short_terms`` consecutive terms that
    lasted less than one TTL (0 after a healthy term)."""
    if short_terms <= 0:
        return 0.0
    return bounded_jitter(short_terms, base=ttl / 4, cap=ttl * 4)
