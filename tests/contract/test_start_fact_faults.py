"""SPEC R-TX-1 and §7.7: a failure at any statement boundary of a start fact rolls it all back.

For each of the `starting`, `running` and `start-failure` transactions (the latter under
each terminal mapping), the statement labels are recorded from one successful run, then
a fault is injected before every one of them in turn. The fault is a statement that
fails inside PostgreSQL (`FaultPlan`), so everything queued before it has really
executed. After each fault every table of schema `qinglong` must read exactly as before,
and the same command must then succeed on the same connection without the fault.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any

import psycopg
import pytest
from psycopg import pq, sql
from qinglong_control.db import start_facts
from qinglong_control.db.command_tx import (
    CommandTx,
    FaultPlan,
    InjectedFault,
    command_transaction,
)
from qinglong_control.db.start_facts import (
    acknowledge_running,
    acknowledge_starting,
    report_start_failure,
)
from qinglong_control.domain.capability import parse_digest
from qinglong_control.domain.start_facts import RunningOutcome, RunningReport, StartingOutcome

from tests.support.postgres import MigratedDatabase
from tests.support.world import ClaimedWork, World

REPORT = RunningReport("pid:4242;start:1700000000", "log-1", 7, parse_digest("ab" * 32))

LOCKS = ["lock.authority"]

# The boundaries the issue names; the test injects at every recorded label, and checks
# that each of these is among them (so a renamed or dropped statement is noticed).
NAMED_LABELS = {
    "starting": [*LOCKS, "attempt.starting", "run.starting", "event.attempt.starting"],
    "running": [
        *LOCKS,
        "attempt.running",
        "run.running",
        "event.attempt.running",
        "event.run.running",
    ],
    "start_failure": [
        *LOCKS,
        "attempt.start_failed",
        "run.start_failed",
        "event.attempt.failed",
        "event.run.failed",
        "lease.complete",
    ],
    "start_failure_cancelled": [
        *LOCKS,
        "attempt.start_failed",
        "run.start_failed",
        "event.attempt.cancelled",
        "event.run.cancelled",
        "lease.complete",
    ],
    "start_failure_timed_out": [
        *LOCKS,
        "attempt.start_failed",
        "run.start_failed",
        "event.attempt.timed_out",
        "event.run.timed_out",
        "lease.complete",
    ],
}

CANCEL_REASON = {"start_failure_cancelled": "user", "start_failure_timed_out": "timeout"}

# What the Attempt is after the command succeeded.
FINAL_ATTEMPT_STATE = {
    "starting": "starting",
    "running": "running",
    "start_failure": "failed",
    "start_failure_cancelled": "cancelled",
    "start_failure_timed_out": "timed_out",
}


@pytest.fixture
async def admin(database: MigratedDatabase) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """The schema owner, which can read every table, for snapshots."""
    conn = await psycopg.AsyncConnection.connect(database.urls.migration, autocommit=True)
    try:
        yield conn
    finally:
        await conn.close()


async def snapshot(admin: psycopg.AsyncConnection[Any]) -> dict[str, list[str]]:
    """Every row of every table (and sequence) of schema qinglong, as PostgreSQL's text."""
    cursor = await admin.execute(
        "SELECT c.relname, c.relkind FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = 'qinglong' AND c.relkind IN ('r', 'p', 'S') ORDER BY c.relname"
    )
    relations = await cursor.fetchall()
    assert {"runs", "attempts", "run_leases", "run_events"} <= {name for name, _ in relations}
    state: dict[str, list[str]] = {}
    for name, kind in relations:
        query = (
            sql.SQL("SELECT t::text FROM qinglong.{} AS t ORDER BY 1")
            if kind != "S"
            else sql.SQL("SELECT (last_value, is_called)::text FROM qinglong.{}")
        ).format(sql.Identifier(name))
        rows = await (await admin.execute(query)).fetchall()
        state[name] = [row[0] for row in rows]
    # No transaction-scoped lock of a failed command may survive it either.
    locks = await admin.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    )
    state["pg_locks.advisory"] = [str((await locks.fetchone() or [None])[0])]
    return state


async def prepare(world: World, kind: str) -> ClaimedWork:
    """Fresh work in the state the command expects."""
    work = await world.claimed()
    if kind != "starting":
        await acknowledge_starting(world.conn, work.fence)
    if kind in CANCEL_REASON:
        # There is no cancel command yet: the intent is written as the runtime role.
        await world.conn.execute(
            "UPDATE qinglong.runs SET cancel_requested_at_ms = qinglong.db_now_ms(),"
            " cancel_reason = %s WHERE run_id = %s",
            (CANCEL_REASON[kind], work.fence.run_id),
        )
    return work


def command(
    world: World, kind: str, work: ClaimedWork, fault: FaultPlan | None = None
) -> Awaitable[Any]:
    if kind == "starting":
        return acknowledge_starting(world.conn, work.fence, fault)
    if kind == "running":
        return acknowledge_running(world.conn, work.fence, REPORT, fault)
    return report_start_failure(world.conn, work.fence, "exec: no such file", fault)


async def recorded_labels(world: World, kind: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Run the command once, successfully, and read the labels its CommandTx executed."""
    transactions: list[CommandTx] = []

    @asynccontextmanager
    async def recording(
        conn: psycopg.AsyncConnection[Any], fault: FaultPlan | None = None, **options: Any
    ) -> AsyncIterator[CommandTx]:
        async with command_transaction(conn, fault, **options) as tx:
            transactions.append(tx)
            yield tx

    work = await prepare(world, kind)
    with monkeypatch.context() as patch:
        patch.setattr(start_facts, "command_transaction", recording)
        await command(world, kind, work)
    assert len(transactions) == 1
    return list(transactions[0].labels)


async def attempt_state(world: World, work: ClaimedWork) -> str:
    cursor = await world.conn.execute(
        "SELECT state FROM qinglong.attempts WHERE attempt_id = %s", (work.fence.attempt_id,)
    )
    row = await cursor.fetchone()
    assert row is not None
    return str(row[0])


@pytest.mark.parametrize("kind", list(NAMED_LABELS))
async def test_fault_at_every_statement_boundary_rolls_everything_back(
    world: World,
    admin: psycopg.AsyncConnection[Any],
    kind: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """R-TX-1: for every label, the fault leaves the database unchanged; then it succeeds."""
    labels = await recorded_labels(world, kind, monkeypatch)
    assert labels[: len(LOCKS)] == LOCKS, "locks and DB time come first, in the fixed order"
    missing = [label for label in NAMED_LABELS[kind] if label not in labels]
    assert not missing, f"{kind}: named statement boundaries not executed: {missing}"
    assert len(set(labels)) == len(labels), f"{kind}: a label is not a unique boundary"

    for label in labels:
        work = await prepare(world, kind)
        before = await snapshot(admin)
        with pytest.raises(InjectedFault) as fired:
            await command(world, kind, work, FaultPlan(before=label))
        assert str(fired.value) == label
        assert world.conn.info.transaction_status is pq.TransactionStatus.IDLE
        after = await snapshot(admin)
        assert after == before, f"{kind}: fault before {label!r} left writes behind"
        # Nothing was poisoned: the same command, on the same connection, now commits.
        await command(world, kind, work)
        assert await attempt_state(world, work) == FINAL_ATTEMPT_STATE[kind], label
        assert await snapshot(admin) != before  # the snapshot does see a committed write


async def test_unknown_fault_label_never_fires(world: World) -> None:
    """The seam is inert unless its label is executed (so the faults above are real)."""
    work = await prepare(world, "starting")
    decision = await acknowledge_starting(world.conn, work.fence, FaultPlan(before="no.such"))
    assert decision.outcome is StartingOutcome.STARTING


FACT_COLUMNS = {
    "run_state": "r.state",
    "run_version": "r.version",
    "event_sequence": "r.event_sequence",
    "run_started": "r.started_at_ms",
    "run_finished": "r.finished_at_ms",
    "run_error": "r.error_code",
    "attempt_state": "a.state",
    "attempt_started": "a.started_at_ms",
    "handle": "a.executor_handle",
    "callback_sequence": "a.callback_sequence",
    "attempt_error": "a.error_code",
    "attempt_lease_version": "a.lease_version",
    "lease_status": "l.status",
    "lease_version": "l.version",
    "lease_ended": "l.ended_at_ms",
    "events": "(SELECT array_agg(event_type ORDER BY sequence) FROM qinglong.run_events e"
    " WHERE e.run_id = r.run_id)",
}


async def facts(world: World, work: ClaimedWork) -> dict[str, Any]:
    cursor = await world.conn.execute(
        sql.SQL(
            "SELECT {} FROM qinglong.runs r JOIN qinglong.attempts a ON a.run_id = r.run_id"
            " JOIN qinglong.run_leases l ON l.attempt_id = a.attempt_id WHERE a.attempt_id = %s"
        ).format(sql.SQL(", ").join(sql.SQL(c) for c in FACT_COLUMNS.values())),
        (work.fence.attempt_id,),
    )
    row = await cursor.fetchone()
    assert row is not None
    return dict(zip(FACT_COLUMNS, row, strict=True))


async def test_failure_before_second_running_event_rolls_everything_back(
    world: World, admin: psycopg.AsyncConnection[Any]
) -> None:
    """SPEC §7.7: `attempt.running` was written, `run.running` fails: nothing remains."""
    work = await prepare(world, "running")
    before_facts, before = await facts(world, work), await snapshot(admin)
    with pytest.raises(InjectedFault):
        await acknowledge_running(
            world.conn, work.fence, REPORT, FaultPlan(before="event.run.running")
        )
    assert await snapshot(admin) == before
    after = await facts(world, work)
    assert after == before_facts
    assert (after["run_state"], after["attempt_state"]) == ("dispatching", "starting")
    assert (after["run_started"], after["attempt_started"], after["handle"]) == (None,) * 3
    assert after["events"][-1] == "attempt.starting"

    decision = await acknowledge_running(world.conn, work.fence, REPORT)
    assert decision.outcome is RunningOutcome.RUNNING
    done = await facts(world, work)
    assert (done["run_state"], done["attempt_state"]) == ("running", "running")
    assert done["events"][-2:] == ["attempt.running", "run.running"]
    assert done["event_sequence"] == after["event_sequence"] + 2


async def test_failure_before_lease_completion_rolls_everything_back(
    world: World, admin: psycopg.AsyncConnection[Any]
) -> None:
    """SPEC §7.7: terminal Attempt, Run and both Events were written; the lease fails."""
    work = await prepare(world, "start_failure")
    before_facts, before = await facts(world, work), await snapshot(admin)
    with pytest.raises(InjectedFault):
        await report_start_failure(
            world.conn, work.fence, "exec: no such file", FaultPlan(before="lease.complete")
        )
    assert await snapshot(admin) == before
    after = await facts(world, work)
    assert after == before_facts
    assert (after["run_state"], after["attempt_state"]) == ("dispatching", "starting")
    assert (after["run_error"], after["attempt_error"], after["run_finished"]) == (None,) * 3
    assert (after["lease_status"], after["lease_version"], after["lease_ended"]) == (
        "leased",
        1,
        None,
    )
    assert after["attempt_lease_version"] == 1
    assert after["events"][-1] == "attempt.starting"

    decision = await report_start_failure(world.conn, work.fence, "exec: no such file")
    assert decision.completed_lease_version == 2
    done = await facts(world, work)
    assert (done["run_state"], done["attempt_state"]) == ("failed", "failed")
    assert (done["lease_status"], done["lease_version"], done["attempt_lease_version"]) == (
        "completed",
        2,
        2,
    )
    assert done["events"][-2:] == ["attempt.failed", "run.failed"]


async def test_a_connection_survives_many_failed_transactions(
    world: World, database: MigratedDatabase
) -> None:
    """psycopg prepares a statement after a few uses; a PREPARE skipped by a failed
    pipeline would break that statement on the connection for good (every later use:
    InvalidSqlStatementName). Fail, then succeed, on one connection, again and again."""
    conn = await psycopg.AsyncConnection.connect(database.urls.runtime, autocommit=True)
    try:
        for _ in range(10):
            work = await world.claimed()  # built on another connection
            with pytest.raises(InjectedFault):
                await acknowledge_starting(conn, work.fence, fault=FaultPlan(before="run.starting"))
            decision = await acknowledge_starting(conn, work.fence)
            assert decision.outcome is StartingOutcome.STARTING
    finally:
        await conn.close()
