"""SPEC §7 items 1 to 10 on the three start facts, asserting on rows, not only answers."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from qinglong_control.db.start_facts import (
    acknowledge_running,
    acknowledge_starting,
    report_start_failure,
)
from qinglong_control.domain.capability import parse_digest
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.domain.start_facts import RunningOutcome, RunningReport, StartingOutcome

from tests.support import timelines
from tests.support.world import World

CALLBACK_DIGEST = parse_digest("ab" * 32)


def report(handle: str = "pid:4242;start:1700000000") -> RunningReport:
    return RunningReport(handle, "log-1", 7, CALLBACK_DIGEST)


async def rows(world: World, work: Any) -> dict[str, Any]:
    cursor = await world.conn.execute(
        "SELECT r.state, r.version, r.event_sequence, a.state, l.status, l.version,"
        " a.lease_version, r.deadline_at_ms, a.deadline_at_ms"
        " FROM qinglong.runs r JOIN qinglong.attempts a ON a.run_id = r.run_id"
        " JOIN qinglong.run_leases l ON l.attempt_id = a.attempt_id WHERE a.attempt_id = %s",
        (work.fence.attempt_id,),
    )
    row = await cursor.fetchone()
    assert row is not None
    keys = [
        "run_state",
        "run_version",
        "event_sequence",
        "attempt_state",
        "lease_status",
        "lease_version",
        "attempt_lease_version",
        "run_deadline",
        "attempt_deadline",
    ]
    return dict(zip(keys, row, strict=True))


async def event_types(world: World, work: Any) -> list[str]:
    cursor = await world.conn.execute(
        "SELECT event_type FROM qinglong.run_events WHERE run_id = %s ORDER BY sequence",
        (work.fence.run_id,),
    )
    return [row[0] for row in await cursor.fetchall()]


async def test_claim_starting_running_happy_path(world: World) -> None:
    work = await world.claimed()
    assert (await rows(world, work))["attempt_state"] == "claimed"
    starting = await acknowledge_starting(world.conn, work.fence)
    assert starting.outcome is StartingOutcome.STARTING
    after_starting = await rows(world, work)
    assert after_starting["attempt_state"] == "starting"
    assert after_starting["run_state"] == "dispatching"
    assert starting.deadline_at_ms is not None
    assert after_starting["attempt_deadline"] == starting.deadline_at_ms
    assert after_starting["run_deadline"] == starting.deadline_at_ms
    running = await acknowledge_running(world.conn, work.fence, report())
    assert running.outcome is RunningOutcome.RUNNING
    after_running = await rows(world, work)
    assert (after_running["run_state"], after_running["attempt_state"]) == ("running", "running")
    # ACKs never advance the lease version (R-ACK-7).
    assert after_running["lease_version"] == 1
    assert await event_types(world, work) == list(timelines.UNTIL_RUNNING)


async def test_running_without_starting_is_rejected(world: World) -> None:
    """SPEC §7.1"""
    work = await world.claimed()
    before = await rows(world, work)
    with pytest.raises(Refused) as refused:
        await acknowledge_running(world.conn, work.fence, report())
    assert refused.value.reason is Reason.STARTING_REQUIRED
    assert await rows(world, work) == before


async def test_exact_replays_are_idempotent_and_conflicting_handle_rejected(world: World) -> None:
    """SPEC §7.2"""
    work = await world.claimed()
    await acknowledge_starting(world.conn, work.fence)
    replay = await acknowledge_starting(world.conn, work.fence)
    assert replay.outcome is StartingOutcome.ALREADY_STARTING
    first = await acknowledge_running(world.conn, work.fence, report())
    again = await acknowledge_running(world.conn, work.fence, report())
    assert again.outcome is RunningOutcome.ALREADY_RUNNING
    assert again.started_at_ms == first.started_at_ms
    late_starting = await acknowledge_starting(world.conn, work.fence)
    assert late_starting.outcome is StartingOutcome.ALREADY_RUNNING
    before = await rows(world, work)
    with pytest.raises(Refused) as refused:
        await acknowledge_running(world.conn, work.fence, report(handle="pid:9999;start:1"))
    assert refused.value.reason is Reason.REPLAY_MISMATCH
    assert await rows(world, work) == before
    assert len(await event_types(world, work)) == 6


async def test_wrong_token_session_replacement_and_expiry_never_change_a_run(
    world: World,
) -> None:
    """SPEC §7.4"""
    work = await world.claimed()
    before = await rows(world, work)
    wrong_token = replace(work.fence, token_digest=parse_digest("cd" * 32))
    with pytest.raises(Refused) as refused:
        await acknowledge_starting(world.conn, wrong_token)
    assert refused.value.reason is Reason.LEASE_TOKEN_MISMATCH
    await world.session("worker-a")  # a new generation replaces the session
    with pytest.raises(Refused) as refused:
        await acknowledge_starting(world.conn, work.fence)
    assert refused.value.reason is Reason.SESSION_FENCED
    assert await rows(world, work) == before


async def test_start_failure_commits_everything_together(world: World) -> None:
    """SPEC §7.5"""
    work = await world.claimed()
    await acknowledge_starting(world.conn, work.fence)
    decision = await report_start_failure(world.conn, work.fence, "exec: no such file")
    assert decision.completed_lease_version == 2
    assert not decision.replayed
    after = await rows(world, work)
    assert (after["run_state"], after["attempt_state"]) == ("failed", "failed")
    assert (after["lease_status"], after["lease_version"]) == ("completed", 2)
    assert after["attempt_lease_version"] == 2
    assert (await event_types(world, work))[-2:] == ["attempt.failed", "run.failed"]


async def test_start_failure_lost_response_replay(world: World) -> None:
    """SPEC §7.9"""
    work = await world.claimed()
    await acknowledge_starting(world.conn, work.fence)
    first = await report_start_failure(world.conn, work.fence, "boom")
    events = await event_types(world, work)
    replay = await report_start_failure(world.conn, work.fence, "boom")
    assert replay.replayed
    assert (replay.run_state, replay.error_code) == (first.run_state, first.error_code)
    assert await event_types(world, work) == events
    with pytest.raises(Refused):
        await report_start_failure(
            world.conn, replace(work.fence, token_digest=parse_digest("ef" * 32)), "boom"
        )
