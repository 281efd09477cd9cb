"""The retry authority (SPEC R-RETRY-1, R-RETRY-2), late receipts (R-FAIL-3), a Worker's
shutdown stop and concurrent cancellations (R-CAN-6), asserted on rows and Events."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
import pytest
from qinglong_control.db.cancellation import CancelRequest, cancel_run
from qinglong_control.db.convergence import converge_page, expire_leases
from qinglong_control.db.events import Actor
from qinglong_control.db.identities import bind_role, enroll_operator_token
from qinglong_control.db.lease_control import complete_attempt
from qinglong_control.db.pool import open_runtime_pool
from qinglong_control.db.retries import retry_page
from qinglong_control.db.start_facts import (
    acknowledge_running,
    acknowledge_starting,
    report_start_failure,
)
from qinglong_control.domain.cancellation import BindingSnapshot, CancelOutcome
from qinglong_control.domain.capability import parse_digest
from qinglong_control.domain.completion import CompletionReport
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.domain.retry import Ending, RetryPolicy
from qinglong_control.domain.start_facts import RunningReport
from qinglong_control.domain.states import RunState
from qinglong_control.domain.timings import Timings
from qinglong_control.reconciler import Reconciler, ReconcilerLimits
from qinglong_protocol.pooling import PoolSizing, default_max_size

from tests.support import timelines
from tests.support.postgres import MigratedDatabase
from tests.support.seed import digest
from tests.support.world import PROJECT, ClaimedWork, World, with_version

REPORT = RunningReport("pid:4242;start:1700000000", None, 1, parse_digest("ab" * 32))
THREE_TRIES = RetryPolicy(
    max_attempts=3,
    initial_backoff_ms=1_000,
    max_backoff_ms=4_000,
    retry_on=frozenset({Ending.FAILED, Ending.START_FAILED}),
)


async def run_row(world: World, run_id: uuid.UUID) -> dict[str, Any]:
    cursor = await world.conn.execute(
        "SELECT state, error_code, attempt_count, retry_at_ms, event_sequence, finished_at_ms,"
        " deadline_at_ms FROM qinglong.runs WHERE run_id = %s",
        (run_id,),
    )
    row = await cursor.fetchone()
    assert row is not None
    names = ("state", "error_code", "attempts", "retry_at", "sequence", "finished_at", "deadline")
    return dict(zip(names, row, strict=True))


async def attempts(world: World, run_id: uuid.UUID) -> list[tuple[Any, ...]]:
    cursor = await world.conn.execute(
        "SELECT a.attempt_number, a.lease_generation, a.state, a.error_code, l.status"
        " FROM qinglong.attempts a JOIN qinglong.run_leases l USING (attempt_id)"
        " WHERE a.run_id = %s ORDER BY a.attempt_number",
        (run_id,),
    )
    return list(await cursor.fetchall())


async def event_types(world: World, run_id: uuid.UUID) -> list[str]:
    cursor = await world.conn.execute(
        "SELECT sequence, event_type FROM qinglong.run_events WHERE run_id = %s ORDER BY sequence",
        (run_id,),
    )
    rows = list(await cursor.fetchall())
    assert [sequence for sequence, _ in rows] == list(range(1, len(rows) + 1)), "gapless"
    return [event_type for _, event_type in rows]


async def lease_ran_out(
    world: World, work: ClaimedWork, *, renewed_ms_ago: int = 1, expired_ms_ago: int = 1
) -> int:
    """Move the lease's last renewal and its expiry into the past (DB time); its expiry."""
    return await world.lease_ran_out(work.fence.attempt_id, expired_ms_ago, renewed_ms_ago)


async def expire_lease_now(world: World, work: ClaimedWork) -> int:
    """Move the lease's expiry into the past (DB time) and let expiry find it."""
    expired_at = await lease_ran_out(world, work)
    assert (await expire_leases(world.conn, 128)).expired == 1
    return expired_at


async def make_retry_due(world: World, run_id: uuid.UUID) -> None:
    await world.conn.execute(
        "UPDATE qinglong.runs SET retry_at_ms = qinglong.db_now_ms() - 1 WHERE run_id = %s",
        (run_id,),
    )


async def running(world: World, work: ClaimedWork) -> None:
    await acknowledge_starting(world.conn, work.fence)
    await acknowledge_running(world.conn, work.fence, REPORT)


def finished(outcome: str, exit_code: int | None, **changes: Any) -> CompletionReport:
    return CompletionReport(REPORT.callback_sequence, outcome, exit_code, "", **changes)


# --- R-RETRY-1: a claimed Attempt never started an executor --------------------------


async def test_claimed_lease_expiry_requeues_and_the_next_claim_is_attempt_two(
    world: World,
) -> None:
    work = await world.claimed()
    run_id = work.fence.run_id
    await expire_lease_now(world, work)
    row = await run_row(world, run_id)
    assert (row["state"], row["attempts"], row["finished_at"]) == ("queued", 1, None)
    assert await attempts(world, run_id) == [(1, 1, "lost", "LEASE_EXPIRED", "expired")]
    assert (await event_types(world, run_id))[-2:] == ["attempt.lost", "run.queued"]
    again = await world.claim(run_id, work.session)
    assert again.fence.lease_generation == 2
    assert [a[:3] for a in await attempts(world, run_id)] == [(1, 1, "lost"), (2, 2, "claimed")]
    # The old Attempt's authority is over: its fence can never start anything.
    with pytest.raises(Refused):
        await acknowledge_starting(world.conn, work.fence)


async def test_claimed_expiry_with_intent_requeues_then_convergence_ends_both(
    world: World,
) -> None:
    work = await world.claimed()
    run_id = work.fence.run_id
    await world.cancel_intent(run_id)
    await expire_lease_now(world, work)
    assert (await run_row(world, run_id))["state"] == "queued"
    assert await attempts(world, run_id) == [(1, 1, "claimed", None, "expired")]
    page = await converge_page(world.conn, 128)
    assert (page.converged, page.blocked) == (1, 0)
    assert (await run_row(world, run_id))["state"] == "cancelled"
    assert (await event_types(world, run_id))[-4:] == [
        "run.cancel_requested",
        "run.queued",
        "attempt.cancelled",
        "run.cancelled",
    ]


# --- R-RETRY-2: lost, failed and start failure -------------------------------------------


@pytest.mark.parametrize(("lease_ttl_ms", "worker_stop_ms"), [(2_000, 12_000), (30_000, 12_000)])
async def test_a_lost_runs_successor_waits_for_the_workers_to_stop_too(
    world: World, lease_ttl_ms: int, worker_stop_ms: int
) -> None:
    """With a lease shorter than the time a Worker takes to stop its executor once its
    local lease ran out (its tick, then SIGTERM, grace, SIGKILL), a lease lifetime is not
    enough: the successor waits for the longer of the two."""
    timings = Timings(lease_ttl_ms=lease_ttl_ms, worker_stop_ms=worker_stop_ms)
    short = World(world.conn, timings)
    work = await short.claimed(retry_policy=THREE_TRIES)
    await running(short, work)
    expired_at = await expire_lease_now(short, work)
    assert (await retry_page(short.conn, 128, timings)).scheduled == 1
    waited = (await run_row(short, work.fence.run_id))["retry_at"] - expired_at
    assert max(lease_ttl_ms, worker_stop_ms) <= waited < max(lease_ttl_ms, worker_stop_ms) + 5_000


async def test_lost_run_waits_a_lease_lifetime_then_is_queued_for_attempt_two(
    world: World,
) -> None:
    work = await world.claimed(retry_policy=THREE_TRIES)
    run_id = work.fence.run_id
    await running(world, work)
    expired_at = await expire_lease_now(world, work)
    assert (await run_row(world, run_id))["state"] == "lost"
    page = await retry_page(world.conn, 128, world.timings)
    assert (page.scheduled, page.exhausted, page.requeued) == (1, 0, 0)
    row = await run_row(world, run_id)
    assert row["state"] == "retry_wait"
    # Never before one lease lifetime after the lease expired (R-W-2 step 3).
    assert row["retry_at"] >= expired_at + world.timings.lease_ttl_ms
    assert (await retry_page(world.conn, 128, world.timings)).requeued == 0  # not yet due
    await make_retry_due(world, run_id)
    assert (await retry_page(world.conn, 128, world.timings)).requeued == 1
    row = await run_row(world, run_id)
    assert (row["state"], row["retry_at"]) == ("queued", None)
    first_deadline = (await run_row(world, run_id))["deadline"]
    assert first_deadline is not None
    second = await world.claim(run_id, work.session)
    # The Run shows its newest Attempt's deadline: none until that one starts.
    assert (await run_row(world, run_id))["deadline"] is None
    await running(world, second)
    started = await world.conn.execute(
        "SELECT deadline_at_ms FROM qinglong.attempts WHERE attempt_id = %s",
        (second.fence.attempt_id,),
    )
    assert (await run_row(world, run_id))["deadline"] == (await started.fetchone() or [0])[0]
    done = await complete_attempt(world.conn, second.fence, finished("succeeded", 0))
    assert done.run_state is RunState.SUCCEEDED
    assert [a[:4] for a in await attempts(world, run_id)] == [
        (1, 1, "lost", "LEASE_EXPIRED"),
        (2, 2, "succeeded", None),
    ]
    assert await event_types(world, run_id) == [
        *timelines.UNTIL_RUNNING,
        "attempt.lost",
        "run.lost",
        "run.retry_wait",
        "run.queued",
        *timelines.RETRIED_AND_SUCCEEDED,
    ]


async def test_lost_run_without_a_policy_ends_attempts_exhausted(world: World) -> None:
    work = await world.claimed()
    await running(world, work)
    await expire_lease_now(world, work)
    page = await retry_page(world.conn, 128, world.timings)
    assert (page.scheduled, page.exhausted) == (0, 1)
    row = await run_row(world, work.fence.run_id)
    assert (row["state"], row["error_code"]) == ("failed", "ATTEMPTS_EXHAUSTED")
    assert row["finished_at"] is not None
    assert (await attempts(world, work.fence.run_id))[0][2:4] == ("lost", "LEASE_EXPIRED")
    assert (await retry_page(world.conn, 128, world.timings)).candidates == 0


async def test_failures_retry_until_the_budget_is_spent(world: World) -> None:
    policy = RetryPolicy(max_attempts=2, retry_on=frozenset({Ending.FAILED}))
    work = await world.claimed(retry_policy=policy)
    run_id = work.fence.run_id
    await running(world, work)
    first = await complete_attempt(world.conn, work.fence, finished("failed", 3))
    assert (first.attempt_state.value, first.run_state) == ("failed", RunState.RETRY_WAIT)
    assert first.retry_at_ms is not None
    assert first.run_error_code is None
    assert (await run_row(world, run_id))["state"] == "retry_wait"
    # The lost-answer replay of that completion answers the same, writes nothing.
    sequence = (await run_row(world, run_id))["sequence"]
    replay = await complete_attempt(world.conn, work.fence, finished("failed", 3))
    assert replay.replayed
    assert (await run_row(world, run_id))["sequence"] == sequence
    await make_retry_due(world, run_id)
    await retry_page(world.conn, 128, world.timings)
    second = await world.claim(run_id, work.session)
    await running(world, second)
    last = await complete_attempt(world.conn, second.fence, finished("failed", 4))
    assert (last.run_state, last.run_error_code, last.error_code) == (
        RunState.FAILED,
        "ATTEMPTS_EXHAUSTED",
        "EXECUTION_FAILED",
    )
    assert (await run_row(world, run_id))["error_code"] == "ATTEMPTS_EXHAUSTED"


async def test_failure_is_final_when_the_policy_does_not_opt_in(world: World) -> None:
    policy = RetryPolicy(max_attempts=3)  # lost only
    work = await world.claimed(retry_policy=policy)
    await running(world, work)
    done = await complete_attempt(world.conn, work.fence, finished("failed", 1))
    assert (done.run_state, done.run_error_code) == (RunState.FAILED, "EXECUTION_FAILED")


async def test_start_failure_the_policy_retries_waits_for_attempt_two(world: World) -> None:
    work = await world.claimed(retry_policy=THREE_TRIES)
    await acknowledge_starting(world.conn, work.fence)
    decision = await report_start_failure(world.conn, work.fence, "no such file")
    assert (decision.run_state, decision.error_code) == (
        RunState.RETRY_WAIT,
        "EXECUTOR_START_FAILED",
    )
    row = await run_row(world, work.fence.run_id)
    assert (row["state"], row["error_code"], row["finished_at"]) == ("retry_wait", None, None)
    # R-FAIL-2 replay still answers, without a second pair of Events.
    events_before = await event_types(world, work.fence.run_id)
    again = await report_start_failure(world.conn, work.fence, "no such file")
    assert again.replayed
    assert await event_types(world, work.fence.run_id) == events_before
    assert events_before[-2:] == ["attempt.failed", "run.retry_wait"]


async def test_replays_answer_as_the_first_call_after_the_run_moved_on(world: World) -> None:
    """R-FAIL-2, R-W-6: a lost answer's retry gets the same answer, even when the Run
    has moved on since — here to its next Attempt, which then ended it."""
    work = await world.claimed(retry_policy=THREE_TRIES)
    run_id = work.fence.run_id
    await acknowledge_starting(world.conn, work.fence)
    first = await report_start_failure(world.conn, work.fence, "no such file")
    assert (first.run_state, first.run_error_code) == (RunState.RETRY_WAIT, None)
    await make_retry_due(world, run_id)
    await retry_page(world.conn, 128, world.timings)
    second = await world.claim(run_id, work.session)
    assert (await run_row(world, run_id))["state"] == "dispatching"
    again = await report_start_failure(world.conn, work.fence, "no such file")
    assert again.replayed
    assert (again.run_state, again.run_error_code) == (RunState.RETRY_WAIT, None)

    await running(world, second)
    ended = await complete_attempt(world.conn, second.fence, finished("failed", 2))
    assert ended.run_state is RunState.RETRY_WAIT
    await make_retry_due(world, run_id)
    await retry_page(world.conn, 128, world.timings)
    third = await world.claim(run_id, work.session)
    await running(world, third)
    last = await complete_attempt(world.conn, third.fence, finished("failed", 3))
    assert (last.run_state, last.run_error_code) == (RunState.FAILED, "ATTEMPTS_EXHAUSTED")
    # Attempt two's ending made the Run wait for a retry; the Run is failed now.
    replay = await complete_attempt(world.conn, second.fence, finished("failed", 2))
    assert replay.replayed
    assert (replay.run_state, replay.run_error_code) == (RunState.RETRY_WAIT, None)
    # The last one's replay answers what it answered too.
    again_last = await complete_attempt(world.conn, third.fence, finished("failed", 3))
    assert (again_last.run_state, again_last.run_error_code) == (
        RunState.FAILED,
        "ATTEMPTS_EXHAUSTED",
    )


async def test_cancel_intent_wins_over_a_waiting_retry(world: World) -> None:
    work = await world.claimed(retry_policy=THREE_TRIES)
    run_id = work.fence.run_id
    await running(world, work)
    await complete_attempt(world.conn, work.fence, finished("failed", 1))
    await world.conn.execute(
        "UPDATE qinglong.runs SET cancel_requested_at_ms = qinglong.db_now_ms(),"
        " cancel_reason = 'user' WHERE run_id = %s",
        (run_id,),
    )
    await make_retry_due(world, run_id)
    assert (await retry_page(world.conn, 128, world.timings)).requeued == 0
    assert (await converge_page(world.conn, 128)).converged == 1
    row = await run_row(world, run_id)
    assert (row["state"], row["retry_at"]) == ("cancelled", None)


async def test_one_cycle_expires_then_schedules_the_retry(
    database: MigratedDatabase, world: World
) -> None:
    work = await world.claimed(retry_policy=THREE_TRIES)
    await running(world, work)
    await lease_ran_out(world, work)
    pool = await open_runtime_pool(database.urls.runtime, sizing=PoolSizing(1, 2))
    try:
        report = await Reconciler(pool, ReconcilerLimits(), world.timings).cycle()
    finally:
        await pool.close()
    assert (report.expired, report.retries_scheduled) == (1, 1)
    assert (await run_row(world, work.fence.run_id))["state"] == "retry_wait"


async def test_a_lost_attempt_is_retried_though_its_deadline_came_before_its_lease_ran_out(
    world: World,
) -> None:
    """Between a Worker's last renewal and its lease's expiry the control plane cannot tell
    when the Worker vanished: just after that renewal (its executor far from the deadline)
    or just before the next. So a deadline inside that window is no timeout — only a
    renewal that sees the deadline passed makes one (R-LC-6) — and the lost Attempt is
    retried like any other (R-RETRY-2: lost is always eligible)."""
    work = await world.claimed(retry_policy=THREE_TRIES)
    await running(world, work)
    # Renewed last 100 ms ago, the deadline 50 ms ago, the lease ran out 1 ms ago.
    await world.conn.execute(
        "UPDATE qinglong.attempts SET deadline_at_ms = qinglong.db_now_ms() - 50"
        " WHERE attempt_id = %s",
        (work.fence.attempt_id,),
    )
    await lease_ran_out(world, work, renewed_ms_ago=100)
    assert (await expire_leases(world.conn, 128)).expired == 1
    assert (await retry_page(world.conn, 128, world.timings)).scheduled == 1
    row = await run_row(world, work.fence.run_id)
    assert (row["state"], row["error_code"]) == ("retry_wait", None)


# --- R-FAIL-3 and a Worker's own shutdown ----------------------------------------------


async def test_completion_after_a_start_failure_is_refused_as_a_closed_receipt(
    world: World,
) -> None:
    work = await world.claimed()
    await acknowledge_starting(world.conn, work.fence)
    await report_start_failure(world.conn, work.fence, "exec failed")
    before = await event_types(world, work.fence.run_id)
    for version in (1, 2):
        with pytest.raises(Refused) as refused:
            await complete_attempt(
                world.conn, with_version(work.fence, version), finished("succeeded", 0)
            )
        assert refused.value.reason is Reason.CALLBACK_SEQUENCE_FENCED
    assert await event_types(world, work.fence.run_id) == before


async def test_a_draining_workers_stop_records_a_shutdown_intent_and_cancels(
    world: World,
) -> None:
    work = await world.claimed(retry_policy=THREE_TRIES)
    run_id = work.fence.run_id
    await running(world, work)
    with pytest.raises(Refused) as unasked:
        await complete_attempt(world.conn, work.fence, finished("cancelled", None))
    assert unasked.value.reason is Reason.STATE_CONFLICT
    report = finished("cancelled", None, stop_reason="shutdown")
    done = await complete_attempt(world.conn, work.fence, report)
    assert (done.attempt_state.value, done.run_state) == ("cancelled", RunState.CANCELLED)
    cursor = await world.conn.execute(
        "SELECT cancel_reason, cancel_requested_by FROM qinglong.runs WHERE run_id = %s",
        (run_id,),
    )
    assert await cursor.fetchone() == ("shutdown", "worker-a")
    assert (await event_types(world, run_id))[-3:] == [
        "run.cancel_requested",
        "attempt.cancelled",
        "run.cancelled",
    ]
    replay = await complete_attempt(world.conn, work.fence, report)
    assert replay.replayed
    assert replay.run_state is RunState.CANCELLED


async def test_a_shutdown_stop_after_the_deadline_passed_is_a_timeout(world: World) -> None:
    work = await world.claimed()
    await running(world, work)
    await world.conn.execute(
        "UPDATE qinglong.runs SET cancel_requested_at_ms = qinglong.db_now_ms(),"
        " cancel_reason = 'timeout' WHERE run_id = %s",
        (work.fence.run_id,),
    )
    report = finished("cancelled", None, stop_reason="shutdown")
    done = await complete_attempt(world.conn, work.fence, report)
    assert (done.attempt_state.value, done.run_state) == ("timed_out", RunState.TIMED_OUT)


# --- R-CAN-6: concurrent cancellations -----------------------------------------------


async def test_concurrent_cancellations_answer_one_accepted_and_the_rest_already(
    database: MigratedDatabase, world: World
) -> None:
    with psycopg.connect(database.urls.migration, autocommit=True) as admin:
        alice = enroll_operator_token(admin, "alice", "user", digest("qlo1_alice"))
        bind_role(admin, PROJECT, alice, "operator")
    work = await world.claimed()
    await running(world, work)
    snapshot = BindingSnapshot(project_version=1, binding_version=1, role="operator")
    pool = await open_runtime_pool(database.urls.runtime, sizing=PoolSizing(8, 8))

    async def cancel(index: int) -> CancelOutcome:
        async with pool.connection() as conn:
            return await cancel_run(
                conn,
                CancelRequest(
                    PROJECT,
                    work.fence.run_id,
                    f"m-{index}",
                    Actor("user", str(alice)),
                    alice,
                    snapshot,
                ),
            )

    try:
        outcomes = await asyncio.gather(*(cancel(i) for i in range(8)))
    finally:
        await pool.close()
    assert sorted(o.value for o in outcomes) == ["accepted"] + ["already_requested"] * 7
    assert (await event_types(world, work.fence.run_id)).count("run.cancel_requested") == 1


async def test_cancellations_of_many_runs_at_once_are_all_accepted(
    database: MigratedDatabase, world: World
) -> None:
    """Serializable cancels of different Runs touch the same index pages (the Events', the
    Runs'), which PostgreSQL may take for a conflict: however many collide, each retries
    until it is answered (R-CAN-6), never UNAVAILABLE. As many at once as two control
    replicas' largest default pools hold."""
    size = default_max_size(cores=1024)
    with psycopg.connect(database.urls.migration, autocommit=True) as admin:
        alice = enroll_operator_token(admin, "alice", "user", digest("qlo1_alice"))
        bind_role(admin, PROJECT, alice, "operator")
    runs = [await world.queued_run() for _ in range(2 * size)]
    snapshot = BindingSnapshot(project_version=1, binding_version=1, role="operator")
    replicas = [
        await open_runtime_pool(database.urls.runtime, sizing=PoolSizing(size, size))
        for _ in range(2)
    ]

    async def cancel(index: int, run_id: uuid.UUID) -> CancelOutcome:
        request = CancelRequest(PROJECT, run_id, "bulk", Actor("user", str(alice)), alice, snapshot)
        # As the servicer does: a connection of the replica's pool per try.
        return await cancel_run(replicas[index % 2], request)

    try:
        for pool in replicas:
            await pool.wait()
        outcomes = await asyncio.gather(*(cancel(i, run_id) for i, run_id in enumerate(runs)))
    finally:
        for pool in replicas:
            await pool.close()
    assert {o.value for o in outcomes} == {"accepted"}
    for run_id in runs:
        assert (await event_types(world, run_id)).count("run.cancel_requested") == 1
