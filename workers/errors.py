"""What the worker's parts raise to each other when an outcome cannot be recorded.

Its own module because the executor, the transaction groups and the consumer all need
it, and the groups sit below the executor: defined in either, it would make them import
each other.
"""

from __future__ import annotations

__all__ = ["DatabaseUnavailable"]


class DatabaseUnavailable(Exception):
    """No outcome could be recorded (PostgreSQL unreachable, or a bug): requeue."""
