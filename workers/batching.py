"""Coalescing: many concurrent callers, one statement.

A worker's deliveries arrive in bursts (prefetch hands it up to ``concurrency`` messages
at once) and finish in bursts. Sending one statement per delivery made the worker spend
a third of its time in socket writes (py-spy, docs/benchmarks.md); a ``Coalescer`` turns
the calls that arrive while a flush is in progress, or in the same event-loop turn, into
one call of ``flush(items)`` — the pattern of River's batch completer and of
graphile-worker's batched ``complete_jobs``.

- ``submit(item)`` waits for the result of its item; a flush that raises fails every
  caller of that batch with the same exception.
- At most ``max_batch`` items per flush and ``max_flushes`` flushes in flight: one slow
  batch (a lock wait) does not hold up the next one.
- No timer: a lone item is flushed on the next loop turn, so an idle worker pays no
  latency for batching; under load batches grow by themselves while flushes are busy.
- The flush tasks are owned: ``close()`` cancels them and fails waiting callers.
- ``ordered=True``: callers are answered in the order they submitted, whichever of two
  flushes in flight returns first (a later batch waits for the earlier one's answers).
  The worker's begin read needs it: deliveries take their handler slots in the order
  they wake up, and that must be the order they arrived in (a job in a worker's
  prefetch is not overtaken, docs/api.md "Priorities").
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Coalescer(Generic[T, R]):
    def __init__(
        self,
        flush: Callable[[list[T]], Awaitable[Sequence[R]]],
        *,
        name: str,
        max_batch: int = 256,
        max_flushes: int = 2,
        ordered: bool = False,
    ) -> None:
        if max_batch < 1 or max_flushes < 1:
            raise ValueError("max_batch and max_flushes must be >= 1")
        self._flush = flush
        self._ordered = ordered
        self._answered: asyncio.Future[None] | None = None  # the last batch's answers
        self._name = name
        self._max_batch = max_batch
        self._max_flushes = max_flushes
        self._waiting: list[tuple[T, asyncio.Future[R]]] = []
        self._flushes: set[asyncio.Task[None]] = set()
        self._closed = False
        self.batches = 0  # flushes done (for tests and metrics)
        self.items = 0

    async def submit(self, item: T) -> R:
        if self._closed:
            raise RuntimeError(f"{self._name}: closed")
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._waiting.append((item, future))
        self._kick()
        return await future

    def _kick(self) -> None:
        if self._waiting and len(self._flushes) < self._max_flushes:
            # outside the submitting delivery's context: a batch is no one delivery's
            task = asyncio.create_task(
                self._run(), name=f"{self._name}:flush", context=contextvars.Context()
            )
            self._flushes.add(task)
            task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._flushes.discard(task)
        if not self._closed:
            self._kick()

    async def _run(self) -> None:
        await asyncio.sleep(0)  # let the callers of this loop turn join the batch
        batch, self._waiting = (
            self._waiting[: self._max_batch],
            self._waiting[self._max_batch :],
        )
        batch = [(item, fut) for item, fut in batch if not fut.done()]
        if not batch:
            return
        previous, answered = self._answered, None
        if self._ordered:
            answered = self._answered = asyncio.get_running_loop().create_future()
        try:
            await self._answer(batch, previous)
        finally:
            if answered is not None:  # after this batch's callers were answered
                answered.set_result(None)

    async def _answer(
        self, batch: list[tuple[T, asyncio.Future[R]]], previous: asyncio.Future[None] | None
    ) -> None:
        """Flush ``batch`` and answer its callers, after ``previous`` (the batch before,
        when ordered) answered its own."""
        try:
            try:
                results = await self._flush([item for item, _ in batch])
            finally:
                if previous is not None:
                    await asyncio.wait([previous])
        except BaseException as exc:
            for _, fut in batch:
                if not fut.done():
                    if isinstance(exc, asyncio.CancelledError):
                        fut.cancel()
                    else:
                        fut.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        self.batches += 1
        self.items += len(batch)
        for (_, fut), result in zip(batch, results, strict=True):
            if not fut.done():
                fut.set_result(result)

    async def close(self) -> None:
        """Cancel flushes in flight and fail waiting callers; safe twice."""
        self._closed = True
        for _, fut in self._waiting:
            if not fut.done():
                fut.cancel()
        self._waiting = []
        tasks = list(self._flushes)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
