"""Building the etcd client: one place that decides plain gRPC or TLS, and the options.

aetcd 1.0 can only open ``grpc.aio.insecure_channel`` (its ``Client.connect``), so a
password sent for etcd auth would cross the network in clear and its token could be
replayed. ``TlsClient`` is an ``aetcd.Client`` whose ``connect`` opens
``grpc.aio.secure_channel`` instead; everything else in aetcd only uses the attributes
``connect`` sets (``channel``, ``metadata``, the stubs, the watcher), so it is otherwise
the same client.

TLS is on when ``etcd_ca_file`` is set: etcd's certificate must chain to that CA and
name the host dialled (gRPC checks the SAN, IP addresses included). ``etcd_cert_file``
and ``etcd_key_file`` add a client certificate, for etcd's ``--client-cert-auth``.
The files are read once, when the ``EtcdTLS`` is built, so a missing or unreadable file
stops a process at start with a ``ConfigError`` naming the setting and path, never the
content — not on its first election attempt.

``refused_credentials`` tells an etcd that said "not you" (wrong password, no user
name while auth is on, a user without a role on the prefix) from one that did not
answer: waiting fixes the second, never the first, so a replica exits on it at once.

``GRPC_OPTIONS`` are the keepalive settings every duetime etcd channel uses (why each
one is there is said beside it); plain and TLS channels get the same.

``EtcdConnection`` is how the election and the shard leadership reach etcd: every call
has a deadline (gRPC and ``asyncio.wait_for``, per call if asked); endpoints are tried
in turn, and after any error but an answer ("no", "not found", refused credentials)
the client is discarded (aetcd's watcher does not survive a failed stream) and the next
endpoint gets a fresh channel.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import aetcd
import grpc
from aetcd import exceptions as aetcd_exceptions
from aetcd import rpc, watcher

from scheduler.errors import ConfigError

if TYPE_CHECKING:
    from scheduler.config import Settings

__all__ = [
    "ETCD_ERRORS",
    "GRPC_OPTIONS",
    "EtcdConnection",
    "EtcdTLS",
    "TlsClient",
    "etcd_tls",
    "make_client",
    "parse_endpoint",
    "refused_credentials",
    "tls_failure_hint",
]

GRPC_OPTIONS: dict[str, int] = {
    # etcd's default --grpc-keepalive-min-time is 5 s: pinging more often earns a GOAWAY
    # "too_many_pings", which kills the watch stream (measured with 2 s).
    "grpc.keepalive_time_ms": 6_000,
    "grpc.keepalive_timeout_ms": 3_000,
    # Without it grpcio 1.85 does not act on an unanswered keepalive ping (measured: a
    # frozen etcd under an idle watch unnoticed for > 40 s; with it, 5-7 s).
    "grpc.http2.ping_timeout_ms": 3_000,
    # Default 2: an idle watch stream stops pinging after two pings, and a frozen etcd
    # then goes unnoticed for good (measured: > 40 s). 0 = no limit.
    "grpc.http2.max_pings_without_data": 0,
    # etcd rejects pings on a connection without streams (PermitWithoutStream=false).
    "grpc.keepalive_permit_without_calls": 0,
    # A channel that saw etcd down must not back off for minutes once it is back.
    "grpc.max_reconnect_backoff_ms": 1_000,
}

_MAX_PEM_BYTES = 1024 * 1024
T = TypeVar("T")

#: What a failed etcd call raises (the connection may be broken).
ETCD_ERRORS: tuple[type[BaseException], ...] = (
    aetcd.ClientError, grpc.RpcError, grpc.aio.BaseError, TimeoutError, OSError,
)  # fmt: skip
# etcd answered and said no: the connection is fine, keep it.
_ANSWERS: tuple[type[BaseException], ...] = (
    aetcd.InvalidArgumentError, aetcd.PreconditionFailedError, aetcd.RevisionCompactedError,
)  # fmt: skip
_CLOSE_TIMEOUT = 1.0


@dataclass(frozen=True, repr=False)
class EtcdTLS:
    """PEM bytes for a secure channel. ``repr`` hides the key."""

    ca: bytes
    cert: bytes | None = None
    key: bytes | None = None

    def __repr__(self) -> str:
        return f"EtcdTLS(client_cert={self.cert is not None})"

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )

    @classmethod
    def from_files(
        cls, ca_file: str | None, cert_file: str | None = None, key_file: str | None = None
    ) -> EtcdTLS | None:
        """None without a CA file (plain gRPC); ``ConfigError`` for an incomplete or
        unreadable set of files."""
        if ca_file is None:
            if cert_file or key_file:
                raise ConfigError(
                    "etcd_cert_file/etcd_key_file need etcd_ca_file (TLS to etcd is on "
                    "only when a CA file is set)"
                )
            return None
        if (cert_file is None) != (key_file is None):
            raise ConfigError("etcd_cert_file and etcd_key_file must be set together")
        cert = key = None
        if cert_file is not None and key_file is not None:
            cert = _read_pem("etcd_cert_file", cert_file, b"CERTIFICATE")
            key = _read_pem("etcd_key_file", key_file, b"PRIVATE KEY")
        return cls(ca=_read_pem("etcd_ca_file", ca_file, b"CERTIFICATE"), cert=cert, key=key)


def _read_pem(setting: str, path: str, kind: bytes) -> bytes:
    """The file's bytes; errors name the setting and path, never the content."""
    try:
        file = Path(path)
        if file.stat().st_size > _MAX_PEM_BYTES:
            raise ConfigError(f"{setting} {path} is larger than {_MAX_PEM_BYTES} bytes")
        data = file.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{setting} {path} cannot be read: {exc.strerror}") from None
    if b"-----BEGIN " not in data or kind not in data:
        raise ConfigError(f"{setting} {path} is not a PEM file with a {kind.decode().lower()}")
    return data


def etcd_tls(settings: Settings) -> EtcdTLS | None:
    """The TLS material ``settings`` asks for, read now (None: plain gRPC)."""
    return EtcdTLS.from_files(
        settings.etcd_ca_file, settings.etcd_cert_file, settings.etcd_key_file
    )


class TlsClient(aetcd.Client):  # type: ignore[misc]  # aetcd ships no type hints: its Client is Any
    """``aetcd.Client`` over ``grpc.aio.secure_channel``.

    ``connect`` mirrors aetcd 1.0's (same attributes, same auth request, same error
    mapping) with two changes: the channel, and one bounded RPC at connect time so a
    TLS failure is reported with what it means (``tls_failure_hint``). It relies on
    aetcd 1.0's attribute names; tests/integration/test_tls.py covers it.
    """

    _is_connecting: bool  # set by aetcd.Client.__init__ (declared for mypy)

    def __init__(self, *args: Any, tls: EtcdTLS, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tls = tls

    async def connect(self) -> None:
        try:
            await self._connect_secure()
        except rpc.AioRpcError as exc:
            hint = tls_failure_hint(exc.details() or "")
            if hint is not None:
                raise aetcd.ConnectionFailedError(
                    f"TLS to etcd at {self._host}:{self._port} failed: {hint} [{exc.details()}]"
                ) from exc
            aetcd_exceptions._handle_exception(exc)  # raises aetcd's typed error

    async def _connect_secure(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:  # another task is connecting: wait for it
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            self.channel = rpc.secure_channel(
                f"{self._host}:{self._port}",
                self._tls.credentials(),
                options=list(self._options.items()),
            )
            try:
                await self._handshake()
            except BaseException:
                channel, self.channel, self.auth_stub = self.channel, None, None
                await channel.close()
                raise
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = watcher.Watcher(
                rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
            )
            self._connected.set()
        finally:
            self._is_connecting = False

    async def _handshake(self) -> None:
        """One bounded RPC now, so a TLS failure surfaces here, where it can be
        explained, rather than as a bare "Unwrap failed" from whichever call came first:
        the auth request when credentials are set (as aetcd does), else a Status."""
        if self._username is not None and self._password is not None:
            self.auth_stub = rpc.AuthStub(self.channel)
            request = rpc.AuthenticateRequest(name=self._username, password=self._password)
            reply = await self.auth_stub.Authenticate(request, timeout=self._timeout)
            self.metadata = (("token", reply.token),)
        else:
            await rpc.MaintenanceStub(self.channel).Status(
                rpc.StatusRequest(), timeout=self._timeout
            )


def tls_failure_hint(details: str) -> str | None:
    """What a gRPC error detail means when it is a TLS failure; None when it is not.

    Measured with grpcio 1.85 and etcd 3.4: a server certificate that does not chain to
    the CA gives ``Tls handshake failed … CERTIFICATE_VERIFY_FAILED``; etcd refusing the
    client (no certificate, or one its ``--trusted-ca-file`` did not sign) gives
    ``Unwrap failed (TSI_DATA_CORRUPTED)`` (TLS 1.3 reports the refusal after the
    handshake)."""
    if "CERTIFICATE_VERIFY_FAILED" in details or "Tls handshake failed" in details:
        return (
            "etcd's certificate was not accepted (it must chain to etcd_ca_file and name "
            "the endpoint's host)"
        )
    if "Unwrap failed" in details or "TSI_DATA_CORRUPTED" in details:
        return (
            "etcd refused this client's certificate (with --client-cert-auth, set "
            "etcd_cert_file/etcd_key_file to a certificate signed by its --trusted-ca-file)"
        )
    if "Socket closed" in details or "handshake" in details.lower():
        return "the connection closed during the TLS handshake (is etcd serving TLS here?)"
    return None


#: What etcd 3.4/3.5 answer (INVALID_ARGUMENT) to a wrong user or password, and to a
#: request without credentials while auth is enabled. An expired token ("invalid auth
#: token") is not among them: a fresh client authenticates again.
_REFUSED_DETAILS = ("authentication failed", "user name is empty")


def refused_credentials(exc: BaseException) -> bool:
    """True when etcd answered that these credentials may not do this (permanent)."""
    cause = exc.__cause__
    denied = grpc.StatusCode.PERMISSION_DENIED
    if isinstance(cause, grpc.aio.AioRpcError) and cause.code() == denied:
        return True  # aetcd 1.0 maps PERMISSION_DENIED to a bare ClientError
    if isinstance(exc, aetcd.InvalidArgumentError):
        text = str(exc).lower()
        return any(detail in text for detail in _REFUSED_DETAILS)
    return False


def make_client(
    host: str,
    port: int,
    *,
    timeout: float,
    username: str | None = None,
    password: str | None = None,
    tls: EtcdTLS | None = None,
) -> aetcd.Client:
    """An unconnected client (it connects on first use) with duetime's gRPC options."""
    kwargs: dict[str, Any] = dict(
        host=host, port=port, username=username, password=password,
        timeout=timeout, options=dict(GRPC_OPTIONS),
    )  # fmt: skip
    if tls is None:
        return aetcd.Client(**kwargs)
    return TlsClient(tls=tls, **kwargs)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` (or ``http://host:port``, ``[::1]:2379``) to ``(host, port)``."""
    text = endpoint.strip().removeprefix("http://").removeprefix("https://").rstrip("/")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"etcd endpoint {endpoint!r} is not host:port")
    return host.strip("[]"), int(port)


class EtcdConnection:
    """One etcd client at a time over ``endpoints``, moving on after a failure."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        call_timeout: float,
        username: str | None = None,
        password: str | None = None,
        tls: EtcdTLS | None = None,
    ) -> None:
        if not endpoints:
            raise ConfigError("at least one etcd endpoint is required")
        self._endpoints = [parse_endpoint(e) for e in endpoints]
        self.call_timeout = call_timeout
        self.username = username
        self._password = password
        self._tls = tls  # None: plain gRPC
        self._client: aetcd.Client | None = None
        self._index = 0

    @property
    def endpoint(self) -> str:
        """The endpoint in use (or tried next), as ``host:port``."""
        return "{}:{}".format(*self._endpoints[self._index])

    def client(self) -> aetcd.Client:
        if self._client is None:
            host, port = self._endpoints[self._index]
            self._client = make_client(
                host, port, username=self.username, password=self._password,
                timeout=self.call_timeout, tls=self._tls,
            )  # fmt: skip
        return self._client

    async def call(
        self, op: Callable[[aetcd.Client], Awaitable[T]], timeout: float | None = None
    ) -> T:
        """Run one etcd call bounded by ``timeout`` (default: ``call_timeout``); on
        failure drop the client and move endpoints."""
        client = self.client()
        try:
            return await asyncio.wait_for(
                op(client), self.call_timeout if timeout is None else timeout
            )
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise
            # Not our cancellation: grpc ends a call this way when another task closed
            # the channel under it. Raised as is it would end the caller's task.
            raise aetcd.ClientError("etcd call ended: its connection was closed") from None
        except ETCD_ERRORS as exc:
            await self.discard(client, exc)
            raise

    async def discard(self, client: aetcd.Client, error: BaseException) -> None:
        """Drop ``client`` after ``error`` unless etcd merely answered "no"."""
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
    except Exception:  # a half-broken watcher must not keep the channel open
        if channel is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(channel.close(), _CLOSE_TIMEOUT)
