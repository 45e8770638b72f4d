"""Whether the broker takes messages now, asked by whoever publishes before each claim.

A claim that publishes (the dispatcher's, the reconciler's) locks rows and holds its
transaction open until the batch is confirmed. Claiming while RabbitMQ has blocked the
connection, or while a reconnect is under way, only holds those locks for a batch that
is bound to fail. So the claimer first asks the ``BrokerGate`` in front of its
publisher: 0 means go ahead; otherwise it sleeps the answer and asks again. The gate
reads the publisher's own back-pressure (``Publisher.throttle_delay``) and waits at
most ``ready_timeout`` for a reconnecting channel, backing off with jitter while it
stays down. It logs transitions (throttled, unthrottled, not ready), never every pause.

``PublisherAndGate`` is what a duty that publishes holds: a publisher and its gate, the
publisher either its own (named after the duty, so RabbitMQ's management view tells
the duties' connections apart; opened per term and closed with it) or one shared by
the caller (tests and benchmarks), which is opened if it is not yet and which the
caller closes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scheduler.backoff import bounded_jitter
from scheduler.clock import SYSTEM_CLOCK, Clock
from scheduler.config import Settings
from scheduler.publisher import Publisher

__all__ = ["BrokerGate", "GateConfig", "PublisherAndGate"]


@dataclass(frozen=True, slots=True)
class GateConfig:
    """How long a pass waits for a reconnecting broker, and the back-off after it."""

    ready_timeout: float
    base: float
    cap: float


class BrokerGate:
    """Whether the broker takes messages now (module docstring).

    ``delay()`` is 0 when it does; otherwise the seconds to wait: the publisher's
    back-pressure delay (RabbitMQ blocked the connection, or confirms pile up), or a
    jittered back-off while the connection is not ready within ``ready_timeout``.
    ``log`` returns the caller's current logger (re-bound at every leadership term).
    """

    def __init__(self, publisher: Publisher, log: Callable[[], Any], config: GateConfig) -> None:
        self._publisher = publisher
        self._log = log
        self._config = config
        self.throttled = False
        self.not_ready = 0  # consecutive passes the broker was not ready

    async def delay(self) -> float:
        publisher = self._publisher
        throttle = publisher.throttle_delay()
        if throttle > 0:
            if not self.throttled:
                self._log().warning(
                    "dispatch_throttled",
                    blocked=publisher.blocked,
                    pressure=round(publisher.pressure, 3),
                    delay=round(throttle, 3),
                )
            self.throttled = True
            return throttle
        if self.throttled:
            self.throttled = False
            self._log().info("dispatch_unthrottled", pressure=round(publisher.pressure, 3))
        if not await publisher.wait_ready(self._config.ready_timeout):
            self.not_ready += 1
            delay = bounded_jitter(self.not_ready, base=self._config.base, cap=self._config.cap)
            self._log().warning(
                "broker_not_ready", failures=self.not_ready, retry_in=round(delay, 3)
            )
            return delay
        self.not_ready = 0
        return 0.0


class PublisherAndGate:
    """A publisher and the ``BrokerGate`` in front of it (module docstring).

    With ``publisher=None`` it builds its own from ``settings`` (named
    ``duetime-<name>``, timed by ``clock``), which ``open()``/``close()`` open and
    close; a given publisher is opened if it is not yet (``Publisher.open`` is
    idempotent), never closed here.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        name: str,
        shard: str,
        publish_timeout: float,
        gate: GateConfig,
        log: Callable[[], Any],
        publisher: Publisher | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.owned = publisher is None
        self.publisher = publisher or Publisher.from_settings(
            settings,
            name=f"duetime-{name}",
            publish_timeout=publish_timeout,
            shard=shard,
            clock=clock,
        )
        self.gate = BrokerGate(self.publisher, log, gate)

    async def open(self) -> None:
        await self.publisher.open()

    async def close(self) -> None:
        if self.owned:
            await self.publisher.close()
