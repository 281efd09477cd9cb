"""Lease control (SPEC R-LC-*, §7.11) and completion (R-W-6), asserting on rows."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest
from qinglong_control.db.lease_control import complete_attempt, control_lease
from qinglong_control.db.start_facts import (
    acknowledge_running,
    acknowledge_starting,
    report_start_failure,
)
from qinglong_control.domain.capability import parse_digest
from qinglong_control.domain.completion import CompletionReport
from qinglong_control.domain.lease_control import LeaseAnswer
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.domain.start_facts import RunningReport
from qinglong_control.domain.states import AttemptState, RunState

from tests.support.world import ClaimedWork, World, with_version

REPORT = RunningReport("pid:4242;start:1700000000", None, 3, parse_digest("ab" * 32))


async def running(world: World, timeout_ms: int | None = 60_000) -> ClaimedWork:
    work = await world.claimed(timeout_ms=timeout_ms)
    await acknowledge_starting(world.conn, work.fence)
    await acknowledge_running(world.conn, work.fence, REPORT)
    return work


async def lease_row(world: World, work: ClaimedWork) -> tuple[Any, ...]:
    cursor = await world.conn.execute(
        "SELECT l.version, l.status, l.expires_at_ms - l.renewed_at_ms, a.lease_version,"
        " r.cancel_reason, r.event_sequence, r.state"
        " FROM qinglong.run_leases l JOIN qinglong.attempts a USING (attempt_id)"
        " JOIN qinglong.runs r ON r.run_id = l.run_id WHERE l.attempt_id = %s",
        (work.fence.attempt_id,),
    )
    row = await cursor.fetchone()
    assert row is not None
    return row


async def events(world: World, work: ClaimedWork) -> list[str]:
    cursor = await world.conn.execute(
        "SELECT event_type FROM qinglong.run_events WHERE run_id = %s ORDER BY sequence",
        (work.fence.run_id,),
    )
    return [row[0] for row in await cursor.fetchall()]


async def test_renewal_advances_version_and_fences_the_old_one(world: World) -> None:
    work = await running(world)
    decision = await control_lease(world.conn, work.fence, world.timings)
    assert decision.answer is LeaseAnswer.RENEWED
    assert decision.new_lease_version == 2
    version, status, ttl, projected, *_ = await lease_row(world, work)
    assert (version, status, ttl, projected) == (2, "leased", world.timings.lease_ttl_ms, 2)
    again = await control_lease(world.conn, with_version(work.fence, 2), world.timings)
    assert again.new_lease_version == 3
    before = await lease_row(world, work)
    for stale in (1, 4):  # two renewals behind, or ahead of the present
        with pytest.raises(Refused) as fenced:
            await control_lease(world.conn, with_version(work.fence, stale), world.timings)
        assert fenced.value.reason is Reason.LEASE_VERSION_FENCED
    assert await lease_row(world, work) == before


async def test_lost_renewal_answer_is_replayed_without_advancing(world: World) -> None:
    """R-LC-8: the same request again after its answer was lost gets the same version."""
    work = await running(world)
    first = await control_lease(world.conn, work.fence, world.timings)
    after_first = await lease_row(world, work)
    history = await events(world, work)
    replayed = await control_lease(world.conn, work.fence, world.timings)  # still expects 1
    assert (replayed.answer, replayed.new_lease_version) == (LeaseAnswer.RENEWED, 2)
    assert replayed.replayed
    assert not first.replayed
    assert replayed.lease_expires_at_ms is not None
    assert await lease_row(world, work) == after_first  # no second renewal, no drift
    assert await events(world, work) == history
    # A cancel that arrived meanwhile is part of the present projection.
    await world.conn.execute(
        "UPDATE qinglong.runs SET cancel_requested_at_ms = qinglong.db_now_ms(),"
        " cancel_reason = 'user' WHERE run_id = %s",
        (work.fence.run_id,),
    )
    stop = await control_lease(world.conn, work.fence, world.timings)
    assert (stop.answer, stop.new_lease_version, stop.cancel_reason) == (
        LeaseAnswer.STOP_REQUESTED,
        2,
        "user",
    )
    assert (await lease_row(world, work))[0] == 2


async def test_renewal_replay_needs_the_same_authority_and_a_live_lease(world: World) -> None:
    work = await running(world)
    await control_lease(world.conn, work.fence, world.timings)
    forged = replace(work.fence, token_digest=parse_digest("cd" * 32))
    with pytest.raises(Refused) as wrong_token:
        await control_lease(world.conn, forged, world.timings)
    assert wrong_token.value.reason is Reason.LEASE_TOKEN_MISMATCH
    # The lease ran out: the replay is not answered as a renewal.
    await world.conn.execute(
        "UPDATE qinglong.run_leases SET expires_at_ms = qinglong.db_now_ms() - 1,"
        " renewed_at_ms = qinglong.db_now_ms() - 1 WHERE attempt_id = %s",
        (work.fence.attempt_id,),
    )
    before = await lease_row(world, work)
    with pytest.raises(Refused) as expired:
        await control_lease(world.conn, work.fence, world.timings)
    assert expired.value.reason is Reason.LEASE_VERSION_FENCED
    assert await lease_row(world, work) == before


async def test_existing_cancel_intent_renews_and_asks_to_stop(world: World) -> None:
    work = await running(world)
    await world.conn.execute(
        "UPDATE qinglong.runs SET cancel_requested_at_ms = qinglong.db_now_ms(),"
        " cancel_reason = 'user' WHERE run_id = %s",
        (work.fence.run_id,),
    )
    decision = await control_lease(world.conn, work.fence, world.timings)
    assert (decision.answer, decision.cancel_reason) == (LeaseAnswer.STOP_REQUESTED, "user")
    assert (await lease_row(world, work))[0] == 2  # renewed, so the Worker can stop


async def test_passed_deadline_becomes_a_durable_timeout_intent(world: World) -> None:
    work = await world.claimed(timeout_ms=1)
    await acknowledge_starting(world.conn, work.fence)
    await acknowledge_running(world.conn, work.fence, REPORT)
    await asyncio.sleep(0.01)  # past the 1 ms deadline on the database's clock
    sequence_before = (await lease_row(world, work))[5]
    decision = await control_lease(world.conn, work.fence, world.timings)
    assert (decision.answer, decision.cancel_reason) == (LeaseAnswer.STOP_REQUESTED, "timeout")
    _, _, _, _, reason, sequence, _ = await lease_row(world, work)
    assert (reason, sequence) == ("timeout", sequence_before + 1)
    assert (await events(world, work))[-1] == "run.cancel_requested"
    # The next renewal sees the intent and does not append another Event.
    await control_lease(world.conn, with_version(work.fence, 2), world.timings)
    assert (await events(world, work)).count("run.cancel_requested") == 1
    # The Worker stops and reports timed_out, which the intent allows.
    done = await complete_attempt(
        world.conn,
        with_version(work.fence, 3),
        CompletionReport(3, "timed_out", None, "stopped at deadline"),
    )
    assert (done.run_state, done.error_code) == (RunState.TIMED_OUT, "EXECUTION_TIMED_OUT")


async def test_terminal_run_answers_its_exact_projection(world: World) -> None:
    work = await world.claimed()
    await acknowledge_starting(world.conn, work.fence)
    await report_start_failure(world.conn, work.fence, "exec failed")
    # The Worker lost the answer and still holds version 1: it learns the terminal facts.
    decision = await control_lease(world.conn, work.fence, world.timings)
    assert decision.answer is LeaseAnswer.TERMINAL
    assert decision.terminal == (RunState.FAILED, AttemptState.FAILED, "EXECUTOR_START_FAILED")
    with pytest.raises(Refused):  # a wrong token learns nothing
        await control_lease(
            world.conn, replace(work.fence, token_digest=parse_digest("cd" * 32)), world.timings
        )


async def test_completion_terminates_once_and_replays_exactly(world: World) -> None:
    work = await running(world)
    report = CompletionReport(3, "succeeded", 0, "ok")
    first = await complete_attempt(world.conn, work.fence, report)
    assert (first.run_state, first.completed_lease_version, first.replayed) == (
        RunState.SUCCEEDED,
        2,
        False,
    )
    history = await events(world, work)
    assert history[-2:] == ["attempt.succeeded", "run.succeeded"]
    replay = await complete_attempt(world.conn, work.fence, report)
    assert replay.replayed
    assert replay.finished_at_ms == first.finished_at_ms
    assert await events(world, work) == history
    with pytest.raises(Refused) as mismatch:
        await complete_attempt(world.conn, work.fence, replace(report, exit_code=1))
    assert mismatch.value.reason is Reason.REPLAY_MISMATCH
    version, status, *_ = await lease_row(world, work)
    assert (version, status) == (2, "completed")


async def test_completion_needs_the_current_callback_sequence_and_a_real_stop_reason(
    world: World,
) -> None:
    work = await running(world)
    with pytest.raises(Refused) as stale:
        await complete_attempt(world.conn, work.fence, CompletionReport(2, "failed", 1, ""))
    assert stale.value.reason is Reason.CALLBACK_SEQUENCE_FENCED
    with pytest.raises(Refused) as unasked:
        await complete_attempt(world.conn, work.fence, CompletionReport(3, "cancelled", None, ""))
    assert unasked.value.reason is Reason.STATE_CONFLICT
    assert (await lease_row(world, work))[6] == "running"
