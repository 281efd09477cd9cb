"""Group commit's mechanics, with a stand-in writer: how batches form, and that a failed
batch fails exactly its own callers. The real statement and its commit are proven on
PostgreSQL in tests/contract/test_round_trips.py and tests/integration/test_error_model.py."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from qinglong_ingress.group_commit import GroupCommit


class BadRow(Exception):
    """Something one row can cause (like a CHECK violation)."""


class Outage(Exception):
    """Something that fails a whole batch (like a lost connection)."""


class Writer:
    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.release = asyncio.Event()
        self.fail_with: type[Exception] | None = None

    async def flush(self, items: Sequence[int]) -> list[int]:
        self.batches.append(list(items))
        await self.release.wait()
        if self.fail_with is Outage:
            raise Outage()
        if self.fail_with is BadRow and 13 in items:
            raise BadRow()
        return [item * 10 for item in items]


def group(writer: Writer, **options: int) -> GroupCommit[int, int]:
    return GroupCommit(writer.flush, isolate=lambda e: isinstance(e, BadRow), **options)


async def test_a_lone_call_is_written_at_once_and_gets_its_own_result() -> None:
    writer = Writer()
    writer.release.set()
    assert await group(writer).submit(4) == 40
    assert writer.batches == [[4]]


async def test_calls_that_wait_for_busy_writers_form_the_next_batch() -> None:
    writer = Writer()
    commit = group(writer, writers=1, max_batch=5)
    first = asyncio.ensure_future(commit.submit(0))
    await asyncio.sleep(0)
    waiting = [asyncio.ensure_future(commit.submit(i)) for i in range(1, 8)]
    await asyncio.sleep(0)
    # One in the writer's batch, seven waiting for it: eight not yet written.
    assert (commit.waiting, commit.unwritten) == (7, 8)
    writer.release.set()
    assert await first == 0
    assert [await w for w in waiting] == [i * 10 for i in range(1, 8)]
    # The first call alone; the seven that waited in batches of at most five.
    assert writer.batches == [[0], [1, 2, 3, 4, 5], [6, 7]]
    assert (commit.waiting, commit.unwritten) == (0, 0)


async def test_a_batch_that_fails_fails_exactly_its_callers() -> None:
    writer = Writer()
    commit = group(writer, writers=1)
    first = asyncio.ensure_future(commit.submit(1))
    await asyncio.sleep(0)
    second = [asyncio.ensure_future(commit.submit(i)) for i in (2, 3)]
    await asyncio.sleep(0)
    writer.fail_with = Outage
    writer.release.set()
    results = await asyncio.gather(first, *second, return_exceptions=True)
    assert all(isinstance(r, Outage) for r in results)
    writer.fail_with = None
    assert await commit.submit(4) == 40, "the next batch is written as usual"


async def test_one_bad_row_does_not_fail_the_calls_it_shared_a_batch_with() -> None:
    writer = Writer()
    commit = group(writer, writers=1)
    first = asyncio.ensure_future(commit.submit(1))
    await asyncio.sleep(0)
    shared = [asyncio.ensure_future(commit.submit(i)) for i in (12, 13, 14)]
    await asyncio.sleep(0)
    writer.fail_with = BadRow
    writer.release.set()
    assert await first == 10
    results = await asyncio.gather(*shared, return_exceptions=True)
    assert (results[0], results[2]) == (120, 140)
    assert isinstance(results[1], BadRow)
    assert writer.batches[-3:] == [[12], [13], [14]], "written again one by one"


async def test_a_caller_that_gave_up_before_its_batch_is_left_out() -> None:
    writer = Writer()
    commit = group(writer, writers=1)
    first = asyncio.ensure_future(commit.submit(1))
    await asyncio.sleep(0)
    gone = asyncio.ensure_future(commit.submit(2))
    kept = asyncio.ensure_future(commit.submit(3))
    await asyncio.sleep(0)
    gone.cancel()
    writer.release.set()
    assert (await first, await kept) == (10, 30)
    assert writer.batches == [[1], [3]]


def test_the_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        group(Writer(), max_batch=0)


class StuckOnSingles(Writer):
    """Fails any batch holding 13; then each row written alone hangs (a stuck database)."""

    def __init__(self) -> None:
        super().__init__()
        self.single_started = asyncio.Event()

    async def flush(self, items: Sequence[int]) -> list[int]:
        if len(items) == 1 and items[0] != 1:
            self.single_started.set()
            await asyncio.Event().wait()  # never answers
        return await super().flush(items)


async def test_a_writer_stopped_while_isolating_rows_leaves_no_caller_waiting() -> None:
    writer = StuckOnSingles()
    commit = group(writer, writers=1)
    first = asyncio.ensure_future(commit.submit(1))
    await asyncio.sleep(0)
    shared = [asyncio.ensure_future(commit.submit(i)) for i in (12, 13, 14)]
    await asyncio.sleep(0)
    writer.fail_with = BadRow
    writer.release.set()
    assert await first == 10
    await asyncio.wait_for(writer.single_started.wait(), 10)  # isolating, row 12 hangs
    for task in list(commit._tasks):  # the service stops
        task.cancel()
    results = await asyncio.wait_for(asyncio.gather(*shared, return_exceptions=True), 10)
    assert all(isinstance(r, asyncio.CancelledError) for r in results), results
