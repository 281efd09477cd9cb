"""Approvals end to end (SPEC R-OPS-2) on the real stack: an Agent's cancel is held as a
durable request; a person approves it (the cancel then happens as them, re-checked as
their own call would be), denies it, or lets it expire; the Run's Events and the audit
record every step. Real parts only: control and ingress over mutual TLS, each with its
own PostgreSQL role, bearer tokens, and the reconciler's real cycle."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import psycopg
import pytest
from psycopg import sql
from qinglong.control.v1 import (
    approval_pb2,
    approval_service_pb2,
    approval_service_pb2_grpc,
    run_service_pb2,
    run_service_pb2_grpc,
)
from qinglong.rpc.v1 import lifecycle_pb2
from qinglong_control.db.identities import bind_role, ensure_project
from qinglong_control.db.pool import open_runtime_pool
from qinglong_control.domain.approvals import PENDING_APPROVALS_PER_CALLER
from qinglong_control.domain.timings import Timings
from qinglong_control.reconciler import Reconciler, ReconcilerLimits
from qinglong_ingress.stages import Call, Verdict
from qinglong_protocol.errors import error_reason_of
from qinglong_protocol.pooling import PoolSizing

from tests.support.calls import failure
from tests.support.calls import queued_run as queued_run_through
from tests.support.postgres import MigratedDatabase
from tests.support.stack import PROJECT, Stack, bearer, running_stack

aps = approval_service_pb2
PENDING, APPROVED = approval_pb2.APPROVAL_STATE_PENDING, approval_pb2.APPROVAL_STATE_APPROVED
DENIED, EXPIRED = approval_pb2.APPROVAL_STATE_DENIED, approval_pb2.APPROVAL_STATE_EXPIRED


class Operator:
    """The stubs an operator uses, as one named principal."""

    def __init__(self, stack: Stack, channel: grpc.aio.Channel, name: str) -> None:
        self.meta = bearer(stack, name)
        self.runs = run_service_pb2_grpc.RunServiceStub(channel)
        self.approvals = approval_service_pb2_grpc.ApprovalServiceStub(channel)

    async def cancel(self, run_id: str, mutation_id: str = "stop-1") -> Any:
        return await self.runs.CancelRun(
            run_service_pb2.CancelRunRequest(
                project_id=PROJECT, run_id=run_id, mutation_id=mutation_id
            ),
            metadata=self.meta,
        )

    async def approve(self, approval_id: str, note: str = "") -> Any:
        return await self.approvals.Approve(
            aps.ApproveRequest(project_id=PROJECT, approval_id=approval_id, note=note),
            metadata=self.meta,
        )

    async def deny(self, approval_id: str, note: str = "") -> Any:
        return await self.approvals.Deny(
            aps.DenyRequest(project_id=PROJECT, approval_id=approval_id, note=note),
            metadata=self.meta,
        )

    async def get(self, approval_id: str) -> approval_pb2.Approval:
        got = await self.approvals.GetApproval(
            aps.GetApprovalRequest(project_id=PROJECT, approval_id=approval_id),
            metadata=self.meta,
        )
        return got.approval

    async def run(self, run_id: str) -> Any:
        got = await self.runs.GetRun(
            run_service_pb2.GetRunRequest(project_id=PROJECT, run_id=run_id), metadata=self.meta
        )
        return got.run

    async def events(self, run_id: str) -> list[Any]:
        page = await self.runs.ListRunEvents(
            run_service_pb2.ListRunEventsRequest(project_id=PROJECT, run_id=run_id),
            metadata=self.meta,
        )
        return list(page.events)


@asynccontextmanager
async def operators(stack: Stack) -> AsyncIterator[dict[str, Operator]]:
    async with stack.channel(stack.operator_identity("ops")) as channel:
        yield {name: Operator(stack, channel, name) for name in ("alice", "vera", "bot")}


async def held_cancel(stack: Stack, people: dict[str, Operator]) -> tuple[str, str]:
    """A queued Run and the Agent's held request to cancel it: (run id, approval id)."""
    async with stack.channel(stack.operator_identity("ops")) as channel:
        run_id = await queued_run_through(channel, bearer(stack, "alice"), PROJECT)
    answer = await people["bot"].cancel(run_id)
    assert answer.outcome == run_service_pb2.CANCEL_RUN_OUTCOME_REQUIRE_APPROVAL
    assert not answer.HasField("run")
    return run_id, answer.approval_id


def approval_events(events: list[Any]) -> list[tuple[str, str, str]]:
    """(type, actor, approval id) of the Events about approvals and cancellation."""
    return [
        (
            event.type,
            event.actor_name or event.actor_id,
            event.approval_changed.approval_id or event.cancel_requested.approval_id,
        )
        for event in events
        if event.type.startswith("run.approval_") or event.type == "run.cancel_requested"
    ]


async def test_an_agents_cancel_is_held_and_runs_as_the_approver(stack: Stack) -> None:
    async with operators(stack) as people:
        run_id, approval_id = await held_cancel(stack, people)
        # An exact retry of the held call names the same request; nothing ran yet.
        again = await people["bot"].cancel(run_id)
        assert again.approval_id == approval_id
        assert not (await people["alice"].run(run_id)).HasField("cancel_intent")

        listed = await people["vera"].approvals.ListApprovals(
            aps.ListApprovalsRequest(project_id=PROJECT, states=[PENDING]),
            metadata=people["vera"].meta,
        )
        [pending] = [a for a in listed.approvals if a.approval_id == approval_id]
        assert (pending.state, pending.run_id, pending.requested_by_name) == (
            PENDING,
            run_id,
            "bot",
        )
        assert pending.method == "/qinglong.control.v1.RunService/CancelRun"
        held = run_service_pb2.CancelRunRequest()
        assert pending.request.Unpack(held)
        assert (held.run_id, held.mutation_id) == (run_id, "stop-1")
        assert pending.expires_at.ToMilliseconds() > pending.requested_at.ToMilliseconds()

        # A viewer may read but not decide; an Agent may not decide at all.
        for name in ("vera", "bot"):
            refused = await failure(people[name].approve(approval_id))
            assert refused.code() == grpc.StatusCode.PERMISSION_DENIED, name
        assert (await people["alice"].get(approval_id)).state == PENDING

        approved = (await people["alice"].approve(approval_id, note="ok, stop it")).approval
        assert (approved.state, approved.decided_by_name, approved.result) == (
            APPROVED,
            "alice",
            "ACCEPTED",
        )
        assert approved.note == "ok, stop it"
        run = await people["alice"].run(run_id)
        assert run.cancel_intent.reason == lifecycle_pb2.CANCEL_REASON_USER

        # Approving again is an answer, not a second cancel; denying now is refused.
        replay = (await people["alice"].approve(approval_id)).approval
        assert replay.decided_at == approved.decided_at
        late = await failure(people["alice"].deny(approval_id))
        assert late.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error_reason_of(late) == "APPROVAL_NOT_PENDING"
        assert "approved" in (late.details() or "")
        events = await people["alice"].events(run_id)

    assert approval_events(events) == [
        ("run.approval_requested", "bot", approval_id),
        ("run.approval_approved", "alice", approval_id),
        ("run.cancel_requested", "alice", approval_id),
    ]
    audited = [(r["operation"], r["principal_kind"], r["outcome"]) for r in stack.audit_rows()]
    assert ("RunService/CancelRun", "agent", "require_approval") in audited
    assert ("ApprovalService/Approve", "user", "admitted") in audited
    assert ("ApprovalService/Approve", "agent", "permission_denied") in audited


async def test_a_denied_request_runs_nothing(stack: Stack) -> None:
    async with operators(stack) as people:
        run_id, approval_id = await held_cancel(stack, people)
        denied = (await people["alice"].deny(approval_id, note="release in progress")).approval
        assert (denied.state, denied.decided_by_name, denied.result) == (DENIED, "alice", "")
        assert not (await people["alice"].run(run_id)).HasField("cancel_intent")
        refused = await failure(people["alice"].approve(approval_id))
        assert error_reason_of(refused) == "APPROVAL_NOT_PENDING"
        assert "denied" in (refused.details() or "")
        # Denying again is the same answer; a viewer may not deny at all.
        assert (await people["alice"].deny(approval_id)).approval.decided_at == denied.decided_at
        viewer = await failure(people["vera"].deny(approval_id))
        assert viewer.code() == grpc.StatusCode.PERMISSION_DENIED
        # The Agent asking again with the same request is told the same answer.
        assert (await people["bot"].cancel(run_id)).approval_id == approval_id
        events = await people["alice"].events(run_id)
    assert approval_events(events) == [
        ("run.approval_requested", "bot", approval_id),
        ("run.approval_denied", "alice", approval_id),
    ]
    [denial] = [e for e in events if e.type == "run.approval_denied"]
    assert denial.approval_changed.note == "release in progress"


async def test_unknown_and_foreign_requests_are_not_found(stack: Stack) -> None:
    # Alice also works in another project: a request of this one is not found there.
    with psycopg.connect(stack.database.urls.migration, autocommit=True) as admin:
        ensure_project(admin, "other", "Other")
        alice_id = admin.execute(
            "SELECT principal_id FROM qinglong.principals WHERE name = 'alice'"
        ).fetchone()
        assert alice_id is not None
        bind_role(admin, "other", alice_id[0], "operator")
    async with operators(stack) as people:
        _, approval_id = await held_cancel(stack, people)
        alice = people["alice"]
        for call in (
            alice.approvals.GetApproval(
                aps.GetApprovalRequest(project_id="other", approval_id=approval_id),
                metadata=alice.meta,
            ),
            alice.approvals.Approve(
                aps.ApproveRequest(project_id="other", approval_id=approval_id),
                metadata=alice.meta,
            ),
        ):
            foreign = await failure(call)
            assert error_reason_of(foreign) == "APPROVAL_NOT_FOUND"
        assert (await alice.get(approval_id)).state == PENDING
        missing = await failure(people["alice"].approve(str(uuid.uuid4())))
        assert missing.code() == grpc.StatusCode.NOT_FOUND
        assert error_reason_of(missing) == "APPROVAL_NOT_FOUND"
        malformed = await failure(people["alice"].approve("not-a-uuid"))
        assert malformed.code() == grpc.StatusCode.INVALID_ARGUMENT
        # Holding a cancel of a Run that is not in the project keeps nothing.
        ghost = await failure(people["bot"].cancel(str(uuid.uuid4())))
        assert error_reason_of(ghost) == "RUN_NOT_FOUND"
        listed = await people["alice"].approvals.ListApprovals(
            aps.ListApprovalsRequest(project_id=PROJECT), metadata=people["alice"].meta
        )
    assert [a.approval_id for a in listed.approvals] == [approval_id]


async def test_a_cancel_that_would_change_nothing_is_answered_not_held(stack: Stack) -> None:
    """Nothing to approve: the Agent gets the method's own answer, and no request waits."""
    async with operators(stack) as people:
        async with stack.channel(stack.operator_identity("ops")) as channel:
            run_id = await queued_run_through(channel, bearer(stack, "alice"), PROJECT)
        assert (await people["alice"].cancel(run_id)).outcome == (
            run_service_pb2.CANCEL_RUN_OUTCOME_ACCEPTED
        )
        answer = await people["bot"].cancel(run_id)
        listed = await people["alice"].approvals.ListApprovals(
            aps.ListApprovalsRequest(project_id=PROJECT), metadata=people["alice"].meta
        )
    assert answer.outcome == run_service_pb2.CANCEL_RUN_OUTCOME_ALREADY_REQUESTED
    assert answer.approval_id == ""
    assert answer.run.run_id == run_id
    assert list(listed.approvals) == []
    audited = [(r["operation"], r["principal_kind"], r["outcome"]) for r in stack.audit_rows()]
    assert audited.count(("RunService/CancelRun", "agent", "require_approval")) == 1


async def test_a_revoked_approver_cannot_approve(stack: Stack) -> None:
    async with operators(stack) as people:
        run_id, approval_id = await held_cancel(stack, people)
        _set_role(stack.database, "alice", status="revoked")
        refused = await failure(people["alice"].approve(approval_id))
        assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
        assert (await people["vera"].get(approval_id)).state == PENDING
        assert not (await people["vera"].run(run_id)).HasField("cancel_intent")


class ChangeAfterAdmission:
    """Changes the approver's binding after ingress admitted the call under the old one:
    control's own re-check (R-CAN-3) must catch what admission could not."""

    def __init__(self, database: MigratedDatabase, change: dict[str, str]) -> None:
        self._database = database
        self._change = change

    async def check(self, call: Call) -> Verdict:
        if call.route.name == "Approve":
            _set_role(self._database, "alice", **self._change)
        return Verdict.PASS


@pytest.mark.parametrize(
    "change", [{"role": "viewer"}, {"status": "revoked"}], ids=["demoted", "revoked"]
)
async def test_control_re_checks_the_approvers_binding(
    database_pg18: MigratedDatabase, tmp_path: Path, change: dict[str, str]
) -> None:
    extra = (ChangeAfterAdmission(database_pg18, change),)
    async with (
        running_stack(database_pg18, tmp_path / "pki", extra_stages=extra) as stack,
        operators(stack) as people,
    ):
        run_id, approval_id = await held_cancel(stack, people)
        fenced = await failure(people["alice"].approve(approval_id))
        assert fenced.code() == grpc.StatusCode.ABORTED
        assert error_reason_of(fenced) == "ROLE_BINDING_FENCED"
        assert (await people["vera"].get(approval_id)).state == PENDING
        assert not (await people["vera"].run(run_id)).HasField("cancel_intent")
        events = await people["vera"].events(run_id)
    assert [e for e, _, _ in approval_events(events)] == ["run.approval_requested"]


async def test_an_undecided_request_expires_and_runs_nothing(
    database_pg18: MigratedDatabase, tmp_path: Path
) -> None:
    async with (
        running_stack(
            database_pg18, tmp_path / "pki", timings=Timings(approval_ttl_ms=1_000)
        ) as stack,
        operators(stack) as people,
    ):
        run_id, late_id = await held_cancel(stack, people)
        swept_run, swept_id = await held_cancel(stack, people)

        # The TTL is a second of DB time; the state says expired once it has passed.
        for _ in range(300):
            states = {(await people["vera"].get(i)).state for i in (late_id, swept_id)}
            if states == {EXPIRED}:
                break
            await asyncio.sleep(0.05)
        assert states == {EXPIRED}
        # A decision that comes too late records the expiry itself, and is refused.
        refused = await failure(people["alice"].approve(late_id))
        assert error_reason_of(refused) == "APPROVAL_NOT_PENDING"
        assert "expired" in (refused.details() or "")
        # The reconciler records the other one in its cycle.
        pool = await open_runtime_pool(database_pg18.urls.runtime, sizing=PoolSizing(1, 2))
        try:
            report = await Reconciler(pool, ReconcilerLimits()).cycle()
        finally:
            await pool.close()
        assert report.approvals_expired == 1
        for run in (run_id, swept_run):
            assert not (await people["vera"].run(run)).HasField("cancel_intent")
        late_events = approval_events(await people["vera"].events(run_id))
        swept_events = approval_events(await people["vera"].events(swept_run))
        expired = await people["vera"].get(late_id)
    assert [e for e, _, _ in late_events] == ["run.approval_requested", "run.approval_expired"]
    assert [e for e, _, _ in swept_events] == ["run.approval_requested", "run.approval_expired"]
    assert expired.decided_by == ""
    assert expired.HasField("decided_at")


def _set_role(database: MigratedDatabase, name: str, **change: str) -> None:
    """Change a binding as an administrator would: the version advances with it."""
    [(column, value)] = change.items()
    statement = sql.SQL(
        "UPDATE qinglong.role_bindings SET {} = %s, version = version + 1"
        " WHERE project_id = %s AND principal_id ="
        " (SELECT principal_id FROM qinglong.principals WHERE name = %s)"
    ).format(sql.Identifier(column))
    with psycopg.connect(database.urls.migration, autocommit=True) as conn:
        updated = conn.execute(statement, (value, PROJECT, name)).rowcount
    assert updated == 1


async def test_requests_page_newest_first_and_filter_by_state(stack: Stack) -> None:
    async with operators(stack) as people:
        made = [(await held_cancel(stack, people))[1] for _ in range(3)]
        await people["alice"].deny(made[0])
        alice = people["alice"]

        async def page(token: str = "", states: tuple[int, ...] = ()) -> Any:
            return await alice.approvals.ListApprovals(
                aps.ListApprovalsRequest(
                    project_id=PROJECT, page_size=2, page_token=token, states=states
                ),
                metadata=alice.meta,
            )

        first = await page()
        second = await page(first.next_page_token)
        pending = await page(states=(PENDING,))
    assert [a.approval_id for a in first.approvals] == made[:0:-1]
    assert [a.approval_id for a in second.approvals] == made[:1]
    assert second.next_page_token == ""
    assert [a.approval_id for a in pending.approvals] == made[:0:-1]


async def test_an_agent_with_too_many_waiting_requests_is_refused_rate_limited(
    stack: Stack,
) -> None:
    """Through ingress: past the per-caller limit a held call is RESOURCE_EXHAUSTED with
    RATE_LIMITED, and another caller's request is still taken."""
    async with operators(stack) as people:
        run_id, _ = await held_cancel(stack, people)
        for n in range(1, PENDING_APPROVALS_PER_CALLER):
            answer = await people["bot"].cancel(run_id, mutation_id=f"stop-{n + 1}")
            assert answer.outcome == run_service_pb2.CANCEL_RUN_OUTCOME_REQUIRE_APPROVAL
        refused = await failure(people["bot"].cancel(run_id, mutation_id="one-too-many"))
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error_reason_of(refused) == "RATE_LIMITED"
        assert "await a decision" in (refused.details() or "")
        listed = await people["alice"].approvals.ListApprovals(
            aps.ListApprovalsRequest(project_id=PROJECT, states=[PENDING], page_size=200),
            metadata=people["alice"].meta,
        )
        assert len(listed.approvals) == PENDING_APPROVALS_PER_CALLER
