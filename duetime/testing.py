"""Test your handlers without a broker or a worker: ``from duetime.testing import run_task``.

``run_task`` calls a registered handler the way the worker would (same ``JobContext``,
same timeout) on a connection your test provides, typically inside a transaction it
rolls back; ``make_context`` builds that ``JobContext`` for a handler called directly.
``drain`` (sync tests) and ``drain_async`` run the due jobs of a test database through
the worker's own code path, without a broker or a scheduler (``workers.drain``).
Both are ``workers.testing``'s objects: like the rest of ``duetime``, this module holds
no code of its own, so it cannot drift from what the worker runs.
"""

from __future__ import annotations

from workers.testing import DrainReport, drain, drain_async, make_context, run_task

__all__ = ["DrainReport", "drain", "drain_async", "make_context", "run_task"]
