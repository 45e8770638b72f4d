"""Which start failures a long-running service retries, and the retry loop itself.

The exceptions are the real classes asyncpg and aiormq raise; the loop is driven with
short back-offs so every test ends in well under a second.
"""

from __future__ import annotations

import asyncio
import ssl

import aiormq.exceptions
import asyncpg
import pytest

from scheduler.errors import ConfigError, InvalidInput, ServiceUnavailable
from scheduler.startup import is_permanent_cause, is_transient, start_with_retry

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize(
    "exc",
    [
        aiormq.exceptions.ConnectionInternalError("INTERNAL_ERROR"),  # the CI failure
        aiormq.exceptions.ConnectionClosed(320, "CONNECTION_FORCED"),
        aiormq.exceptions.ChannelInvalidStateError("channel closed"),
        ConnectionRefusedError(111, "refused"),
        TimeoutError(),
        asyncpg.exceptions.CannotConnectNowError("the database system is starting up"),
        asyncpg.exceptions.TooManyConnectionsError("too many clients"),
        ServiceUnavailable("cannot connect to PostgreSQL"),
    ],
)
def test_transient(exc: BaseException) -> None:
    assert is_transient(exc)


@pytest.mark.parametrize(
    "exc",
    [
        aiormq.exceptions.ProbableAuthenticationError("ACCESS_REFUSED"),
        aiormq.exceptions.ConnectionNotAllowed(530, "vhost not found"),
        asyncpg.exceptions.InvalidPasswordError("password authentication failed"),
        asyncpg.exceptions.InvalidCatalogNameError('database "x" does not exist'),
        ssl.SSLCertVerificationError("certificate verify failed"),
        ServiceUnavailable("access refused", transient=False),
        InvalidInput("queue exists with different arguments"),
        ConfigError("bad url"),
        ValueError("a bug"),
        KeyError("a bug"),
    ],
)
def test_not_transient(exc: BaseException) -> None:
    assert not is_transient(exc)


def test_permanent_causes_are_what_waiting_cannot_fix() -> None:
    assert is_permanent_cause(asyncpg.exceptions.InvalidPasswordError("no"))
    assert is_permanent_cause(aiormq.exceptions.ProbableAuthenticationError("no"))
    assert not is_permanent_cause(ConnectionRefusedError(111, "refused"))
    assert not is_permanent_cause(aiormq.exceptions.ConnectionInternalError("oops"))


async def test_retries_transient_failures_until_start_succeeds() -> None:
    errors: list[BaseException] = [
        aiormq.exceptions.ConnectionInternalError("INTERNAL_ERROR"),
        ConnectionRefusedError(111, "refused"),
    ]
    calls = 0

    async def start() -> None:
        nonlocal calls
        calls += 1
        if errors:
            raise errors.pop(0)

    started = await start_with_retry(start, asyncio.Event(), service="t", base=0.01, cap=0.02)
    assert started is True
    assert calls == 3


async def test_permanent_failure_propagates_at_once() -> None:
    calls = 0

    async def start() -> None:
        nonlocal calls
        calls += 1
        raise aiormq.exceptions.ProbableAuthenticationError("ACCESS_REFUSED")

    with pytest.raises(aiormq.exceptions.ProbableAuthenticationError):
        await start_with_retry(start, asyncio.Event(), service="t", base=0.01, cap=0.02)
    assert calls == 1


async def test_stop_while_waiting_to_retry_returns_false_promptly() -> None:
    stop = asyncio.Event()
    calls = 0

    async def start() -> None:
        nonlocal calls
        calls += 1
        stop.set()  # SIGTERM arrives while the service cannot start
        raise ConnectionRefusedError(111, "refused")

    loop = asyncio.get_running_loop()
    began = loop.time()
    started = await start_with_retry(start, stop, service="t", base=30.0, cap=30.0)
    assert started is False
    assert calls == 1
    assert loop.time() - began < 1.0  # did not sit out the 15-30 s back-off


async def test_stop_during_an_attempt_cancels_the_attempt() -> None:
    """A start attempt that hangs (a broker that accepts TCP and never answers: the
    connect waits amqp_timeout) is cancelled when stop is set, not awaited to its end."""
    stop = asyncio.Event()
    entered = asyncio.Event()
    cleaned_up = False

    async def start() -> None:
        nonlocal cleaned_up
        entered.set()
        try:
            await asyncio.sleep(3600)
        finally:
            cleaned_up = True  # what a start closes on its way out

    retrying = asyncio.create_task(start_with_retry(start, stop, service="t"))
    await entered.wait()
    stop.set()
    assert await asyncio.wait_for(retrying, 1.0) is False
    assert cleaned_up


async def test_an_attempt_that_fails_oddly_when_cancelled_by_a_stop_is_abandoned() -> None:
    """aiormq's connect, cancelled during its handshake, raises StopAsyncIteration (not
    transient, not CancelledError): a stop that cancels it must still end the loop
    quietly (False), not propagate that error (a worker stopped while connecting to an
    unreachable broker exited with a traceback)."""
    stop = asyncio.Event()
    entered = asyncio.Event()

    async def start() -> None:
        entered.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise StopAsyncIteration from None

    retrying = asyncio.create_task(start_with_retry(start, stop, service="t"))
    await entered.wait()
    stop.set()
    assert await asyncio.wait_for(retrying, 1.0) is False


async def test_a_stop_set_before_the_first_attempt_starts_nothing() -> None:
    stop = asyncio.Event()
    stop.set()
    calls = 0

    async def start() -> None:
        nonlocal calls
        calls += 1

    assert await start_with_retry(start, stop, service="t") is False
    assert calls == 0
