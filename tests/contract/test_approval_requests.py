"""Approval requests in the database (SPEC R-OPS-2), on PostgreSQL 16 and 18: a request is
decided once — by the transaction's locks when two people decide at the same moment, and
by the table's trigger against any later write — and approving runs the held cancel as
the approver, under R-CAN-3's binding fence."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import LiteralString

import psycopg
import pytest
from qinglong.control.v1 import run_service_pb2
from qinglong_control.db import approvals
from qinglong_control.db.events import Actor
from qinglong_control.db.identities import bind_role, enroll_operator_token
from qinglong_control.domain.approvals import PENDING_APPROVALS_PER_CALLER, Decision, HeldCall
from qinglong_control.domain.cancellation import BindingSnapshot
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.held_mutations import HELD_MUTATIONS

from tests.support.locks import until_waiting
from tests.support.postgres import MigratedDatabase
from tests.support.seed import digest
from tests.support.world import PROJECT, World

CANCEL = next(iter(HELD_MUTATIONS))
AS_OPERATOR = BindingSnapshot(project_version=1, binding_version=1, role="operator")
DAY_MS = 86_400_000
APPROVE, DENY = Decision.APPROVE, Decision.DENY


@pytest.fixture
def people(database: MigratedDatabase) -> Iterator[dict[str, uuid.UUID]]:
    """An Agent that asks, two operators who decide."""
    with psycopg.connect(database.urls.migration, autocommit=True) as admin:
        found = {}
        for name, kind in (("bot", "agent"), ("alice", "user"), ("carol", "user")):
            found[name] = enroll_operator_token(admin, name, kind, digest(f"qlo1_{name}"))  # type: ignore[arg-type]
            bind_role(admin, PROJECT, found[name], "operator")
        yield found


async def held(world: World, people: dict[str, uuid.UUID]) -> tuple[uuid.UUID, uuid.UUID]:
    run_id = await world.queued_run()
    request = run_service_pb2.CancelRunRequest(
        project_id=PROJECT, run_id=str(run_id), mutation_id="m-1"
    ).SerializeToString()
    call = HeldCall(
        project_id=PROJECT,
        method=CANCEL,
        request_type="qinglong.control.v1.CancelRunRequest",
        request=request,
        run_id=run_id,
        requested_by=people["bot"],
        requested_by_kind="agent",
        audit_id=uuid.uuid4(),
    )
    outcome = await approvals.hold(
        world.conn, call, DAY_MS, Actor("agent", str(people["bot"])), HELD_MUTATIONS[CANCEL]
    )
    assert outcome.approval_id is not None
    approval_id = outcome.approval_id
    return run_id, approval_id


def decision(
    approval_id: uuid.UUID, who: uuid.UUID, what: Decision, snapshot: BindingSnapshot = AS_OPERATOR
) -> approvals.DecideApproval:
    return approvals.DecideApproval(
        project_id=PROJECT,
        approval_id=approval_id,
        decision=what,
        decider=Actor("user", str(who)),
        decider_id=who,
        snapshot=snapshot,
        note=None,
    )


async def test_two_people_deciding_at_once_make_one_decision(
    database: MigratedDatabase, world: World, people: dict[str, uuid.UUID]
) -> None:
    run_id, approval_id = await held(world, people)
    hold = "SELECT 1 FROM qinglong.approval_requests WHERE approval_id = %s FOR UPDATE"
    async with (
        await psycopg.AsyncConnection.connect(database.urls.runtime, autocommit=True) as one,
        await psycopg.AsyncConnection.connect(database.urls.runtime, autocommit=True) as two,
        await psycopg.AsyncConnection.connect(database.urls.runtime, autocommit=True) as gate,
        await psycopg.AsyncConnection.connect(database.admin_url, autocommit=True) as observer,
    ):
        async with gate.transaction():  # both decisions are in flight before either runs
            await gate.execute(hold, (approval_id,))
            racing = asyncio.gather(
                approvals.decide(
                    one, decision(approval_id, people["alice"], Decision.APPROVE), HELD_MUTATIONS
                ),
                approvals.decide(
                    two, decision(approval_id, people["carol"], Decision.DENY), HELD_MUTATIONS
                ),
                return_exceptions=True,
            )
            await until_waiting(observer, 2)  # both wait on the request's row lock
        outcomes = await racing
    refused = [o for o in outcomes if isinstance(o, Refused)]
    assert len(refused) == 1, outcomes
    assert refused[0].reason is Reason.APPROVAL_NOT_PENDING
    view = await approvals.get_approval(world.conn, PROJECT, approval_id)
    cursor = await world.conn.execute(
        "SELECT cancel_reason FROM qinglong.runs WHERE run_id = %s", (run_id,)
    )
    cancelled = (await cursor.fetchone()) == ("user",)
    events = await world.conn.execute(
        "SELECT event_type FROM qinglong.run_events WHERE run_id = %s AND event_type LIKE 'run.%%'"
        " ORDER BY sequence",
        (run_id,),
    )
    types = [row[0] for row in await events.fetchall()]
    print(f"\nconcurrent approve/deny: {view.state} won, run cancelled: {cancelled}, {types}")
    if view.state == "approved":
        assert cancelled
        assert types[-3:] == [
            "run.approval_requested",
            "run.approval_approved",
            "run.cancel_requested",
        ]
    else:
        assert view.state == "denied"
        assert not cancelled
        assert types[-2:] == ["run.approval_requested", "run.approval_denied"]


async def test_a_changed_binding_fences_the_approval_before_any_write(
    world: World, people: dict[str, uuid.UUID]
) -> None:
    _, approval_id = await held(world, people)
    stale = BindingSnapshot(project_version=1, binding_version=0, role="operator")
    with pytest.raises(Refused) as fenced:
        await approvals.decide(
            world.conn,
            decision(approval_id, people["alice"], Decision.APPROVE, stale),
            HELD_MUTATIONS,
        )
    assert fenced.value.reason is Reason.ROLE_BINDING_FENCED
    assert (await approvals.get_approval(world.conn, PROJECT, approval_id)).state == "pending"
    # The requester cannot decide its own request, whatever its role.
    with pytest.raises(Refused) as own:
        await approvals.decide(
            world.conn, decision(approval_id, people["bot"], Decision.APPROVE), HELD_MUTATIONS
        )
    assert own.value.reason is Reason.PERMISSION_DENIED


async def test_a_decider_disabled_after_admission_is_fenced(
    world: World, people: dict[str, uuid.UUID], database: MigratedDatabase
) -> None:
    _, approval_id = await held(world, people)
    with psycopg.connect(database.urls.migration, autocommit=True) as admin:
        admin.execute(
            "UPDATE qinglong.principals SET status = 'disabled' WHERE principal_id = %s",
            (people["alice"],),
        )
    with pytest.raises(Refused) as fenced:
        await approvals.decide(
            world.conn, decision(approval_id, people["alice"], APPROVE), HELD_MUTATIONS
        )
    assert fenced.value.reason is Reason.ROLE_BINDING_FENCED
    assert (await approvals.get_approval(world.conn, PROJECT, approval_id)).state == "pending"


async def test_a_decided_request_never_changes_again(
    database: MigratedDatabase, world: World, people: dict[str, uuid.UUID]
) -> None:
    _, pending = await held(world, people)
    _, decided = await held(world, people)  # a second held cancel, of another Run
    await approvals.decide(
        world.conn, decision(decided, people["alice"], Decision.DENY), HELD_MUTATIONS
    )
    with psycopg.connect(database.urls.migration, autocommit=True) as owner:
        for statement, approval_id in (
            # Re-opening or re-deciding a decided request.
            ("UPDATE qinglong.approval_requests SET state = 'pending', decided_by = NULL,"
             " decided_at_ms = NULL WHERE approval_id = %s", decided),
            # Changing what was asked while it waits.
            ("UPDATE qinglong.approval_requests SET request = '\\x00'::bytea"
             " WHERE approval_id = %s", pending),
        ):  # fmt: skip
            with pytest.raises(psycopg.errors.CheckViolation) as refused:
                owner.execute(statement.encode(), (approval_id,))
            assert refused.value.diag.constraint_name == "approval_requests_final"


async def test_a_full_last_page_of_approvals_hands_out_no_token(
    world: World, people: dict[str, uuid.UUID]
) -> None:
    """As ListRuns and ListTasks: the last page's token is empty even when the page is
    full (the contract), and a full page that is not the last leads to the rest."""
    held_ids = [(await held(world, people))[1] for _ in range(3)]
    whole = await approvals.list_approvals(world.conn, PROJECT, limit=3)
    assert (len(whole.approvals), whole.next_cursor) == (3, None)
    first = await approvals.list_approvals(world.conn, PROJECT, limit=2)
    assert first.next_cursor is not None
    rest = await approvals.list_approvals(world.conn, PROJECT, limit=2, before=first.next_cursor)
    assert rest.next_cursor is None
    listed = [a.approval_id for a in first.approvals + rest.approvals]
    assert sorted(listed) == sorted(held_ids)


async def _hold_cancel(
    world: World, run_id: uuid.UUID, who: uuid.UUID, mutation_id: str, ttl_ms: int = DAY_MS
) -> approvals.Held:
    call = HeldCall(
        project_id=PROJECT,
        method=CANCEL,
        request_type="qinglong.control.v1.CancelRunRequest",
        request=run_service_pb2.CancelRunRequest(
            project_id=PROJECT, run_id=str(run_id), mutation_id=mutation_id
        ).SerializeToString(),
        run_id=run_id,
        requested_by=who,
        requested_by_kind="agent",
        audit_id=uuid.uuid4(),
    )
    return await approvals.hold(
        world.conn, call, ttl_ms, Actor("agent", str(who)), HELD_MUTATIONS[CANCEL]
    )


async def _count(world: World, query: LiteralString, value: uuid.UUID) -> int:
    async with world.conn.cursor() as cursor:
        await cursor.execute(query, (value,))
        row = await cursor.fetchone()
    assert row is not None
    return int(row[0])


async def _pending_of(world: World, who: uuid.UUID) -> int:
    return await _count(
        world,
        "SELECT count(*) FROM qinglong.approval_requests"
        " WHERE requested_by = %s AND state = 'pending'",
        who,
    )


async def _event_count(world: World, run_id: uuid.UUID) -> int:
    return await _count(world, "SELECT count(*) FROM qinglong.run_events WHERE run_id = %s", run_id)


async def test_a_caller_may_have_only_so_many_requests_waiting(
    world: World, people: dict[str, uuid.UUID]
) -> None:
    """The limit refuses a new request, and changes nothing; a retry of one already held,
    another caller, and the same caller once one was decided are all still answered."""
    run_id = await world.queued_run()
    bot = people["bot"]
    first = await _hold_cancel(world, run_id, bot, "m-0")
    for n in range(1, PENDING_APPROVALS_PER_CALLER):
        assert (await _hold_cancel(world, run_id, bot, f"m-{n}")).approval_id is not None
    assert await _pending_of(world, bot) == PENDING_APPROVALS_PER_CALLER
    events = await _event_count(world, run_id)
    with pytest.raises(Refused) as refused:
        await _hold_cancel(world, run_id, bot, "one-too-many")
    assert refused.value.reason is Reason.RATE_LIMITED
    assert str(PENDING_APPROVALS_PER_CALLER) in str(refused.value)
    assert await _pending_of(world, bot) == PENDING_APPROVALS_PER_CALLER
    assert await _event_count(world, run_id) == events, "the refusal appended an Event"
    # A retry of a held call is its first answer, whatever the count.
    assert (await _hold_cancel(world, run_id, bot, "m-0")).approval_id == first.approval_id
    # The limit is the caller's own.
    assert (await _hold_cancel(world, run_id, people["carol"], "c-0")).approval_id is not None
    # One decided: room for one more.
    assert first.approval_id is not None
    await approvals.decide(
        world.conn, decision(first.approval_id, people["alice"], DENY), HELD_MUTATIONS
    )
    assert (await _hold_cancel(world, run_id, bot, "one-more")).approval_id is not None
    with pytest.raises(Refused):
        await _hold_cancel(world, run_id, bot, "and-one-too-many")


async def test_a_request_past_its_expiry_no_longer_counts(
    world: World, people: dict[str, uuid.UUID]
) -> None:
    """Expired by the clock, before the reconciler records it: it waits no more, as the
    approvals' projection already shows it."""
    run_id = await world.queued_run()
    bot = people["bot"]
    for n in range(1, PENDING_APPROVALS_PER_CALLER):
        await _hold_cancel(world, run_id, bot, f"m-{n}")
    await _hold_cancel(world, run_id, bot, "short", ttl_ms=1_000)  # the last one
    with pytest.raises(Refused):
        await _hold_cancel(world, run_id, bot, "one-too-many")
    await asyncio.sleep(1.2)
    assert await _pending_of(world, bot) == PENDING_APPROVALS_PER_CALLER  # not swept yet
    assert (await _hold_cancel(world, run_id, bot, "one-too-many")).approval_id is not None
