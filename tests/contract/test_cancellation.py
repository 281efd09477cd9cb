"""User cancellation (SPEC R-CAN-3/4, §7.12): accepted, replay, Event, binding fence."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from qinglong_control.db.cancellation import CancelRequest, cancel_run
from qinglong_control.db.events import Actor
from qinglong_control.db.identities import (
    bind_role,
    enroll_operator_token,
    ensure_project,
    revoke_role,
)
from qinglong_control.domain.cancellation import BindingSnapshot, CancelOutcome
from qinglong_control.domain.refusals import Reason, Refused

from tests.support.postgres import MigratedDatabase
from tests.support.seed import digest
from tests.support.world import PROJECT, World

ADMITTED_AS_OPERATOR = BindingSnapshot(project_version=1, binding_version=1, role="operator")


@pytest.fixture
def alice(database: MigratedDatabase) -> Iterator[uuid.UUID]:
    with psycopg.connect(database.urls.migration, autocommit=True) as admin:
        principal = enroll_operator_token(admin, "alice", "user", digest("qlo1_alice"))
        bind_role(admin, PROJECT, principal, "operator")
        yield principal


def request(
    run_id: uuid.UUID, alice: uuid.UUID, mutation: str = "m-1", **changes: Any
) -> CancelRequest:
    return CancelRequest(
        project_id=changes.get("project_id", PROJECT),
        run_id=run_id,
        mutation_id=mutation,
        actor=Actor("user", str(alice)),
        principal_id=alice,
        snapshot=changes.get("snapshot", ADMITTED_AS_OPERATOR),
    )


async def run_row(world: World, run_id: uuid.UUID) -> tuple[Any, ...]:
    cursor = await world.conn.execute(
        "SELECT state, cancel_reason, cancel_requested_by, version, event_sequence"
        " FROM qinglong.runs WHERE run_id = %s",
        (run_id,),
    )
    row = await cursor.fetchone()
    assert row is not None
    return row


async def test_accepted_then_exact_replay_with_one_actor_bound_event(
    world: World, alice: uuid.UUID
) -> None:
    run_id = await world.queued_run()
    before = await run_row(world, run_id)
    assert await cancel_run(world.conn, request(run_id, alice)) is CancelOutcome.ACCEPTED
    state, reason, by, version, sequence = await run_row(world, run_id)
    assert (state, reason, by) == ("queued", "user", str(alice))
    assert (version, sequence) == (before[3] + 1, before[4] + 1)
    again = await cancel_run(world.conn, request(run_id, alice))
    assert again is CancelOutcome.ALREADY_REQUESTED
    other_mutation = await cancel_run(world.conn, request(run_id, alice, "m-2"))
    assert other_mutation is CancelOutcome.ALREADY_REQUESTED
    cursor = await world.conn.execute(
        "SELECT event_type, actor_kind, actor_id, payload->>'reason', attempt_id"
        " FROM qinglong.run_events WHERE run_id = %s AND event_type = 'run.cancel_requested'",
        (run_id,),
    )
    assert await cursor.fetchall() == [("run.cancel_requested", "user", str(alice), "user", None)]
    assert (await run_row(world, run_id))[3:] == (version, sequence)


async def test_a_revoked_or_changed_binding_fences_before_any_run_write(
    world: World, alice: uuid.UUID, database: MigratedDatabase
) -> None:
    run_id = await world.queued_run()
    before = await run_row(world, run_id)
    with psycopg.connect(database.urls.migration, autocommit=True) as admin:
        revoke_role(admin, PROJECT, alice)
    with pytest.raises(Refused) as revoked:
        await cancel_run(world.conn, request(run_id, alice))
    assert revoked.value.reason is Reason.ROLE_BINDING_FENCED
    with psycopg.connect(database.urls.migration, autocommit=True) as admin:
        bind_role(admin, PROJECT, alice, "operator")  # active again, but at version 3
    with pytest.raises(Refused) as drifted:
        await cancel_run(world.conn, request(run_id, alice))
    assert drifted.value.reason is Reason.ROLE_BINDING_FENCED
    assert await run_row(world, run_id) == before


async def test_another_projects_run_and_a_missing_run_are_not_found(
    world: World, alice: uuid.UUID, database: MigratedDatabase
) -> None:
    run_id = await world.queued_run()
    with psycopg.connect(database.urls.migration, autocommit=True) as admin:
        ensure_project(admin, "proj-b", "B")
        bind_role(admin, "proj-b", alice, "owner")
    elsewhere = BindingSnapshot(project_version=1, binding_version=1, role="owner")
    for target in (
        request(run_id, alice, project_id="proj-b", snapshot=elsewhere),
        request(uuid.uuid4(), alice),
    ):
        with pytest.raises(Refused) as missing:
            await cancel_run(world.conn, target)
        assert missing.value.reason is Reason.RUN_NOT_FOUND


async def test_a_terminal_run_is_already_terminal(world: World, alice: uuid.UUID) -> None:
    run_id = await world.queued_run()
    await world.conn.execute(
        "UPDATE qinglong.runs SET state = 'cancelled', finished_at_ms = qinglong.db_now_ms()"
        " WHERE run_id = %s",
        (run_id,),
    )
    assert await cancel_run(world.conn, request(run_id, alice)) is CancelOutcome.ALREADY_TERMINAL


async def test_a_caller_disabled_after_admission_is_fenced(
    world: World, alice: uuid.UUID, database: MigratedDatabase
) -> None:
    # Ingress admitted alice (her binding is still active, at the admitted version); an
    # administrator disables her before control's transaction.
    run_id = await world.queued_run()
    before = await run_row(world, run_id)
    with psycopg.connect(database.urls.migration, autocommit=True) as admin:
        admin.execute(
            "UPDATE qinglong.principals SET status = 'disabled' WHERE principal_id = %s", (alice,)
        )
    with pytest.raises(Refused) as disabled:
        await cancel_run(world.conn, request(run_id, alice))
    assert disabled.value.reason is Reason.ROLE_BINDING_FENCED
    assert "no longer active" in disabled.value.detail
    assert await run_row(world, run_id) == before
