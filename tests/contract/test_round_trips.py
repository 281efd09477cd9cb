"""The hot path's database budget (R-PERF-1): each control command's transaction takes at
most two round trips, and a Worker's call through ingress one (below, on the real stack).

The count comes from libpq's own protocol trace of the command's connection: a round trip
is a batch of frontend ("F") messages followed by backend ("B") messages, i.e. one point
where the client has to wait for the server. The counter is checked first on cases whose
answer is known, so the command tests cannot pass vacuously.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import secrets
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import pq
from qinglong.control.v1 import run_service_pb2, run_service_pb2_grpc
from qinglong.worker.v1 import worker_service_pb2, worker_service_pb2_grpc
from qinglong_control.db import placement, sessions
from qinglong_control.db.start_facts import (
    acknowledge_running,
    acknowledge_starting,
    report_start_failure,
)
from qinglong_control.domain.capability import digest_of_capability, parse_digest
from qinglong_control.domain.claim import ClaimRequest
from qinglong_control.domain.refusals import Refused
from qinglong_control.domain.start_facts import RunningReport
from qinglong_control.domain.timings import Timings
from qinglong_protocol.bounds import encode_lease_capability
from qinglong_protocol.errors import error_reason_of
from qinglong_protocol.pooling import RecoveringPool
from qinglong_protocol.storage import StorageBounds

from tests.support.calls import failure, opened_session, renewal
from tests.support.postgres import MigratedDatabase
from tests.support.stack import running_stack
from tests.support.world import PROJECT, World

MAX_ROUND_TRIPS = 2
REPORT = RunningReport("pid:4242;start:1700000000", "log-1", 7, parse_digest("ab" * 32))

_MESSAGE = re.compile(r"^([FB])\t\d+\t(\w+)")
_STATEMENT = re.compile(r'^F\t\d+\t(?:Parse\t "[^"]*"|Query\t) "\s*(\w*)')
_WORD = re.compile(r"\w+")


@dataclass
class Trace:
    text: str = ""
    messages: list[tuple[str, str]] = field(default_factory=list)

    def parse(self) -> None:
        """(direction, message type or first SQL keyword) per protocol message."""
        keyword_pending = False
        for line in self.text.splitlines():
            message = _MESSAGE.match(line)
            if message is None:
                # The continuation of a multi-line SQL text (it may start on this line).
                word = _WORD.search(line)
                if keyword_pending and word is not None:
                    self.messages[-1] = ("F", word.group(0).upper())
                    keyword_pending = False
                continue
            statement = _STATEMENT.match(line)
            kind = message.group(2)
            keyword_pending = statement is not None and not statement.group(1)
            if statement is not None and statement.group(1):
                kind = statement.group(1).upper()
            self.messages.append((message.group(1), kind))

    @property
    def round_trips(self) -> int:
        directions = [direction for direction, _ in self.messages]
        return sum(
            1
            for previous, current in itertools.pairwise(directions)
            if (previous, current) == ("F", "B")
        )

    def batches(self) -> str:
        """What the client sent before each wait, e.g. `BEGIN,Sync | SELECT*6,Flush`."""
        batches: list[list[str]] = []
        previous = "B"
        for direction, kind in self.messages:
            if direction == "F" and previous == "B":
                batches.append([])
            if direction == "F" and kind not in ("Bind", "Describe", "Execute"):
                batches[-1].append(kind)
            previous = direction
        return " | ".join(",".join(_squeeze(batch)) for batch in batches)


def _squeeze(kinds: list[str]) -> Iterator[str]:
    run: list[str] = []
    for kind in [*kinds, ""]:
        if run and kind != run[0]:
            yield run[0] if len(run) == 1 else f"{run[0]}*{len(run)}"
            run = []
        run.append(kind)


@contextmanager
def traced(conn: psycopg.AsyncConnection[Any], path: Path) -> Iterator[Trace]:
    trace = Trace()
    with path.open("w") as sink:
        conn.pgconn.trace(sink.fileno())
        conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        try:
            yield trace
        finally:
            conn.pgconn.untrace()  # flushes libpq's stream before the file is read
    trace.text = path.read_text(errors="replace")
    trace.parse()


# --- The counter, on known cases ----------------------------------------------------------


async def test_counter_two_autocommit_statements_are_two_round_trips(
    world: World, tmp_path: Path
) -> None:
    with traced(world.conn, tmp_path / "trace") as trace:
        await world.conn.execute("SELECT 1")
        await world.conn.execute("SELECT 1")
    assert trace.round_trips == 2
    assert trace.batches() == "SELECT | SELECT"


async def test_counter_pipeline_of_three_statements_and_one_sync_is_one_round_trip(
    world: World, tmp_path: Path
) -> None:
    with traced(world.conn, tmp_path / "trace") as trace:
        async with world.conn.pipeline():
            for _ in range(3):
                await world.conn.execute("SELECT 1")
    assert trace.round_trips == 1
    assert trace.batches().startswith("SELECT*3,Sync")


async def test_counter_transaction_without_pipeline_is_one_round_trip_per_statement(
    world: World, tmp_path: Path
) -> None:
    with traced(world.conn, tmp_path / "trace") as trace:
        async with world.conn.transaction():
            for _ in range(3):
                await world.conn.execute("SELECT 1")
    assert trace.round_trips == 5  # BEGIN, three statements, COMMIT
    assert trace.batches() == "BEGIN | SELECT | SELECT | SELECT | COMMIT"


async def test_counter_pipelined_transaction_that_reads_once_is_two_round_trips(
    world: World, tmp_path: Path
) -> None:
    """The shape the commands aim for: read the locks, then write and COMMIT with one Sync."""
    conn = world.conn
    with traced(conn, tmp_path / "trace") as trace:
        async with conn.pipeline():
            await conn.execute("BEGIN")
            locked = await conn.execute("SELECT 1 FOR UPDATE")
            await conn.execute("SELECT 2")
            assert await locked.fetchone() == (1,)
            await conn.execute("SELECT 3")
            await conn.execute("COMMIT")
    assert trace.round_trips == 2
    assert trace.batches().startswith("BEGIN,SELECT*2,Flush | SELECT,COMMIT,Sync")


# --- The commands -------------------------------------------------------------------------


def _capability() -> str:
    return encode_lease_capability(secrets.token_bytes(32))


async def _open_offer(world: World) -> tuple[Any, placement.PlacedOffer]:
    run_id = await world.queued_run()
    session = await world.session("worker-a")
    offers = await placement.pull_offers(world.conn, session, 8, world.timings)
    return session, next(offer for offer in offers.offers if offer.run_id == run_id)


def _claim_request(session: Any, offer: placement.PlacedOffer, capability: str) -> ClaimRequest:
    return ClaimRequest(
        session.worker_id,
        session.session_id,
        session.worker_generation,
        offer.offer_id,
        PROJECT,
        offer.run_id,
        digest_of_capability(capability),
    )


Command = Callable[[], Awaitable[Any]]


async def _prepare(case: str, world: World) -> Command:
    """Bring the world to the case's precondition; return the command to measure."""
    conn, timings = world.conn, world.timings
    if case.startswith(("claim_offer", "pull_offers", "open_session")):
        session, offer = await _open_offer(world)
        request = _claim_request(session, offer, _capability())
        if case == "claim_offer":
            return lambda: placement.claim_offer(conn, request, timings)
        if case == "claim_offer.replay":
            await placement.claim_offer(conn, request, timings)
            return lambda: placement.claim_offer(conn, request, timings)
        if case == "pull_offers":
            await world.queued_run()
            return lambda: placement.pull_offers(conn, session, 8, timings)
        if case == "pull_offers.nothing_new":
            return lambda: placement.pull_offers(conn, session, 8, timings)
        command = sessions.OpenSession("worker-a", "open-again", ("remote_worker",), 8, "test")
        if case == "open_session.replay":
            await sessions.open_session(conn, command, timings)
        return lambda: sessions.open_session(conn, command, timings)

    work = await world.claimed()
    fence = work.fence
    if case == "acknowledge_starting":
        return lambda: acknowledge_starting(conn, fence)
    if case == "acknowledge_starting.refused":
        wrong = replace(fence, token_digest=digest_of_capability(_capability()))
        return lambda: _refused(acknowledge_starting(conn, wrong))
    await acknowledge_starting(conn, fence)
    if case == "acknowledge_starting.replay":
        return lambda: acknowledge_starting(conn, fence)
    if case == "acknowledge_running":
        return lambda: acknowledge_running(conn, fence, REPORT)
    if case == "acknowledge_running.replay":
        await acknowledge_running(conn, fence, REPORT)
        return lambda: acknowledge_running(conn, fence, REPORT)
    if case == "report_start_failure":
        return lambda: report_start_failure(conn, fence, "exec: no such file")
    assert case == "report_start_failure.replay"
    await report_start_failure(conn, fence, "exec: no such file")
    return lambda: report_start_failure(conn, fence, "exec: no such file")


async def _refused(command: Awaitable[Any]) -> Refused:
    with pytest.raises(Refused) as refused:
        await command
    return refused.value


CASES = [
    "acknowledge_starting",
    "acknowledge_starting.replay",
    "acknowledge_starting.refused",
    "acknowledge_running",
    "acknowledge_running.replay",
    "report_start_failure",
    "report_start_failure.replay",
    "claim_offer",
    "claim_offer.replay",
    "pull_offers",
    "pull_offers.nothing_new",
    "open_session",
    "open_session.replay",
]


@pytest.mark.parametrize("case", CASES)
async def test_command_takes_at_most_two_round_trips(
    world: World, case: str, tmp_path: Path
) -> None:
    command = await _prepare(case, world)
    with traced(world.conn, tmp_path / f"{uuid.uuid4().hex}.trace") as trace:
        await command()
    assert trace.round_trips >= 1, "the trace saw no exchange: the counter is broken"
    assert trace.round_trips <= MAX_ROUND_TRIPS, (
        f"{case} took {trace.round_trips} database round trips (at most {MAX_ROUND_TRIPS});"
        f" sent before each wait: {trace.batches()}"
    )


# --- Ingress: a Worker's call is one round trip (R-PERF-1) --------------------------------


@asynccontextmanager
async def _traced_pool(pool: RecoveringPool, path: Path) -> AsyncIterator[Trace]:
    """Trace the only connection of a one-connection pool while it serves calls."""
    conn = await pool.getconn()
    with traced(conn, path) as trace:
        await pool.putconn(conn)
        yield trace
        assert await pool.getconn() is conn, "the pool must have exactly one connection"
    await pool.putconn(conn)


def _mostly_one(counts: list[int]) -> None:
    """One round trip per call; psycopg prepares a statement on its fifth use on a
    connection, which costs that one call a second round trip, once."""
    assert counts.count(1) >= len(counts) - 1, counts
    assert set(counts) <= {1, 2}, counts


async def test_a_worker_call_through_ingress_is_one_round_trip(
    database_pg18: MigratedDatabase, tmp_path: Path
) -> None:
    async with (
        running_stack(database_pg18, tmp_path / "pki", ingress_pool_size=1) as stack,
        stack.channel(stack.worker_identity("worker-a")) as channel,
    ):
        worker = worker_service_pb2_grpc.WorkerServiceStub(channel)
        renew = renewal("worker-a", await opened_session(worker, "worker-a"))
        admitted: list[int] = []
        for index in range(8):
            async with _traced_pool(stack.ingress_pool, tmp_path / f"ok-{index}") as trace:
                await worker.RenewSession(renew)
            admitted.append(trace.round_trips)
        # A refusal the statement finds (another Worker's name) costs no more.
        refused: list[int] = []
        for index in range(3):
            async with _traced_pool(stack.ingress_pool, tmp_path / f"no-{index}") as trace:
                other = worker_service_pb2.RenewSessionRequest()
                other.CopyFrom(renew)
                other.worker_id = "worker-b"
                error = await failure(worker.RenewSession(other))
            assert error_reason_of(error) == "PRINCIPAL_MISMATCH"
            refused.append(trace.round_trips)
    print(f"\ningress round trips per Worker call: admitted {admitted}, refused {refused}")
    _mostly_one(admitted + refused)


async def test_an_operator_call_through_ingress_reads_then_audits(
    database_pg18: MigratedDatabase, tmp_path: Path
) -> None:
    """Not a Worker's call, so not R-PERF-1's budget: the bearer token, the role binding
    (read once more on a broken connection), then the audit row — three."""
    async with (
        running_stack(database_pg18, tmp_path / "pki", ingress_pool_size=1) as stack,
        stack.channel(stack.operator_identity("ops")) as channel,
    ):
        runs = run_service_pb2_grpc.RunServiceStub(channel)
        meta = (("authorization", f"Bearer {stack.tokens['vera']}"),)
        counts: list[int] = []
        for index in range(3):
            async with _traced_pool(stack.ingress_pool, tmp_path / f"op-{index}") as trace:
                await runs.ListRuns(
                    run_service_pb2.ListRunsRequest(project_id=PROJECT), metadata=meta
                )
            counts.append(trace.round_trips)
    assert counts == [3, 3, 3]


async def test_concurrent_worker_calls_share_statements(
    database_pg18: MigratedDatabase, tmp_path: Path
) -> None:
    """Group commit: calls that arrive together are audited by one statement and one
    commit, each answered only once its row is durable."""
    calls = 48
    # The lock below is held until the whole burst has arrived, which on a loaded machine
    # takes longer than the default storage bound and than a session's default lifetime
    # (the renewals would find their session expired): the writers, the callers and the
    # session wait it out.
    patient = StorageBounds(timeout_seconds=60)
    async with (
        running_stack(
            database_pg18,
            tmp_path / "pki",
            ingress_pool_size=1,
            ingress_storage=patient,
            timings=Timings(session_ttl_ms=600_000),
        ) as stack,
        stack.channel(stack.worker_identity("worker-a")) as channel,
    ):
        worker = worker_service_pb2_grpc.WorkerServiceStub(channel)
        renew = renewal("worker-a", await opened_session(worker, "worker-a"))
        before = len(stack.audit_rows())
        async with _traced_pool(stack.ingress_pool, tmp_path / "burst") as trace:
            # Hold the audit table so that the calls arrive while the writers wait: how
            # many share a statement is then the batcher's doing, not the machine's speed.
            async with await psycopg.AsyncConnection.connect(stack.database.admin_url) as lock:
                await lock.execute("LOCK TABLE qinglong.security_audit IN ACCESS EXCLUSIVE MODE")
                burst = asyncio.gather(*(worker.RenewSession(renew) for _ in range(calls)))
                for _ in range(3000):
                    if stack.directory.audits_unwritten >= calls:  # the whole burst is in
                        break
                    await asyncio.sleep(0.01)
                arrived = stack.directory.audits_unwritten
                queued = stack.directory.audits_waiting
                await lock.rollback()
            await burst
        written = len(stack.audit_rows()) - before
    print(
        f"\n{calls} concurrent Worker calls: {queued} queued behind the writers, "
        f"{trace.round_trips} round trips, {written} rows"
    )
    # Every call reached the batcher while the writers were held. How the burst splits
    # between the two writers' first batches and the queue behind them depends on when
    # the event loop ran the second writer (one fresh-clone run: 34 taken, 14 queued), so
    # only the statements are counted: 48 calls, a handful of statements.
    assert arrived == calls
    assert written == calls
    # The two writers' first statements, then the rest together (psycopg may prepare
    # the statement on its way: one more).
    assert trace.round_trips <= 5
