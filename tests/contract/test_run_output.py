"""Run output in PostgreSQL (R-OPS-1, migration 0010), asserting on rows: appends are
idempotent by offset, refuse gaps, conflicting bytes and other Workers' Attempts without
writing anything, keep at most the size bound per Attempt, and expire by age in bounded
steps that always progress."""

from __future__ import annotations

import asyncio
import itertools
import secrets
from dataclasses import replace
from typing import Any

import psycopg
import pytest
from qinglong_control.db.lease_control import complete_attempt, control_lease
from qinglong_control.db.output import append_output, expire_output, read_output
from qinglong_control.db.start_facts import acknowledge_running, acknowledge_starting
from qinglong_control.domain.capability import digest_of_capability, parse_digest
from qinglong_control.domain.completion import CompletionReport
from qinglong_control.domain.output import OutputRetention
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.domain.start_facts import RunningReport
from qinglong_protocol import bounds
from qinglong_protocol.bounds import encode_lease_capability
from qinglong_protocol.errors import EXPECTED_OFFSET

from tests.support.locks import until_waiting
from tests.support.postgres import MigratedDatabase
from tests.support.world import PROJECT, ClaimedWork, World

KEEP_ALL = OutputRetention()
CHUNK = bounds.OUTPUT_CHUNK_MAX_BYTES


async def running(world: World, worker_id: str = "worker-a") -> ClaimedWork:
    work = await world.claimed(worker_id)
    await acknowledge_starting(world.conn, work.fence)
    report = RunningReport(
        "pid:1;start:2", f"attempts/{work.fence.attempt_id}/output", 1, parse_digest("ab" * 32)
    )
    await acknowledge_running(world.conn, work.fence, report)
    return work


async def stored(world: World, work: ClaimedWork) -> tuple[Any, list[tuple[int, int]]]:
    """The stream row (end, first) and the chunks' ranges, as the database holds them."""
    cursor = await world.conn.execute(
        "SELECT end_offset, first_offset FROM qinglong.attempt_output WHERE attempt_id = %s",
        (work.fence.attempt_id,),
    )
    stream = await cursor.fetchone()
    cursor = await world.conn.execute(
        "SELECT start_offset, end_offset FROM qinglong.attempt_output_chunks"
        " WHERE attempt_id = %s ORDER BY start_offset",
        (work.fence.attempt_id,),
    )
    return stream, [tuple(row) for row in await cursor.fetchall()]


async def whole_output(world: World, work: ClaimedWork) -> bytes:
    page = await read_output(world.conn, PROJECT, work.fence.run_id, None, 0, 1 << 20)
    return page.data


HOUR_MS = 3_600_000


async def written_long_ago(world: World, *works: ClaimedWork, hours: int = 1) -> None:
    """As if the streams were last written ``hours`` ago (the sweep reads DB time)."""
    for work in works:
        await world.conn.execute(
            "UPDATE qinglong.attempt_output SET updated_at_ms = updated_at_ms - %s"
            " WHERE attempt_id = %s",
            (hours * HOUR_MS, work.fence.attempt_id),
        )


async def refused(coroutine: Any) -> Refused:
    with pytest.raises(Refused) as caught:
        await coroutine
    return caught.value


async def test_appends_are_idempotent_by_offset(world: World) -> None:
    work = await running(world)
    conn, fence = world.conn, work.fence
    first = await append_output(conn, fence, 0, b"hello ", KEEP_ALL)
    assert (first.end_offset, first.replayed) == (6, False)
    assert (await append_output(conn, fence, 6, b"world\n", KEEP_ALL)).end_offset == 12
    before = await stored(world, work)
    # The exact chunk again (its answer was lost): answered, nothing written.
    again = await append_output(conn, fence, 6, b"world\n", KEEP_ALL)
    assert (again.end_offset, again.replayed) == (12, True)
    # A chunk that lies inside what is stored, with the same bytes: also a replay.
    inside = await append_output(conn, fence, 2, b"llo wo", KEEP_ALL)
    assert (inside.end_offset, inside.replayed) == (12, True)
    assert await stored(world, work) == before
    # A chunk that overlaps the end with the same bytes: only its new tail is stored.
    overlap = await append_output(conn, fence, 9, b"ld\nbye\n", KEEP_ALL)
    assert (overlap.end_offset, overlap.replayed) == (16, False)
    assert await stored(world, work) == ((16, 0), [(0, 6), (6, 12), (12, 16)])
    assert await whole_output(world, work) == b"hello world\nbye\n"


async def test_a_gap_or_different_bytes_are_refused_and_change_nothing(world: World) -> None:
    work = await running(world)
    conn, fence = world.conn, work.fence
    await append_output(conn, fence, 0, b"0123456789", KEEP_ALL)
    before = await stored(world, work)
    gap = await refused(append_output(conn, fence, 11, b"x", KEEP_ALL))
    assert gap.reason is Reason.OUTPUT_OFFSET_GAP
    assert dict(gap.metadata) == {EXPECTED_OFFSET: "10"}
    for offset, data in ((4, b"4X6"), (8, b"8Y-and-more")):  # inside, and across the end
        conflict = await refused(append_output(conn, fence, offset, data, KEEP_ALL))
        assert conflict.reason is Reason.REPLAY_MISMATCH
    assert await stored(world, work) == before
    assert await whole_output(world, work) == b"0123456789"


async def test_only_the_attempts_own_worker_and_capability_append(world: World) -> None:
    ours = await running(world, "worker-a")
    theirs = await running(world, "worker-b")
    conn = world.conn
    # worker-b presents its own authority for worker-a's Attempt.
    wrong_attempt = replace(theirs.fence, attempt_id=ours.fence.attempt_id)
    other = await refused(append_output(conn, wrong_attempt, 0, b"x", KEEP_ALL))
    assert other.reason is Reason.FENCE_MISMATCH
    stolen = replace(
        ours.fence,
        token_digest=digest_of_capability(encode_lease_capability(secrets.token_bytes(32))),
    )
    wrong_token = await refused(append_output(conn, stolen, 0, b"x", KEEP_ALL))
    assert wrong_token.reason is Reason.LEASE_TOKEN_MISMATCH
    missing = replace(ours.fence, attempt_id=theirs.fence.run_id)  # no such Attempt
    assert (await refused(append_output(conn, missing, 0, b"x", KEEP_ALL))).reason is (
        Reason.FENCE_MISMATCH
    )
    assert await stored(world, ours) == (None, [])


async def test_appends_outlive_the_lease_and_the_attempt(world: World) -> None:
    """The tail is shipped after the executor ended: a renewed-away version, a completed
    lease or a replaced session does not matter; the Attempt's identity does."""
    work = await running(world)
    conn = world.conn
    await append_output(conn, work.fence, 0, b"before\n", KEEP_ALL)
    renewed = await control_lease(conn, work.fence, world.timings)
    await complete_attempt(
        conn,
        replace(work.fence, expected_lease_version=renewed.new_lease_version),
        CompletionReport(1, "succeeded", 0, "exit code 0", None),
    )
    await world.session("worker-a")  # a new session replaces the one that claimed it
    late = await append_output(conn, work.fence, 7, b"after\n", KEEP_ALL)
    assert late.end_offset == 13
    page = await read_output(conn, PROJECT, work.fence.run_id, None, 0, 1024)
    assert (page.data, page.complete, page.run_terminal) == (b"before\nafter\n", True, True)
    assert page.output_bytes is None  # this Worker did not say how much it wrote


async def test_the_size_reported_with_the_ending_tells_readers_what_is_still_coming(
    world: World,
) -> None:
    """A Worker that reports the ending before it shipped all output says how much there
    is: a reader sees the Attempt complete with fewer bytes held than that, until the rest
    arrives. An exact replay of the completion changes nothing, a different size
    included."""
    work = await running(world)
    conn, run_id = world.conn, work.fence.run_id
    await append_output(conn, work.fence, 0, b"early\n", KEEP_ALL)
    running_page = await read_output(conn, PROJECT, run_id, None, 0, 1024)
    assert (running_page.complete, running_page.output_bytes) == (False, None)
    report = CompletionReport(1, "succeeded", 0, "exit code 0", None, output_bytes=12)
    await complete_attempt(conn, work.fence, report)
    short = await read_output(conn, PROJECT, run_id, None, 0, 1024)
    assert (short.complete, short.end_offset, short.output_bytes) == (True, 6, 12)
    replayed = await complete_attempt(conn, work.fence, replace(report, output_bytes=99))
    assert replayed.replayed
    await append_output(conn, work.fence, 6, b"later\n", KEEP_ALL)
    whole = await read_output(conn, PROJECT, run_id, None, 0, 1024)
    assert (whole.data, whole.end_offset, whole.output_bytes) == (b"early\nlater\n", 12, 12)


async def test_only_an_ended_attempt_has_an_output_size(world: World) -> None:
    work = await running(world)
    with pytest.raises(psycopg.errors.CheckViolation, match="attempts_output_bytes_at_end"):
        await world.conn.execute(
            "UPDATE qinglong.attempts SET output_bytes = 1 WHERE attempt_id = %s",
            (work.fence.attempt_id,),
        )


async def test_reads_page_by_offset_and_select_the_attempt(world: World) -> None:
    work = await running(world)
    conn, run_id = world.conn, work.fence.run_id
    data = bytes(range(256)) * 700  # 179,200 bytes: three chunks
    for start in range(0, len(data), CHUNK):
        await append_output(conn, work.fence, start, data[start : start + CHUNK], KEEP_ALL)
    page = await read_output(conn, PROJECT, run_id, None, 0, 100_000)
    assert (page.offset, page.data, page.end_offset) == (0, data[:100_000], len(data))
    assert (page.attempt_number, page.attempt_id, page.complete) == (
        1,
        work.fence.attempt_id,
        False,
    )
    assert page.log_artifact_id == f"attempts/{work.fence.attempt_id}/output"
    rest = await read_output(conn, PROJECT, run_id, 1, 100_000, 1 << 20)
    assert page.data + rest.data == data
    at_end = await read_output(conn, PROJECT, run_id, 1, len(data), 10)
    assert (at_end.offset, at_end.data) == (len(data), b"")
    beyond = await read_output(conn, PROJECT, run_id, None, len(data) + 1, 10)
    assert (beyond.offset, beyond.data, beyond.end_offset) == (len(data) + 1, b"", len(data))
    absent = await refused(read_output(conn, PROJECT, run_id, 2, 0, 10))
    assert absent.reason is Reason.ATTEMPT_NOT_FOUND
    elsewhere = await refused(read_output(conn, "proj-b", run_id, None, 0, 10))
    assert elsewhere.reason is Reason.RUN_NOT_FOUND


async def chunks_fetched_by(world: World, read: Any) -> int:
    """How many chunk rows the statements of ``read`` fetched: the difference in this
    session's not yet reported statistics (no waiting for them to be reported), taken in
    one transaction so that they cannot be reported in between."""

    async def fetched() -> int:
        cursor = await world.conn.execute(
            "SELECT coalesce(sum(idx_tup_fetch + seq_tup_read), 0)"
            " FROM pg_stat_xact_user_tables WHERE relname = 'attempt_output_chunks'"
        )
        row = await cursor.fetchone()
        assert row is not None
        return int(row[0])

    async with world.conn.transaction():
        # The statement's bound is measured, not the planner's choice for a table of a few
        # rows (a sequential scan there would read every chunk whatever the bound).
        await world.conn.execute("SET LOCAL enable_seqscan = off")
        before = await fetched()
        await read
        return await fetched() - before


async def test_a_page_reads_only_the_chunks_it_returns(world: World) -> None:
    """A 64 MiB stream read a page at a time must not read the whole stream per page."""
    work = await running(world)
    conn, run_id = world.conn, work.fence.run_id
    data = secrets.token_bytes(CHUNK * 16)
    for start in range(0, len(data), CHUNK):
        await append_output(conn, work.fence, start, data[start : start + CHUNK], KEEP_ALL)
    first = read_output(conn, PROJECT, run_id, None, 0, 100)
    assert await chunks_fetched_by(world, first) == 1
    middle = read_output(conn, PROJECT, run_id, 1, 5 * CHUNK - 10, 20 + CHUNK)
    assert await chunks_fetched_by(world, middle) == 3  # the end of 4, all of 5, 6's start
    page = await read_output(conn, PROJECT, run_id, 1, 5 * CHUNK - 10, 20 + CHUNK)
    assert page.data == data[5 * CHUNK - 10 : 6 * CHUNK + 10]


async def test_a_run_without_an_attempt_reads_empty(world: World) -> None:
    run_id = await world.queued_run()
    page = await read_output(world.conn, PROJECT, run_id, None, 0, 10)
    assert (page.attempt_id, page.data, page.run_terminal) == (None, b"", False)


async def test_an_attempt_keeps_its_newest_bytes_within_the_size_bound(world: World) -> None:
    work = await running(world)
    conn = world.conn
    bound = OutputRetention(max_bytes_per_attempt=2 * CHUNK)
    data = b"".join(bytes([65 + n]) * CHUNK for n in range(4))
    for start in range(0, len(data), CHUNK):
        await append_output(conn, work.fence, start, data[start : start + CHUNK], bound)
    stream, chunks = await stored(world, work)
    assert stream == (4 * CHUNK, 2 * CHUNK)
    assert chunks == [(2 * CHUNK, 3 * CHUNK), (3 * CHUNK, 4 * CHUNK)]
    page = await read_output(conn, PROJECT, work.fence.run_id, None, 0, 1 << 20)
    assert (page.offset, page.first_offset, page.data) == (2 * CHUNK, 2 * CHUNK, data[2 * CHUNK :])
    # A re-sent chunk that retention removed is still a replay (its end is known).
    replay = await append_output(conn, work.fence, 0, data[:CHUNK], bound)
    assert (replay.replayed, replay.end_offset) == (True, 4 * CHUNK)


async def test_old_output_expires_and_its_end_is_kept(world: World) -> None:
    work = await running(world)
    fresh = await running(world, "worker-b")
    conn = world.conn
    await append_output(conn, work.fence, 0, b"old output\n", KEEP_ALL)
    await append_output(conn, fresh.fence, 0, b"new output\n", KEEP_ALL)
    await written_long_ago(world, work)
    # An age of a minute: the first stream is older, the second was written just now.
    assert await expire_output(conn, 60_000, 128) == 1
    assert await stored(world, work) == ((11, 11), [])
    assert (await stored(world, fresh))[1] == [(0, 11)]
    page = await read_output(conn, PROJECT, work.fence.run_id, None, 0, 1024)
    assert (page.data, page.offset, page.end_offset) == (b"", 11, 11)
    assert await expire_output(conn, 60_000, 128) == 0  # nothing left to expire there


async def test_the_age_sweep_progresses_through_a_stream_larger_than_one_step(
    world: World,
) -> None:
    """Each step removes at most `limit` chunks, the oldest first, and moves first_offset
    to the end of the last one removed: a stream too large for one step is emptied over
    several, never started over (every step makes progress)."""
    work = await running(world)
    small = await running(world, "worker-b")
    conn = world.conn
    lines = [b"%04d\n" % n for n in range(7)]  # seven chunks of five bytes
    for n, line in enumerate(lines):
        await append_output(conn, work.fence, 5 * n, line, KEEP_ALL)
    await append_output(conn, small.fence, 0, b"tiny\n", KEEP_ALL)
    await written_long_ago(world, work, hours=2)
    await written_long_ago(world, small)  # the younger of the two
    assert await expire_output(conn, 60_000, 3) == 3
    assert await stored(world, work) == ((35, 15), [(15, 20), (20, 25), (25, 30), (30, 35)])
    page = await read_output(conn, PROJECT, work.fence.run_id, None, 0, 1024)
    assert (page.offset, page.first_offset, page.data) == (15, 15, b"".join(lines[3:]))
    assert await expire_output(conn, 60_000, 3) == 3
    assert await stored(world, work) == ((35, 30), [(30, 35)])
    # The rest of the older stream, then the younger one, in the same step.
    assert await expire_output(conn, 60_000, 3) == 2
    assert await stored(world, work) == ((35, 35), [])
    assert await stored(world, small) == ((5, 5), [])
    assert await expire_output(conn, 60_000, 3) == 0
    # The end stays: a late re-sent chunk is still recognised.
    replay = await append_output(conn, work.fence, 30, lines[6], KEEP_ALL)
    assert (replay.replayed, replay.end_offset) == (True, 35)


async def test_the_age_sweep_skips_a_stream_another_step_holds(
    world: World, database: MigratedDatabase
) -> None:
    """Replicas share the sweep: a stream locked by one step (SKIP LOCKED) is left to it,
    and the other step goes on with the next stream."""
    first = await running(world)
    second = await running(world, "worker-b")
    conn = world.conn
    await append_output(conn, first.fence, 0, b"first\n", KEEP_ALL)
    await append_output(conn, second.fence, 0, b"second\n", KEEP_ALL)
    await written_long_ago(world, first, second)
    async with await psycopg.AsyncConnection.connect(database.urls.runtime) as other:
        await other.execute(
            "SELECT 1 FROM qinglong.attempt_output WHERE attempt_id = %s FOR UPDATE",
            (first.fence.attempt_id,),
        )
        assert await expire_output(conn, 60_000, 128) == 1
        assert (await stored(world, first))[1] == [(0, 6)]
        assert await stored(world, second) == ((7, 7), [])
        await other.rollback()
    assert await expire_output(conn, 60_000, 128) == 1
    assert await stored(world, first) == ((6, 6), [])


async def test_concurrent_appends_to_one_attempt_store_each_byte_once(
    world: World, database: MigratedDatabase
) -> None:
    """Appends of one Attempt on two connections at once — the first chunk re-sent while
    its original is in flight (a lost answer, a restarted Worker), then two chunks that
    overlap — wait for each other on the stream's lock: every byte is stored once, in
    order, whichever goes first."""
    work = await running(world)
    data = bytes(range(256)) * 1024
    rounds = [
        ((0, data[:CHUNK]), (0, data[:CHUNK])),
        ((CHUNK // 2, data[CHUNK // 2 : CHUNK + 100]), (CHUNK, data[CHUNK : 2 * CHUNK])),
    ]
    lock = "SELECT pg_advisory_xact_lock(hashtextextended('qinglong.output:' || %s, 0))"
    async with (
        await psycopg.AsyncConnection.connect(database.urls.runtime, autocommit=True) as one,
        await psycopg.AsyncConnection.connect(database.urls.runtime, autocommit=True) as two,
        await psycopg.AsyncConnection.connect(database.urls.runtime, autocommit=True) as gate,
        await psycopg.AsyncConnection.connect(database.admin_url, autocommit=True) as observer,
    ):
        for first, second in rounds:
            async with gate.transaction():  # both appends are in flight before either runs
                await gate.execute(lock, (str(work.fence.attempt_id),))
                racing = asyncio.gather(
                    append_output(one, work.fence, *first, KEEP_ALL),
                    append_output(two, work.fence, *second, KEEP_ALL),
                )
                await until_waiting(observer, 2)  # both appends wait on the stream lock
                assert not racing.done()
            results = await racing
            assert [result.replayed for result in results].count(False) >= 1
    stream, chunks = await stored(world, work)
    assert stream == (2 * CHUNK, 0)
    assert chunks[0] == (0, CHUNK)
    assert all(stop == start for (_, stop), (start, _) in itertools.pairwise(chunks))
    assert chunks[-1][1] == 2 * CHUNK, "contiguous to the end: no byte stored twice"
    assert await whole_output(world, work) == data[: 2 * CHUNK]
