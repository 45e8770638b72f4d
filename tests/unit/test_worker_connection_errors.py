"""What the worker counts as "the connection failed" around its own statements
(``workers.errors.CONNECTION_ERRORS``): a switchover's errors requeue the delivery as
``DatabaseUnavailable``; they must not reach the consumer's ``delivery_failed`` path."""

from __future__ import annotations

import asyncpg
import pytest

from workers.errors import CONNECTION_ERRORS


@pytest.mark.parametrize(
    "error",
    [
        ConnectionRefusedError(111, "Connect call failed"),  # the old primary is down
        asyncpg.TargetServerAttributeNotMatched("no host is writable"),  # not promoted yet
        asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
        asyncpg.InterfaceError("connection has been released back to the pool"),
        # a fast shutdown's FATAL 57P01 still being consumed when the statement went out
        asyncpg.InternalClientError(
            "cannot switch to state 12; another operation (2) is in progress"
        ),
    ],
)
def test_switchover_errors_are_connection_errors(error: BaseException) -> None:
    assert isinstance(error, CONNECTION_ERRORS)


def test_a_statement_the_server_refused_is_not() -> None:
    assert not isinstance(asyncpg.UniqueViolationError("duplicate key"), CONNECTION_ERRORS)
