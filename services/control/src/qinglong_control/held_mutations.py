"""The mutations control can hold for approval and execute later (SPEC R-OPS-2).

Ingress decides *whether* a call needs an approval (its policy) and forwards any such
call; control decides whether it *can* hold it: a method listed here. Each entry reads
its own request (the exact bytes the caller sent), names the Run it concerns, checks a
decider's current binding as the method's own call would, and performs the mutation as
the approver inside the decision's transaction. A method ingress holds that is not here
is refused APPROVAL_UNSUPPORTED and nothing is kept.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from google.protobuf.message import Message
from qinglong.control.v1 import run_service_pb2

from qinglong_control import wire
from qinglong_control.db.approvals import Executed
from qinglong_control.db.cancellation import LockedRun, record_intent
from qinglong_control.db.command_tx import CommandTx
from qinglong_control.db.events import Actor
from qinglong_control.db.runs import RunView
from qinglong_control.domain.cancellation import (
    BindingSnapshot,
    CancelOutcome,
    PolicyNow,
    check_policy,
    decide_cancel,
)


@dataclass(frozen=True)
class Subject:
    """What a held request is about, read from the request itself."""

    project_id: str
    run_id: uuid.UUID | None


class HeldCancel:
    """RunService.CancelRun: an approved request records the cancel intent as the
    approver, exactly as the approver's own CancelRun would (R-CAN-3)."""

    request_type: Final = run_service_pb2.CancelRunRequest

    def subject(self, request: Message) -> Subject:
        assert isinstance(request, run_service_pb2.CancelRunRequest)
        return Subject(request.project_id, uuid.UUID(request.run_id))

    def check_policy(self, snapshot: BindingSnapshot, now: PolicyNow | None) -> None:
        check_policy(snapshot, now)

    def moot(self, run: LockedRun | None) -> str | None:
        """A Run that has ended, or already has a cancel intent, needs no approval."""
        outcome = decide_cancel(None if run is None else run.target)
        return None if outcome is CancelOutcome.ACCEPTED else outcome.value

    def answer(self, result: str, run: RunView) -> Message:
        """The method's own answer when nothing was held."""
        return run_service_pb2.CancelRunResponse(
            outcome=wire.CANCEL_OUTCOMES[CancelOutcome(result)], run=wire.run(run)
        )

    async def execute(
        self,
        tx: CommandTx,
        request: bytes,
        run: LockedRun | None,
        approval_id: uuid.UUID,
        approver: Actor,
        now_ms: int,
    ) -> Executed:
        held = run_service_pb2.CancelRunRequest.FromString(request)
        outcome, events = await record_intent(
            tx,
            uuid.UUID(held.run_id),
            None if run is None else run.target,
            approver,
            now_ms,
            # The approval is the mutation: one intent per approval, however often retried.
            f"approval:{approval_id}",
            approval_id,
        )
        return Executed(outcome.name, events)


def _method(service: str, name: str) -> str:
    """A public method's gRPC path, from the contract."""
    return f"/{run_service_pb2.DESCRIPTOR.services_by_name[service].full_name}/{name}"


#: By public method: what control can hold and execute. A held request is kept as sent
#: and shown to anyone with a role in the project: never list a method whose request
#: carries a secret.
HELD_MUTATIONS: Final[Mapping[str, HeldCancel]] = {
    _method("RunService", "CancelRun"): HeldCancel(),
}
