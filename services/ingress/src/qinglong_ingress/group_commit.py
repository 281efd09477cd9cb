"""Group commit: concurrent calls' rows written by one statement, one commit (R-PERF-1).

Each call hands its item to :meth:`GroupCommit.submit` and waits for its own result. A
writer takes every waiting item (at most ``max_batch``) and writes them with one call of
``flush`` — for ingress's audit, one statement in one autocommit transaction — so each
caller learns its row is durable when that commit is. At most ``writers`` batches are in
flight at a time: while they are, new items wait and form the next batch.

A batch closes when a writer is free or when it holds ``max_batch`` items, never on a
timer: an idle service writes a lone call's row at once (no added latency), and under
load the batches grow by themselves, as long as a commit takes.

A failed batch fails exactly its own callers. When one of several items may be the
cause (an error that is not the connection's), each item is written again alone, so
one bad row cannot fail the calls that happened to share its batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")

#: Rows per statement: enough for a burst of every concurrent call, small enough that a
#: batch's statement stays a few milliseconds at most.
DEFAULT_MAX_BATCH = 128
#: Batches in flight at a time: two, so a call that arrives while one commits need not
#: wait for that commit before its own starts.
DEFAULT_WRITERS = 2


@dataclass
class _Waiting(Generic[Item, Result]):
    item: Item
    answer: asyncio.Future[Result]


class GroupCommit(Generic[Item, Result]):
    def __init__(
        self,
        flush: Callable[[Sequence[Item]], Awaitable[Sequence[Result]]],
        *,
        isolate: Callable[[BaseException], bool],
        max_batch: int = DEFAULT_MAX_BATCH,
        writers: int = DEFAULT_WRITERS,
    ) -> None:
        """``flush`` writes a batch and returns one result per item, in order.
        ``isolate(error)``: whether a batch that failed with ``error`` is written again
        item by item (True for an error a single row can cause)."""
        if max_batch < 1 or writers < 1:
            raise ValueError("max_batch and writers must be at least 1")
        self._flush = flush
        self._isolate = isolate
        self._max_batch = max_batch
        self._writers = writers
        self._active = 0
        self._writing = 0
        self._waiting: list[_Waiting[Item, Result]] = []
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def waiting(self) -> int:
        """Items waiting for a writer (a measure of how far the database is behind)."""
        return len(self._waiting)

    @property
    def unwritten(self) -> int:
        """Items submitted and not written yet: waiting, or in a writer's batch."""
        return len(self._waiting) + self._writing

    async def submit(self, item: Item) -> Result:
        """Write ``item`` with whichever batch takes it; its result once that is durable.
        A caller that gives up (cancellation) before its batch is taken is left out."""
        loop = asyncio.get_running_loop()
        waiting = _Waiting[Item, Result](item, loop.create_future())
        self._waiting.append(waiting)
        if self._active < self._writers:
            self._active += 1
            task = loop.create_task(self._write_while_waiting())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await waiting.answer

    async def _write_while_waiting(self) -> None:
        try:
            while self._waiting:
                batch = self._take()
                if batch:
                    self._writing += len(batch)
                    try:
                        await self._write(batch)
                    finally:
                        self._writing -= len(batch)
        finally:
            self._active -= 1

    def _take(self) -> list[_Waiting[Item, Result]]:
        taken, self._waiting = (
            self._waiting[: self._max_batch],
            self._waiting[self._max_batch :],
        )
        return [w for w in taken if not w.answer.done()]

    async def _write(self, batch: list[_Waiting[Item, Result]]) -> None:
        try:
            await self._settle(batch)
        except BaseException:  # the service is stopping: every caller still waiting is told
            for waiting in batch:
                if not waiting.answer.done():
                    waiting.answer.cancel()
            raise

    async def _settle(self, batch: list[_Waiting[Item, Result]]) -> None:
        try:
            results = await self._flush([w.item for w in batch])
            if len(results) != len(batch):
                raise AssertionError("flush must return one result per item")
        except Exception as error:
            if len(batch) > 1 and self._isolate(error):
                for waiting in batch:
                    if not waiting.answer.done():  # a caller that gave up is left out
                        await self._settle([waiting])
                return
            for waiting in batch:
                if not waiting.answer.done():
                    waiting.answer.set_exception(error)
            return
        for waiting, result in zip(batch, results, strict=True):
            if not waiting.answer.done():
                waiting.answer.set_result(result)
