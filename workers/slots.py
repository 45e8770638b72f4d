"""HandlerSlot: one delivery's share of the worker's ``--concurrency``.

``--concurrency N`` bounds the handlers *running* at once, not the deliveries in the
worker. A delivery takes a slot after its begin read, just before its handler starts,
and gives it back as soon as its handler returned: its outcome is then settled with
others (a batched completion, or the handler's own transaction committing) while the
slot already runs the next handler. The message is still acked only after the outcome
committed, so prefetch (``workers.consumer.prefetch_for``) covers running, settling,
begun and waiting deliveries.

Why the slot is taken after the begin read, not before: a slot held through the begin
round trip made each of N slots turn over once per begin + hand-off, which bounded a
short handler at ``--concurrency 10`` to about half of what 64 reached, whatever the
prefetch (docs/benchmarks.md, "A slot is a running handler, from the begin on"). What
the begin read decided stays true while the delivery waits for its slot: the guard
lock it took keeps any other copy from running the attempt; the delivery heartbeats
while it waits (``Executor._take_slot``); and a cancel heard meanwhile is kept until it
gets the slot, so the handler never starts (``workers.cancel``).

An attempt that must run again (its transaction group rolled back, ``Verdict.RERUN``)
takes a slot again first, so at most N handlers ever run at once. A delivery that runs
no handler (its key already in the ledger, its task unknown, cancelled while it waited)
never holds one while it settles.

What freeing early must not change (tests/integration/test_slot_free.py):

- **Duplicates stay duplicates.** The next delivery's ``begin`` can now run before the
  previous outcome committed. A delivery whose ledger key another attempt in this
  executor holds waits for that one's commit (slot given back meanwhile) and reads the
  ledger again (``Executor._wait_for_key``); a failure that lost to a holder of its key
  elsewhere is settled as a duplicate (``Settler.settle``). The first try of this change
  was reverted for running such a duplicate into a failed attempt.
- **Acked only after commit**, as before (``workers.consumer``).
- **Open transactions are bounded.** A ``ctx.db`` handler's transaction stays open until
  its outcome committed, so up to N running + the settling ones are open at once; the
  handler pool's size (``workers.shards.settling_headroom``) bounds them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["HandlerSlot"]


class HandlerSlot:
    """A hold on one of ``semaphore``'s permits that can be given back early and taken
    again; ``changed(+1 | -1)`` is told each time (the consumer's ``active`` count)."""

    __slots__ = ("_changed", "_semaphore", "held")

    def __init__(self, semaphore: asyncio.Semaphore, changed: Callable[[int], None]) -> None:
        self._semaphore = semaphore
        self._changed = changed
        self.held = False

    async def acquire(self) -> None:
        """Take a permit (waits while N handlers run); a no-op while one is held."""
        if self.held:
            return
        await self._semaphore.acquire()
        self.held = True
        self._changed(1)

    def free(self) -> bool:
        """Whether ``acquire`` would take a permit at once (no handler slot to wait for)."""
        return self.held or not self._semaphore.locked()

    def release(self) -> None:
        """Give the permit back; a no-op when none is held (so the owner may call it
        again on the way out)."""
        if not self.held:
            return
        self.held = False
        self._semaphore.release()
        self._changed(-1)
