"""Control's answer budget per command (R-ERR-2): Workers' short, replayable commands get
the storage bound; operators' and administrators' the statement bound; JoinWorker none."""

from __future__ import annotations

from qinglong.runtime.v1 import runtime_service_pb2
from qinglong_control.answer_budget import UNBOUNDED, WORKER_COMMANDS, answer_budget
from qinglong_protocol.storage import StorageBounds

RUNTIME_METHODS = {
    method.name
    for method in runtime_service_pb2.DESCRIPTOR.services_by_name["RuntimeService"].methods
}


def test_every_worker_command_is_a_runtime_method_with_the_storage_bound() -> None:
    bounds = StorageBounds(2.0)
    assert WORKER_COMMANDS <= RUNTIME_METHODS
    assert {"ControlLease", "AcknowledgeRunning", "CompleteAttempt"} <= WORKER_COMMANDS
    for method in WORKER_COMMANDS:
        assert answer_budget(method, bounds) == 2.0, method


def test_operator_and_admin_commands_get_the_statement_bound() -> None:
    bounds = StorageBounds(2.0)
    others = RUNTIME_METHODS - WORKER_COMMANDS - UNBOUNDED
    assert {"CancelRun", "TriggerRun", "ListAuditRecords", "DisableWorker"} <= others
    for method in others:
        assert answer_budget(method, bounds) == bounds.statement_timeout_ms / 1000 == 10.0


def test_join_worker_is_answered_whatever_it_takes() -> None:
    """It spends a single-use token: an UNAVAILABLE after it committed would leave the
    machine with neither its certificate nor a token to retry with."""
    assert {"JoinWorker"} == UNBOUNDED
    assert answer_budget("JoinWorker", StorageBounds(2.0)) is None
