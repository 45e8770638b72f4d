"""OpenTelemetry, when the application uses it: the enqueuing code's trace context is
stored with each job, each attempt runs in a span of its own, and the dispatcher's
publish is a span (DESIGN §13; docs/api.md "Tracing").

**The one seam.** duetime never imports ``opentelemetry``: this module uses the
``opentelemetry.trace`` module only when the process has imported it already, which an
application that configured a tracer provider has (``duetime[otel]`` installs the API
and the SDK; ``opentelemetry-instrument`` or the application's own setup imports them).
Without it, ``current_traceparent`` is one dictionary lookup and ``tracer()`` two, and
nothing is stored or created. No other module of duetime names ``opentelemetry``.

**Producer.** ``current_traceparent()`` is the W3C ``traceparent`` of the active span
(version 00), or None without a valid one; ``plan_enqueue`` and the bulk COPY write it
into ``jobs.traceparent`` (migration 0023) in the statement that inserts the job, so
every producer API (``JobStore``, ``duetime.enqueue`` on psycopg, SQLAlchemy and Django,
``enqueue_async``, ``bulk_enqueue``) carries it without a statement more. ``tracestate``
and baggage are not carried: the column holds one bounded value a CHECK can validate.

**Worker.** The attempt's span (``attempt_span``: kind CONSUMER, named ``process
<queue>``) reads the context from the row the worker locks at begin, never from the
message. Child or link: a job that was due when it was enqueued (due within
``DUE_LATER`` of its insertion) runs as a *child* of the enqueuing span, so a request
and the work it started are one trace; its retries stay children (the same unit of
work, with ``duetime.job.attempt`` telling them apart). A job due later (``delay=``, a
``due_at`` in the future) starts a *new trace linked* to the enqueuing span: the
enqueuing trace ended long before, and a child hours later would stretch that trace
over hours, break its duration and tail sampling, and arrive after backends closed it.
Handlers' own spans are children of the attempt's span (plain ``def`` handlers too:
their thread runs in the delivery's context).

**Dispatcher.** ``publish_span`` covers one batch published with its confirms (kind
PRODUCER, ``send``, ``messaging.batch.message_count``).

Attributes follow OpenTelemetry's messaging conventions (``messaging.system`` =
``rabbitmq``, ``messaging.operation.type``, ``messaging.operation.name``,
``messaging.destination.name`` = the broker queue, ``messaging.message.id``), plus
``duetime.job.id``, ``duetime.job.attempt``, ``duetime.task`` and ``duetime.outcome``.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any

__all__ = [
    "DUE_LATER",
    "TRACEPARENT",
    "AttemptSpan",
    "attempt_span",
    "current_traceparent",
    "publish_span",
    "tracer",
]

#: A job due more than this after its insertion runs in a trace of its own, linked.
DUE_LATER = timedelta(seconds=1)
#: W3C traceparent, version 00: what CHECK jobs_traceparent_invalid accepts.
TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
SYSTEM = "rabbitmq"
_API = "opentelemetry.trace"
#: The tracer of the provider it came from (the provider may be set after the import).
_cache: tuple[Any, Any] | None = None


def current_traceparent() -> str | None:
    """The active span's context as a W3C ``traceparent``; None when OpenTelemetry is
    not in use or no valid span is active."""
    api = sys.modules.get(_API)
    if api is None:
        return None
    context = api.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def tracer() -> Any | None:
    """duetime's tracer from the provider the application set; None when OpenTelemetry
    is not imported or no provider is set (the API's proxy or no-op provider)."""
    global _cache
    api = sys.modules.get(_API)
    if api is None:
        return None
    provider = api.get_tracer_provider()
    if isinstance(provider, (api.ProxyTracerProvider, api.NoOpTracerProvider)):
        return None
    if _cache is None or _cache[0] is not provider:
        _cache = (provider, provider.get_tracer("duetime"))
    return _cache[1]


def _remote(api: Any, traceparent: str | None) -> Any | None:
    """The ``SpanContext`` a stored ``traceparent`` names, or None."""
    match = TRACEPARENT.match(traceparent or "")
    if match is None:
        return None
    trace_id, span_id, flags = (int(group, 16) for group in match.groups())
    context = api.SpanContext(trace_id, span_id, is_remote=True, trace_flags=api.TraceFlags(flags))
    return context if context.is_valid else None


class AttemptSpan:
    """One attempt's span, current while the attempt runs; ``failed`` records the
    handler's exception, ``outcome`` what the delivery ended as."""

    __slots__ = ("_scope", "span")

    def __init__(self, span: Any, scope: Any) -> None:
        self.span = span
        self._scope = scope

    def __enter__(self) -> AttemptSpan:
        self._scope.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._scope.__exit__(*exc)

    def failed(self, error: BaseException) -> None:
        api = sys.modules[_API]
        self.span.record_exception(error)
        self.span.set_attribute("error.type", type(error).__qualname__)
        self.span.set_status(api.Status(api.StatusCode.ERROR, str(error)[:200]))

    def outcome(self, outcome: str) -> None:
        self.span.set_attribute("duetime.outcome", outcome)


def attempt_span(
    *,
    job_id: int,
    attempt: int,
    task: str,
    destination: str,
    message_id: str,
    traceparent: str | None,
    due_at: datetime,
    enqueued_at: datetime | None,
) -> AttemptSpan | None:
    """The span of one attempt (module docstring: child or link), or None without a
    tracer."""
    source = tracer()
    if source is None:
        return None
    api = sys.modules[_API]
    remote = _remote(api, traceparent)
    later = enqueued_at is not None and due_at - enqueued_at > DUE_LATER
    links = [api.Link(remote)] if remote is not None and later else None
    if remote is not None and not later:
        parent = api.set_span_in_context(api.NonRecordingSpan(remote))
    else:
        parent = api.set_span_in_context(api.INVALID_SPAN)  # a root: no ambient parent
    span = source.start_span(
        f"process {destination}",
        context=parent,
        kind=api.SpanKind.CONSUMER,
        links=links,
        attributes={
            "messaging.system": SYSTEM,
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": destination,
            "messaging.message.id": message_id,
            "duetime.job.id": job_id,
            "duetime.job.attempt": attempt,
            "duetime.task": task,
        },
    )
    return AttemptSpan(span, api.use_span(span, end_on_exit=True))


@contextmanager
def publish_span(destinations: list[str], count: int) -> Iterator[None]:
    """The span of one published batch (``count`` messages to ``destinations``, the
    broker queues); nothing without a tracer."""
    source = tracer()
    if source is None:
        yield
        return
    api = sys.modules[_API]
    name = destinations[0] if len(destinations) == 1 else "jobs"
    attributes: dict[str, Any] = {
        "messaging.system": SYSTEM,
        "messaging.operation.type": "send",
        "messaging.operation.name": "publish",
        "messaging.batch.message_count": count,
    }
    if len(destinations) == 1:
        attributes["messaging.destination.name"] = name
    with source.start_as_current_span(
        f"publish {name}", kind=api.SpanKind.PRODUCER, attributes=attributes
    ):
        yield
