"""One etcd connection for a long-running loop: every call bounded, dropped after an error.

The same rules as the single-leader election's connection handling: a call that fails
with anything but an answer from etcd ("no", "not found", credentials refused) drops
the client and moves to the next endpoint, because aetcd's watcher does not survive a
failed stream and a half-open channel would keep failing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aetcd
import grpc

from scheduler.leadership.etcd_client import EtcdTLS, make_client, refused_credentials

__all__ = ["ETCD_ERRORS", "EtcdConn", "describe"]

T = TypeVar("T")

ETCD_ERRORS: tuple[type[BaseException], ...] = (
    aetcd.ClientError, grpc.RpcError, grpc.aio.BaseError, TimeoutError, OSError,
)  # fmt: skip
_ANSWERS: tuple[type[BaseException], ...] = (
    aetcd.InvalidArgumentError, aetcd.PreconditionFailedError, aetcd.RevisionCompactedError,
)  # fmt: skip
_CLOSE_TIMEOUT = 1.0


class EtcdConn:
    """One lazily built aetcd client; every call bounded; dropped after an error."""

    def __init__(self, endpoints: list[tuple[str, int]], timeout: float,
                 auth: tuple[str | None, str | None], tls: EtcdTLS | None) -> None:  # fmt: skip
        self._endpoints = endpoints
        self._index = 0
        self._timeout = timeout
        self._auth = auth
        self._tls = tls
        self._client: aetcd.Client | None = None

    @property
    def endpoint(self) -> str:
        return "{}:{}".format(*self._endpoints[self._index])

    def client(self) -> aetcd.Client:
        if self._client is None:
            host, port = self._endpoints[self._index]
            self._client = make_client(
                host, port, username=self._auth[0], password=self._auth[1],
                timeout=self._timeout, tls=self._tls,
            )  # fmt: skip
        return self._client

    async def call(
        self, op: Callable[[aetcd.Client], Awaitable[T]], timeout: float | None = None
    ) -> T:
        """Run ``op`` within ``timeout`` (default: the call timeout)."""
        client = self.client()
        try:
            return await asyncio.wait_for(op(client), self._timeout if timeout is None else timeout)
        except ETCD_ERRORS as exc:
            await self.discard(client, exc)
            raise

    async def discard(self, client: aetcd.Client, error: BaseException) -> None:
        if isinstance(error, _ANSWERS) or refused_credentials(error) or "not found" in str(error):
            return
        if client is self._client:
            self._client = None
            self._index = (self._index + 1) % len(self._endpoints)
        await _close_client(client)

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await _close_client(client)


async def _close_client(client: aetcd.Client) -> None:
    channel = client.channel
    try:
        await asyncio.wait_for(client.close(), _CLOSE_TIMEOUT)
    except Exception:
        if channel is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(channel.close(), _CLOSE_TIMEOUT)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
