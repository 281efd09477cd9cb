"""Failover evidence for the remaining commands (SPEC §7 item 14, R-HA-2, R-LC-8, R-CONV-4).

One stack with a synchronous standby (fail-back is not supported, so one promotion per
stack). Before the promotion, five Runs are each left right after a different command
whose COMMIT the driver confirmed (the test acts as the Worker, and as the operator
through ingress with the stack's certificate and token):

* ``running``   -- AcknowledgeRunning answered RUNNING;
* ``renewed``   -- ControlLease answered ``renewed`` (version v+1);
* ``completed`` -- CompleteAttempt answered COMPLETED;
* ``cancel``    -- a running Run, CancelRun answered ACCEPTED;
* ``converged`` -- a queued Run with a cancel intent, converged by control's reconciler.

Each Run's version, event sequence, Event ids and dedupe keys and its lease versions are
recorded; the control backends are terminated, the old primary is fenced and the standby
promoted. Then every command is replayed exactly: while no primary is reachable only
UNAVAILABLE may come back; then the answers are ALREADY_RUNNING (same lease version and
start time), the same renewed version (R-LC-8 renewal replay), ALREADY_COMPLETED (same
states), ALREADY_REQUESTED, and the reconciler converges nothing of the old Runs (its log
after the promotion counts exactly the one new Run converged there). Everything recorded
is unchanged. Last, every Run is driven to its end on the new primary and the tally checks
each is terminal exactly once. On every PostgreSQL version the embedded binaries ship (16
and 18).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import grpc
import pytest
from qinglong.control.v1 import run_service_pb2
from qinglong.rpc.v1 import lifecycle_pb2
from qinglong.worker.v1 import worker_pb2
from qinglong.worker.v1 import worker_service_pb2 as ws
from qinglong_control.settings import ENV_RECONCILE_INTERVAL_SECONDS, ENV_TIMINGS_MS

from tests.support.devstack_process import DevStack, dev_stack
from tests.support.failover_probe import (
    CALL_SECONDS,
    RawWorker,
    on_promoted_standby,
    promote_standby,
    server_major_version,
    snapshot,
    until_answered,
)
from tests.support.fault_tally import (
    Expected,
    Tally,
    assert_verdict,
    compute_tally,
    wait_until_terminal,
)
from tests.support.operator_client import OperatorClient
from tests.support.polling import wait_until

CONVERGE_SECONDS: Final = 30.0
#: Long enough that no lease or session expires while the test holds them by hand: the
#: replays must meet exactly the state that was confirmed.
HOLD_MS: Final = "300000"
_RECONCILED: Final = re.compile(r"reconciled: (\d+) leases expired, (\d+) runs converged")


@pytest.fixture
def stack(scratch: Path, postgres_version: int) -> Iterator[DevStack]:
    with dev_stack(
        scratch / "stack",
        environment={
            ENV_RECONCILE_INTERVAL_SECONDS: "0.5",
            ENV_TIMINGS_MS["lease_ttl_ms"]: HOLD_MS,
            ENV_TIMINGS_MS["session_ttl_ms"]: HOLD_MS,
        },
        arguments=("--standby", "--postgres-version", str(postgres_version)),
    ) as up:
        yield up


def _reconciled(log: Path, offset: int = 0) -> tuple[int, int]:
    """(leases expired, runs converged) the control log reports after `offset` bytes."""
    text = log.read_bytes()[offset:].decode(errors="replace") if log.exists() else ""
    expired = converged = 0
    for match in _RECONCILED.finditer(text):
        expired += int(match.group(1))
        converged += int(match.group(2))
    return expired, converged


def test_every_command_replays_after_promotion(
    stack: DevStack,
    report_tally: Callable[[Tally], None],
    postgres_version: int,
) -> None:
    assert stack.document["postgres"]["standby"], "up --standby published no standby"
    running_on = server_major_version(stack.migration_url)
    assert running_on == postgres_version, f"the stack runs PostgreSQL {running_on}"
    operator = OperatorClient(stack)
    worker = RawWorker(stack)
    stub = worker.stub
    log = Path(stack.replicas("control")[0]["log"])
    problems: list[str] = []
    refusals: list[grpc.StatusCode] = []
    runs: dict[str, str] = {}
    calls = 0

    def cancel_request(run_id: str, mutation_id: str) -> run_service_pb2.CancelRunRequest:
        return run_service_pb2.CancelRunRequest(
            project_id=stack.project_id, run_id=run_id, mutation_id=mutation_id
        )

    def cancel(request: run_service_pb2.CancelRunRequest) -> run_service_pb2.CancelRunResponse:
        answer: run_service_pb2.CancelRunResponse = operator.runs.CancelRun(
            request, metadata=operator.metadata, timeout=CALL_SECONDS
        )
        return answer

    try:
        # 1. AcknowledgeRunning, confirmed.
        runs["running"] = operator.trigger(["true"], name="running")
        running_fence = worker.claim(runs["running"])
        running_request, running_first = worker.start_running(running_fence)
        assert running_first.outcome == worker_pb2.RUNNING_OUTCOME_RUNNING

        # 2. ControlLease, confirmed renewal v -> v+1.
        runs["renewed"] = operator.trigger(["true"], name="renewed")
        renewed_fence = worker.claim(runs["renewed"])
        worker.start_running(renewed_fence)
        lease_request = ws.ControlLeaseRequest(fence=renewed_fence)
        lease_first = stub.ControlLease(lease_request, timeout=CALL_SECONDS)
        assert lease_first.WhichOneof("result") == "renewed", lease_first
        assert lease_first.renewed.lease_version == renewed_fence.expected_lease_version + 1

        # 3. CompleteAttempt, confirmed.
        runs["completed"] = operator.trigger(["true"], name="completed")
        completed_fence = worker.claim(runs["completed"])
        worker.start_running(completed_fence)
        complete_request = ws.CompleteAttemptRequest(
            fence=completed_fence,
            callback_sequence=1,
            outcome=worker_pb2.ATTEMPT_OUTCOME_SUCCEEDED,
            exit_code=0,
            summary="exited 0",
        )
        complete_first = stub.CompleteAttempt(complete_request, timeout=CALL_SECONDS)
        assert complete_first.outcome == worker_pb2.COMPLETION_OUTCOME_COMPLETED

        # 4. CancelRun of a running Run, through ingress as the operator.
        runs["cancel"] = operator.trigger(["true"], name="cancel")
        cancel_fence = worker.claim(runs["cancel"])
        worker.start_running(cancel_fence)
        cancel_run = cancel_request(runs["cancel"], uuid.uuid4().hex[:16])
        cancel_first = cancel(cancel_run)
        assert cancel_first.outcome == run_service_pb2.CANCEL_RUN_OUTCOME_ACCEPTED

        # 5. A queued Run with a cancel intent, converged by the reconciler.
        runs["converged"] = operator.trigger(["true"], name="converged")
        cancel(cancel_request(runs["converged"], uuid.uuid4().hex[:16]))
        calls += 4 + 4 + 1 + 2  # triggers, commands, cancels
        assert wait_until_terminal(stack.migration_url, [runs["converged"]], CONVERGE_SECONDS)
        # The cycle's log line follows its commit; wait for it so it counts as "before".
        assert wait_until(lambda: _reconciled(log)[1] >= 1, CONVERGE_SECONDS), log.read_text()
        confirmed = {label: snapshot(stack.migration_url, run_id) for label, run_id in runs.items()}
        log_offset = log.stat().st_size

        promotion = promote_standby(stack)

        # Replays, each the exact request that was confirmed before the promotion.
        running_again = until_answered(
            lambda: stub.AcknowledgeRunning(running_request, timeout=CALL_SECONDS), refusals
        )
        recovered = time.monotonic() - promotion.promoted_at
        if running_again.outcome != worker_pb2.RUNNING_OUTCOME_ALREADY_RUNNING:
            problems.append(f"AcknowledgeRunning replay answered {running_again.outcome}")
        if (running_again.lease_version, running_again.started_at) != (
            running_first.lease_version,
            running_first.started_at,
        ):
            problems.append(f"AcknowledgeRunning replay {running_again} != {running_first}")

        lease_again = until_answered(
            lambda: stub.ControlLease(lease_request, timeout=CALL_SECONDS), refusals
        )
        if lease_again.WhichOneof("result") != "renewed" or (
            lease_again.renewed.lease_version != lease_first.renewed.lease_version
        ):
            problems.append(f"ControlLease replay answered {lease_again}, first {lease_first}")

        complete_again = until_answered(
            lambda: stub.CompleteAttempt(complete_request, timeout=CALL_SECONDS), refusals
        )
        if complete_again.outcome != worker_pb2.COMPLETION_OUTCOME_ALREADY_COMPLETED:
            problems.append(f"CompleteAttempt replay answered {complete_again.outcome}")
        for name in ("attempt_state", "run_state", "error_code", "completed_lease_version"):
            if getattr(complete_again, name) != getattr(complete_first, name):
                problems.append(f"CompleteAttempt replay changed {name}: {complete_again}")

        cancel_again = until_answered(lambda: cancel(cancel_run), refusals)
        if cancel_again.outcome != run_service_pb2.CANCEL_RUN_OUTCOME_ALREADY_REQUESTED:
            problems.append(f"CancelRun replay answered {cancel_again.outcome}")
        calls += 4 + len(refusals)

        # The next convergence cycles on the new primary: exactly one new Run converges
        # (proving the cycles run there), none of the old ones, and no lease expires.
        probe = operator.trigger(["true"], name="converge-probe")
        until_answered(lambda: cancel(cancel_request(probe, uuid.uuid4().hex[:16])), refusals)
        calls += 2
        if not wait_until_terminal(stack.migration_url, [probe], CONVERGE_SECONDS):
            problems.append("the reconciler did not converge a Run on the new primary")
        if not wait_until(lambda: _reconciled(log, log_offset)[1] >= 1, CONVERGE_SECONDS):
            problems.append("control's log never reported the probe's convergence")
        time.sleep(1.5)  # three more cycles, for anything else they might converge
        expired, converged = _reconciled(log, log_offset)
        if (expired, converged) != (0, 1):
            problems.append(
                f"after the promotion the reconciler expired {expired} leases and converged "
                f"{converged} Runs; expected 0 and exactly the one new Run"
            )

        after = {label: snapshot(stack.migration_url, run_id) for label, run_id in runs.items()}
        for label in runs:
            if after[label] != confirmed[label]:
                problems.append(
                    f"{label}: the Run changed across the failover:\n"
                    f"{confirmed[label]}\n{after[label]}"
                )
        problems += on_promoted_standby(stack)

        # Every Run ends on the new primary, through the same services.
        done = stub.CompleteAttempt(
            ws.CompleteAttemptRequest(
                fence=running_fence,
                callback_sequence=1,
                outcome=worker_pb2.ATTEMPT_OUTCOME_SUCCEEDED,
                exit_code=0,
            ),
            timeout=CALL_SECONDS,
        )
        if done.run_state != lifecycle_pb2.RUN_STATE_SUCCEEDED:
            problems.append(f"the running Run ended {done.run_state}")
        done = stub.CompleteAttempt(
            ws.CompleteAttemptRequest(
                fence=RawWorker.with_version(renewed_fence, lease_first.renewed.lease_version),
                callback_sequence=1,
                outcome=worker_pb2.ATTEMPT_OUTCOME_SUCCEEDED,
                exit_code=0,
            ),
            timeout=CALL_SECONDS,
        )
        if done.run_state != lifecycle_pb2.RUN_STATE_SUCCEEDED:
            problems.append(f"the renewed Run ended {done.run_state}")
        stop = stub.ControlLease(ws.ControlLeaseRequest(fence=cancel_fence), timeout=CALL_SECONDS)
        if stop.WhichOneof("result") != "stop_requested":
            problems.append(f"the cancelled Run's ControlLease answered {stop}")
        done = stub.CompleteAttempt(
            ws.CompleteAttemptRequest(
                fence=RawWorker.with_version(cancel_fence, stop.stop_requested.lease_version),
                callback_sequence=1,
                outcome=worker_pb2.ATTEMPT_OUTCOME_CANCELLED,
            ),
            timeout=CALL_SECONDS,
        )
        if done.attempt_state != lifecycle_pb2.ATTEMPT_STATE_CANCELLED:
            problems.append(f"the cancelled Run's Attempt ended {done.attempt_state}")
        calls += 4
        runs["converge-probe"] = probe
        restarts = [e["restarts"] for kind in ("control", "ingress") for e in stack.replicas(kind)]
        if any(restarts):
            problems.append(f"a service had to be restarted to fail over: {restarts}")
    finally:
        worker.close()
        operator.close()

    unexpected = [code for code in refusals if code is not grpc.StatusCode.UNAVAILABLE]
    if unexpected:
        problems.append(f"during the failover callers saw {unexpected}, not only UNAVAILABLE")
    ends: dict[str, dict[str, Any]] = {
        "running": {"state": "succeeded", "exit_code": 0},
        "renewed": {"state": "succeeded", "exit_code": 0},
        "completed": {"state": "succeeded", "exit_code": 0},
        "cancel": {"state": "cancelled"},
        "converged": {"state": "cancelled"},
        "converge-probe": {"state": "cancelled"},
    }
    tally = compute_tally(
        f"PostgreSQL {postgres_version}: replay AcknowledgeRunning, ControlLease,"
        " CompleteAttempt, CancelRun, convergence"
        " after a promotion",
        stack.migration_url,
        [Expected(runs[label], label=label, **end) for label, end in ends.items() if label in runs],
        extra_calls=calls + worker.calls,
        extra_faults=2,  # the backend kill and the promotion
    )
    tally.notes.append(f"{promotion.terminated} control backends terminated, 1 promotion")
    tally.notes.append(
        f"first replay answered {recovered:.1f} s after the promotion; refusals meanwhile: "
        f"{[code.name for code in refusals]}"
    )
    report_tally(tally)
    assert_verdict(tally, problems)
