"""A TCP fault proxy: put it between a client and a service, then break the wire.

``FaultProxy(host, port)`` listens on ``127.0.0.1:<free port>`` and forwards every
connection to the target. Faults, switchable at any time:

- ``cut()``: close every current connection both ways at once (a crashed router, a
  restarted load balancer): clients see a reset and reconnect.
- ``refuse(True)``: new connections are accepted and closed at once (a service down).
- ``blackhole(True)``: bytes are accepted but nothing is delivered either way (a network
  partition): clients see nothing fail, only time out. Bytes sent meanwhile are held,
  and delivered in order when the blackhole ends, as TCP retransmission would.
- ``set_latency(s)``: every chunk is delivered ``s`` seconds after it was read.

Every connection and pump task is owned by the proxy and cancelled by ``stop()``;
unexpected errors in a pump are logged, never lost in an unretrieved task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from types import TracebackType
from urllib.parse import urlsplit, urlunsplit

log = logging.getLogger(__name__)

_CHUNK = 64 * 1024


class _Connection:
    """One proxied connection: two directions, each a reader and a writer task."""

    def __init__(
        self,
        proxy: FaultProxy,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        peer: object,
    ) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream = upstream
        self.peer = peer
        self.tasks: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        for name, (src, dst) in {
            "up": (self.client[0], self.upstream[1]),
            "down": (self.upstream[0], self.client[1]),
        }.items():
            queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
            self.tasks.add(asyncio.create_task(self._read(src, queue), name=f"proxy-read-{name}"))
            self.tasks.add(asyncio.create_task(self._write(queue, dst), name=f"proxy-write-{name}"))
        pending = set(self.tasks)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                if any(not t.cancelled() and t.exception() is not None for t in done):
                    break
        finally:
            for task in self.tasks:
                task.cancel()
            results = await asyncio.gather(*self.tasks, return_exceptions=True)
            for result in results:
                if isinstance(result, (ConnectionError, OSError)):
                    log.debug("proxy connection %s ended: %r", self.peer, result)
                elif isinstance(result, Exception):
                    log.error("proxy pump failed for %s", self.peer, exc_info=result)

    async def _read(
        self, src: asyncio.StreamReader, queue: asyncio.Queue[tuple[float, bytes] | None]
    ) -> None:
        loop = asyncio.get_running_loop()
        while data := await src.read(_CHUNK):
            queue.put_nowait((loop.time(), data))
        queue.put_nowait(None)  # EOF

    async def _write(
        self, queue: asyncio.Queue[tuple[float, bytes] | None], dst: asyncio.StreamWriter
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            item = await queue.get()
            await self.proxy._flowing.wait()  # blackholed: hold everything
            if item is None:
                if dst.can_write_eof():
                    dst.write_eof()
                return
            read_at, data = item
            delay = read_at + self.proxy.latency - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
                await self.proxy._flowing.wait()  # the blackhole may have begun meanwhile
            dst.write(data)
            await dst.drain()

    def abort(self) -> None:
        """Drop both sockets now (RST where the OS allows), and stop the pumps."""
        for _, writer in (self.client, self.upstream):
            writer.transport.abort()
        for task in self.tasks:
            task.cancel()


class FaultProxy:
    """Forward ``127.0.0.1:<port>`` to ``target_host:target_port``, with faults on demand."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        connect_timeout: float = 5.0,
    ) -> None:
        self.target_host = target_host
        self.target_port = int(target_port)
        self.listen_host = listen_host
        self.port = listen_port
        self.connect_timeout = connect_timeout
        self.latency = 0.0
        self.accepted = 0
        self._refusing = False
        self._stopping = False
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[object]] = set()
        self._connections: set[_Connection] = set()

    @classmethod
    def for_endpoint(cls, endpoint: str, **kwargs: object) -> FaultProxy:
        """A proxy in front of ``"host:port"``."""
        host, _, port = endpoint.rpartition(":")
        return cls(host, int(port), **kwargs)  # type: ignore[arg-type]

    def route(self, url: str) -> str:
        """``url`` (postgresql://, amqp://) with its host:port replaced by the proxy's;
        user, password, path and query kept."""
        parts = urlsplit(url)
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = f"{userinfo}@{self.endpoint}" if userinfo else self.endpoint
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))

    @property
    def endpoint(self) -> str:
        """``host:port`` clients should connect to."""
        return f"{self.listen_host}:{self.port}"

    @property
    def connections(self) -> int:
        """Connections currently forwarded."""
        return len(self._connections)

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> FaultProxy:
        if self._server is not None:
            return self
        self._refusing = self._stopping = False  # a restart listens again on the same port
        self._server = await asyncio.start_server(self._handle, self.listen_host, self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def stop(self) -> None:
        """Stop listening, drop every connection, and wait for every task to end."""
        server, self._server = self._server, None
        self._refusing = self._stopping = True
        if server is not None:
            server.close()
        self.cut()
        self._flowing.set()  # release writers parked by a blackhole so they can be cancelled
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        if server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 5)

    async def __aenter__(self) -> FaultProxy:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # -- faults ----------------------------------------------------------------------

    def cut(self) -> int:
        """Close every current connection both ways; return how many were cut."""
        connections = list(self._connections)
        for conn in connections:
            conn.abort()
        return len(connections)

    def refuse(self, refusing: bool = True) -> None:
        """While true, new connections are closed as soon as they are accepted."""
        self._refusing = refusing

    def blackhole(self, on: bool = True) -> None:
        """While true, accept and hold bytes but deliver nothing, in either direction."""
        if on:
            self._flowing.clear()
        else:
            self._flowing.set()

    def set_latency(self, seconds: float) -> None:
        """Deliver every chunk ``seconds`` after it was read (each direction)."""
        if seconds < 0:
            raise ValueError("latency must be >= 0")
        self.latency = seconds

    def heal(self) -> None:
        """Undo refuse, blackhole and latency (current connections are kept)."""
        self._refusing = False
        self._flowing.set()
        self.latency = 0.0

    # -- connections -------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        peer = writer.get_extra_info("peername")
        conn: _Connection | None = None
        try:
            self.accepted += 1
            if self._refusing:
                writer.transport.abort()
                return
            try:
                upstream = await asyncio.wait_for(
                    asyncio.open_connection(self.target_host, self.target_port),
                    self.connect_timeout,
                )
            except (OSError, TimeoutError) as exc:
                log.info("proxy cannot reach %s:%s: %r", self.target_host, self.target_port, exc)
                writer.transport.abort()
                return
            conn = _Connection(self, (reader, writer), upstream, peer)
            self._connections.add(conn)
            await conn.run()
        except asyncio.CancelledError:
            if not self._stopping:
                raise
            # Cancelled by stop(): end normally. On Python 3.11 a cancelled stream
            # handler task makes asyncio log a spurious "Exception in callback".
        except Exception:
            log.exception("proxy connection handler failed for %s", peer)
        finally:
            if conn is not None:
                self._connections.discard(conn)
                conn.abort()
            else:
                writer.transport.abort()
            if task is not None:
                self._handlers.discard(task)
