"""Approval requests (SPEC R-OPS-2): hold a call, list them, decide one, expire them.

A decision is one short serializable transaction in R-CAN-3's order: the project's
advisory lock (shared), the project and the decider's current binding, the request FOR
UPDATE, its Run FOR UPDATE, DB time. The held mutation's own policy check runs on the
decider's binding, then its writes, the request's decision and the Run's Events (the
decision first, then what the mutation appended) — all or nothing. Which mutations can
be held, and how each runs, is the caller's registry (`HeldMutation`); this module knows
none of them.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from psycopg import AsyncConnection
from psycopg.rows import kwargs_row, scalar_row

from qinglong_control.db.admin import PROJECT_LOCK
from qinglong_control.db.cancellation import LockedRun
from qinglong_control.db.command_tx import (
    CommandTx,
    ConnectionSource,
    command_transaction,
    retrying_serialization,
)
from qinglong_control.db.events import Actor, NewEvent, append_events
from qinglong_control.db.sql import SQL
from qinglong_control.domain.approvals import (
    PENDING_APPROVALS_PER_CALLER,
    ApprovalView,
    Decision,
    HeldCall,
    Step,
    approval_event_type,
    check_room_for_another,
    next_step,
)
from qinglong_control.domain.cancellation import BindingSnapshot, PolicyNow
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.paging import keyset_page, read_limit

_LOCK_PROJECT_SHARED = SQL["cancellation.lock_project_shared"]
_POLICY_NOW = SQL["cancellation.policy_now"]
_LOCK_RUN = SQL["cancellation.lock_run"]
_DB_NOW = SQL["clock.db_now"]
_HOLD = SQL["approvals.hold"]
_HELD_BEFORE = SQL["approvals.held_before"]
_PENDING_OF_CALLER = SQL["approvals.pending_of_caller"]
_LOCK = SQL["approvals.lock"]
_RECORD_DECISION = SQL["approvals.record_decision"]
_GET = SQL["approvals.get"]
_LIST = SQL["approvals.list"]
_EXPIRE_NEXT = SQL["approvals.expire_next"]

#: Who records an expiry nobody decided.
EXPIRY = Actor("reconciler", "approval-expiry")


@dataclass(frozen=True)
class Executed:
    """What an approved mutation did: its result name and the Events it appends."""

    result: str
    events: list[NewEvent]


class HeldMutation(Protocol):
    """One method that can be held for approval, as control executes it later."""

    def moot(self, run: LockedRun | None) -> str | None:
        """The result the mutation would have now if it changes nothing (so there is
        nothing to approve), or None."""

    def check_policy(self, snapshot: BindingSnapshot, now: PolicyNow | None) -> None:
        """Refuse a decider whose current binding may not perform the mutation."""

    async def execute(
        self,
        tx: CommandTx,
        request: bytes,
        run: LockedRun | None,
        approval_id: uuid.UUID,
        approver: Actor,
        now_ms: int,
    ) -> Executed:
        """Perform the mutation as ``approver`` inside the decision's transaction."""


@dataclass(frozen=True)
class _Locked:
    approval_id: uuid.UUID
    state: str
    method: str
    request: bytes
    run_id: uuid.UUID | None
    requested_by: uuid.UUID
    decided_by: uuid.UUID | None
    expires_at_ms: int


@dataclass(frozen=True)
class DecideApproval:
    project_id: str
    approval_id: uuid.UUID
    decision: Decision
    decider: Actor
    decider_id: uuid.UUID
    snapshot: BindingSnapshot
    note: str | None


@dataclass(frozen=True)
class Decided:
    """The decision's outcome: ``expired`` when the request had run out of time (the
    expiry is committed; the caller refuses the decision)."""

    expired: bool


@dataclass(frozen=True)
class ApprovalPage:
    approvals: list[ApprovalView]
    next_cursor: tuple[int, uuid.UUID] | None


# --- holding --------------------------------------------------------------------------


@dataclass(frozen=True)
class Held:
    """What holding a call did: the request that holds it, or — when the mutation would
    change nothing — no request and the result the method answers at once."""

    approval_id: uuid.UUID | None
    moot: str | None = None


async def hold(
    conn: AsyncConnection[Any],
    held: HeldCall,
    ttl_ms: int,
    actor: Actor,
    mutation: HeldMutation,
) -> Held:
    """Keep ``held`` as a pending request and tell its Run; a retry of the same call
    answers the request the first one made, and appends nothing."""
    values = {
        "approval_id": uuid.uuid4(),
        "project_id": held.project_id,
        "method": held.method,
        "request_type": held.request_type,
        "request": held.request,
        "request_digest": held.digest,
        "run_id": held.run_id,
        "requested_by": held.requested_by,
        "requested_by_kind": held.requested_by_kind,
        "audit_id": held.audit_id,
        "ttl_ms": ttl_ms,
    }
    async with command_transaction(conn) as tx:
        run = await _lock_run(tx, held.project_id, held.run_id)
        before = await tx.execute("approval.held_before", _HELD_BEFORE, values, scalar_row)
        found: uuid.UUID | None = await before.fetchone()
        if found is not None:
            return Held(found)
        moot = mutation.moot(run)
        if moot is not None:
            return Held(None, moot)
        counting = {**values, "limit": PENDING_APPROVALS_PER_CALLER}
        counted = await tx.execute(
            "approval.pending_of_caller", _PENDING_OF_CALLER, counting, scalar_row
        )
        check_room_for_another(await counted.fetchone() or 0)
        now_ms = await _now(tx)
        inserted = await tx.execute("approval.hold", _HOLD, {**values, "now": now_ms}, scalar_row)
        approval_id: uuid.UUID | None = await inserted.fetchone()
        if approval_id is None:  # the same call, held a moment ago by a concurrent retry
            again = await tx.execute("approval.held_before", _HELD_BEFORE, values, scalar_row)
            found = await again.fetchone()
            if found is None:
                raise AssertionError("a held request vanished")
            return Held(found)
        if held.run_id is not None and run is not None and run.takes_events:
            await append_events(
                tx,
                held.run_id,
                run.event_sequence,
                actor,
                now_ms,
                [_approval_event(approval_event_type("requested"), approval_id, held.method, None)],
            )
        return Held(approval_id)


# --- deciding -------------------------------------------------------------------------


async def decide(
    source: ConnectionSource,
    command: DecideApproval,
    mutations: Mapping[str, HeldMutation],
) -> Decided:
    """Approve or deny, retrying a serialization conflict a bounded number of times: the
    retry re-reads everything, so a second concurrent decision meets the first's result."""
    return await retrying_serialization(source, lambda conn: _decide_once(conn, command, mutations))


async def _decide_once(
    conn: AsyncConnection[Any], command: DecideApproval, mutations: Mapping[str, HeldMutation]
) -> Decided:
    keys = {
        "project_id": command.project_id,
        "approval_id": command.approval_id,
        "principal_id": command.decider_id,
    }
    async with command_transaction(conn, serializable=True) as tx:
        await tx.execute("lock.project", _LOCK_PROJECT_SHARED, (PROJECT_LOCK, command.project_id))
        policy = await tx.execute("policy.now", _POLICY_NOW, keys, kwargs_row(PolicyNow))
        locked_cursor = await tx.execute("approval.lock", _LOCK, keys, kwargs_row(_Locked))
        locked = await locked_cursor.fetchone()
        if locked is None:
            raise Refused(Reason.APPROVAL_NOT_FOUND, "no such approval request")
        mutation = mutations.get(locked.method)
        if mutation is None:
            raise Refused(Reason.APPROVAL_UNSUPPORTED, "this control cannot execute that method")
        run = await _lock_run(tx, command.project_id, locked.run_id)
        now_ms = await _now(tx)
        # The decider's binding, as it is now (R-CAN-3), whatever the request's state:
        # a principal that may no longer perform the mutation learns nothing more.
        mutation.check_policy(command.snapshot, await policy.fetchone())
        step = next_step(locked, command.decision, command.decider_id, now_ms)
        if step is Step.REPLAY:
            return Decided(expired=False)
        if step is Step.EXPIRE:
            await _record_expiry(tx, locked.approval_id, locked.method, locked.run_id, run, now_ms)
            return Decided(expired=True)
        events = [
            _approval_event(
                approval_event_type(command.decision.value),
                locked.approval_id,
                locked.method,
                command.note,
            )
        ]
        result = None
        if command.decision is Decision.APPROVE:
            executed = await mutation.execute(
                tx, locked.request, run, locked.approval_id, command.decider, now_ms
            )
            result = executed.result
            events += executed.events
        await tx.execute(
            "approval.decide",
            _RECORD_DECISION,
            {
                "approval_id": locked.approval_id,
                "state": command.decision.value,
                "decided_by": command.decider_id,
                "now": now_ms,
                "note": command.note,
                "result": result,
            },
        )
        if locked.run_id is not None and run is not None and run.takes_events:
            await append_events(
                tx, locked.run_id, run.event_sequence, command.decider, now_ms, events
            )
        return Decided(expired=False)


# --- expiring -------------------------------------------------------------------------


@dataclass(frozen=True)
class _Expiring:
    approval_id: uuid.UUID
    project_id: str
    method: str
    run_id: uuid.UUID | None


async def expire_page(conn: AsyncConnection[Any], limit: int) -> int:
    """Record the expiry of up to ``limit`` requests nobody decided in time, each in its
    own short transaction with its Run's Event: request, then Run, the order a decision
    locks them in, so replicas and decisions never wait on each other in a cycle (a
    request another transaction holds is skipped). Returns how many."""
    expired = 0
    for _ in range(limit):
        async with command_transaction(conn, durable_answer=False) as tx:
            page = await tx.execute("approval.expire_next", _EXPIRE_NEXT, (), kwargs_row(_Expiring))
            item = await page.fetchone()
            if item is None:
                return expired
            run = await _lock_run(tx, item.project_id, item.run_id)
            now_ms = await _now(tx)
            await _record_expiry(tx, item.approval_id, item.method, item.run_id, run, now_ms)
        expired += 1
    return expired


async def _record_expiry(
    tx: CommandTx,
    approval_id: uuid.UUID,
    method: str,
    run_id: uuid.UUID | None,
    run: LockedRun | None,
    now_ms: int,
) -> None:
    await tx.execute(
        "approval.expire",
        _RECORD_DECISION,
        {
            "approval_id": approval_id,
            "state": "expired",
            "decided_by": None,
            "now": now_ms,
            "note": None,
            "result": None,
        },
    )
    if run_id is not None and run is not None and run.takes_events:
        await append_events(
            tx,
            run_id,
            run.event_sequence,
            EXPIRY,
            now_ms,
            [_approval_event(approval_event_type("expired"), approval_id, method, None)],
        )


# --- reading --------------------------------------------------------------------------


async def get_approval(
    conn: AsyncConnection[Any], project_id: str, approval_id: uuid.UUID
) -> ApprovalView:
    """Another project's request and a missing one look the same: not found."""
    cursor = conn.cursor(row_factory=kwargs_row(ApprovalView))
    await cursor.execute(_GET, {"project_id": project_id, "approval_id": approval_id})
    found = await cursor.fetchone()
    if found is None:
        raise Refused(Reason.APPROVAL_NOT_FOUND, "no such approval request")
    return found


async def list_approvals(
    conn: AsyncConnection[Any],
    project_id: str,
    *,
    limit: int,
    states: tuple[str, ...] = (),
    before: tuple[int, uuid.UUID] | None = None,
) -> ApprovalPage:
    """Newest first, keyset-paginated by (requested_at, approval_id)."""
    cursor = conn.cursor(row_factory=kwargs_row(ApprovalView))
    await cursor.execute(
        _LIST,
        {
            "project_id": project_id,
            "states": list(states),
            "before_requested": None if before is None else before[0],
            "before_approval": None if before is None else before[1],
            "limit": read_limit(limit),
        },
    )
    page, last = keyset_page(await cursor.fetchall(), limit, _approval_key)
    return ApprovalPage(page, last)


def _approval_key(approval: ApprovalView) -> tuple[int, uuid.UUID]:
    return approval.requested_at_ms, approval.approval_id


# --- shared ---------------------------------------------------------------------------


async def _lock_run(tx: CommandTx, project_id: str, run_id: uuid.UUID | None) -> LockedRun | None:
    if run_id is None:
        return None
    cursor = await tx.execute(
        "lock.run", _LOCK_RUN, {"project_id": project_id, "run_id": run_id}, kwargs_row(LockedRun)
    )
    run = await cursor.fetchone()
    if run is None:
        # Another project's Run and a missing Run look the same (R-CAN-4).
        raise Refused(Reason.RUN_NOT_FOUND, "no such run")
    return run


async def _now(tx: CommandTx) -> int:
    cursor = await tx.execute("db_now", _DB_NOW, (), scalar_row)
    now_ms: int = await cursor.fetchone() or 0
    return now_ms


def _approval_event(
    event_type: str, approval_id: uuid.UUID, method: str, note: str | None
) -> NewEvent:
    payload: dict[str, object] = {"approval_id": str(approval_id), "method": method}
    if note:
        payload["note"] = note
    # One Event of each kind per request: a retried decision can never add another.
    return NewEvent(event_type, None, payload, dedupe_key=f"{event_type}:{approval_id}")
