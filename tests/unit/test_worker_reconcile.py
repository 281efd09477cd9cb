"""`reconcile(offer_id)` and the lifecycle's decisions (SPEC R-W-2, R-W-4, R-TO-2), with a real
inbox and real processes; only the network is a scripted stand-in, so that the order of
what is persisted, stopped and sent can be observed exactly."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp
from qinglong.rpc.v1 import execution_pb2, lifecycle_pb2
from qinglong.worker.v1 import worker_pb2
from qinglong.worker.v1 import worker_service_pb2 as ws
from qinglong_protocol import bounds
from qinglong_worker.client import CallFailed
from qinglong_worker.inbox import Inbox, QuarantineReason, RecordState
from qinglong_worker.lifecycle import Lifecycle, LifecycleSettings
from qinglong_worker.process import ExitStatus, ProcessController, StopResult
from qinglong_worker.reconcile import (
    Outcome,
    Reconciler,
    activation_problem,
    completion_outcome,
    fence_of,
    identity_of,
    new_capability,
    wall_clock_ms,
)
from qinglong_worker.session import ActiveSession

WORKER = "worker-a"
SESSION = str(uuid.uuid4())


def _duration(ms: int) -> Duration:
    value = Duration()
    value.FromMilliseconds(ms)
    return value


def _activation(timeout_ms: int | None) -> worker_pb2.ActivationSnapshot:
    snapshot = worker_pb2.ActivationSnapshot(lease_version=1)
    if timeout_ms is not None:
        snapshot.timeout_ms = timeout_ms
        deadline = Timestamp()
        deadline.FromMilliseconds(wall_clock_ms() + timeout_ms)
        snapshot.deadline.CopyFrom(deadline)
        snapshot.deadline_remaining.CopyFrom(_duration(timeout_ms))
    return snapshot


class ScriptedClient:
    """Answers WorkerService calls like a correct server would; tests override answers."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.lease_version = 1
        self.activation: worker_pb2.ActivationSnapshot = _activation(60_000)
        self.control_answer: Callable[[ws.ControlLeaseRequest], ws.ControlLeaseResponse] = (
            self._renew
        )
        self.control_gate: asyncio.Event | None = None
        self.offers: list[worker_pb2.Offer] = []
        self.seen_versions: list[int] = []
        self.plans: dict[str, execution_pb2.ExecutionPlan] = {}
        self.completed = ws.CompleteAttemptRequest()

    def _record(self, name: str, request: Any) -> None:
        self.calls.append(name)
        if hasattr(request, "fence"):
            self.seen_versions.append(request.fence.expected_lease_version)

    def _renew(self, request: ws.ControlLeaseRequest) -> ws.ControlLeaseResponse:
        self.lease_version = request.fence.expected_lease_version + 1
        return ws.ControlLeaseResponse(
            renewed=worker_pb2.LeaseRenewed(
                lease_version=self.lease_version, lease_remaining=_duration(30_000)
            )
        )

    async def pull_offers(self, request: ws.PullOffersRequest) -> ws.PullOffersResponse:
        self._record("PullOffers", request)
        offers, self.offers = self.offers[: request.max_offers], self.offers[request.max_offers :]
        return ws.PullOffersResponse(offers=offers)

    async def claim_offer(self, request: ws.ClaimOfferRequest) -> ws.ClaimOfferResponse:
        self._record("ClaimOffer", request)
        assert bounds.is_acceptable_lease_capability(request.lease_token)
        return ws.ClaimOfferResponse(
            attempt_id=str(uuid.uuid4()),
            lease_generation=1,
            lease_version=1,
            lease_remaining=_duration(30_000),
            spec=worker_pb2.ExecutionSpec(plan=self.plans[request.offer_id]),
        )

    async def acknowledge_starting(
        self, request: ws.AcknowledgeStartingRequest
    ) -> ws.AcknowledgeStartingResponse:
        self._record("AcknowledgeStarting", request)
        return ws.AcknowledgeStartingResponse(
            outcome=worker_pb2.STARTING_OUTCOME_STARTING, activation=self.activation
        )

    async def acknowledge_running(
        self, request: ws.AcknowledgeRunningRequest
    ) -> ws.AcknowledgeRunningResponse:
        self._record("AcknowledgeRunning", request)
        assert bounds.is_sha256_hex(request.callback_token_digest)
        return ws.AcknowledgeRunningResponse(
            outcome=worker_pb2.RUNNING_OUTCOME_RUNNING,
            lease_version=request.fence.expected_lease_version,
        )

    async def report_start_failure(
        self, request: ws.ReportStartFailureRequest
    ) -> ws.ReportStartFailureResponse:
        self._record("ReportStartFailure", request)
        return ws.ReportStartFailureResponse(
            attempt_state=lifecycle_pb2.ATTEMPT_STATE_FAILED,
            run_state=lifecycle_pb2.RUN_STATE_FAILED,
            error_code="EXECUTOR_START_FAILED",
            completed_lease_version=request.fence.expected_lease_version + 1,
        )

    async def control_lease(self, request: ws.ControlLeaseRequest) -> ws.ControlLeaseResponse:
        self._record("ControlLease", request)
        if self.control_gate is not None:
            await self.control_gate.wait()
        return self.control_answer(request)

    async def complete_attempt(
        self, request: ws.CompleteAttemptRequest
    ) -> ws.CompleteAttemptResponse:
        self._record("CompleteAttempt", request)
        self.completed = request
        return ws.CompleteAttemptResponse(
            outcome=worker_pb2.COMPLETION_OUTCOME_COMPLETED,
            completed_lease_version=request.fence.expected_lease_version + 1,
        )


class RecordingProcesses(ProcessController):
    """The real controller; remembers what the inbox said when each stop began."""

    def __init__(self, inbox: Inbox) -> None:
        super().__init__()
        self.inbox = inbox
        self.versions_at_stop: list[int | None] = []
        self.refuse_signals = False

    async def stop(self, identity: Any, **kwargs: Any) -> StopResult:
        records = [r for r in self.inbox.records() if identity_of(r) == identity]
        self.versions_at_stop.extend(r.lease_version for r in records)
        if self.refuse_signals:
            return StopResult.UNVERIFIED
        return await super().stop(identity, **kwargs)


@dataclasses.dataclass
class World:
    inbox: Inbox
    client: ScriptedClient
    processes: RecordingProcesses
    reconciler: Reconciler
    clock_offset_ms: list[int]

    def offer(self, argv: list[str], timeout_ms: int | None = 60_000) -> worker_pb2.Offer:
        plan = execution_pb2.ExecutionPlan(
            executor_type=execution_pb2.EXECUTOR_TYPE_REMOTE_WORKER, command=argv
        )
        if timeout_ms is not None:
            plan.timeout_ms = timeout_ms
        offer = worker_pb2.Offer(
            offer_id=str(uuid.uuid4()),
            project_id="default",
            run_id=str(uuid.uuid4()),
            spec=worker_pb2.ExecutionSpec(plan=plan),
        )
        self.client.plans[offer.offer_id] = plan
        return offer

    def admit(self, argv: list[str], timeout_ms: int | None = 60_000) -> str:
        offer = self.offer(argv, timeout_ms)
        assert self.reconciler.admit(
            offer=offer, worker_id=WORKER, session_id=SESSION, worker_generation=1
        )
        return offer.offer_id


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    inbox = Inbox.open(tmp_path / "inbox.db")
    client = ScriptedClient()
    processes = RecordingProcesses(inbox)
    offset = [0]
    reconciler = Reconciler(
        inbox=inbox,
        client=client,  # type: ignore[arg-type]
        processes=processes,
        clock=lambda: wall_clock_ms() + offset[0],
        stop_grace_seconds=2.0,
        log_dir=tmp_path,
    )
    yield World(inbox, client, processes, reconciler, offset)
    await reconciler.abort()
    for record in inbox.records():
        identity = identity_of(record)
        if identity is not None and processes.poll(identity) is None:
            await processes.stop(identity, grace_seconds=0.0)
    inbox.close()
    unreaped = [c.pid for c in processes._children.values() if c.returncode is None]
    assert not unreaped, "every child stopped was also reaped"


async def test_start_path_persists_each_fact_before_the_next_call(world: World) -> None:
    offer_id = world.admit(["sleep", "30"])
    admitted = world.inbox.get(offer_id)
    assert admitted is not None
    assert admitted.state is RecordState.CLAIMING
    assert await world.reconciler.reconcile(offer_id) is Outcome.RUNNING
    assert world.client.calls == ["ClaimOffer", "AcknowledgeStarting", "AcknowledgeRunning"]
    record = world.inbox.get(offer_id)
    assert record is not None
    assert record.state is RecordState.RUNNING_ACKNOWLEDGED
    identity = identity_of(record)
    assert identity is not None
    assert world.processes.poll(identity) is None
    assert record.deadline_unix_ms is not None
    assert record.callback_sequence == 1
    # The fence comes from the persisted record.
    assert fence_of(record).lease_token == admitted.capability


async def test_stop_requested_persists_the_new_version_before_stopping(world: World) -> None:
    offer_id = world.admit(["sleep", "30"])
    await world.reconciler.reconcile(offer_id)
    world.client.control_answer = lambda request: ws.ControlLeaseResponse(
        stop_requested=worker_pb2.LeaseStopRequested(
            lease_version=request.fence.expected_lease_version + 1,
            lease_remaining=_duration(30_000),
            cancel_reason=lifecycle_pb2.CANCEL_REASON_USER,
        )
    )
    assert await world.reconciler.reconcile(offer_id) is Outcome.COMPLETED
    assert world.processes.versions_at_stop == [2], "version 2 was durable when TERM was sent"
    assert world.client.calls[-2:] == ["ControlLease", "CompleteAttempt"]
    assert world.client.seen_versions[-2:] == [1, 2], "completion used the newest version"
    request = world.client.completed
    assert request.outcome == worker_pb2.ATTEMPT_OUTCOME_CANCELLED
    assert not request.HasField("exit_code")  # ended by a signal
    record = world.inbox.get(offer_id)
    assert record is not None
    assert (record.state, record.exit_signal, record.lease_version) == (
        RecordState.COMPLETION_ACKNOWLEDGED,
        signal.SIGTERM,
        3,
    )


async def test_local_lease_expiry_stops_the_process_without_calling_control(
    world: World,
) -> None:
    offer_id = world.admit(["sleep", "30"])
    await world.reconciler.reconcile(offer_id)
    calls = list(world.client.calls)
    world.clock_offset_ms[0] = 31_000  # past claim time + 30 s remaining
    assert await world.reconciler.reconcile(offer_id) is Outcome.LEASE_LOST
    assert world.client.calls == calls, "the control plane was not called"
    record = world.inbox.get(offer_id)
    assert record is not None
    assert record.quarantine_reason is QuarantineReason.LEASE_LOST_LOCAL_EXECUTION_STOPPED
    assert (record.exit_code, record.exit_signal) == (None, signal.SIGTERM)


async def test_an_unconfirmable_stop_is_quarantined_unverified(world: World) -> None:
    offer_id = world.admit(["sleep", "30"])
    await world.reconciler.reconcile(offer_id)
    world.processes.refuse_signals = True  # e.g. EPERM, or /proc unreadable
    world.clock_offset_ms[0] = 31_000
    assert await world.reconciler.reconcile(offer_id) is Outcome.LEASE_LOST
    record = world.inbox.get(offer_id)
    assert record is not None
    assert record.quarantine_reason is QuarantineReason.LEASE_LOST_LOCAL_EXECUTION_UNVERIFIED
    # A process that may still run keeps the Worker from taking new work.
    lifecycle = _lifecycle(world, max_concurrency=4)
    world.client.offers = [world.offer(["sleep", "30"])]
    assert (await lifecycle.tick()).pull == "an unverified process is still alive"
    world.processes.refuse_signals = False


async def test_terminal_stops_the_exact_process_and_quarantines(world: World) -> None:
    offer_id = world.admit(["sleep", "30"])
    await world.reconciler.reconcile(offer_id)
    world.client.control_answer = lambda _: ws.ControlLeaseResponse(
        terminal=worker_pb2.LeaseTerminal(
            run_state=lifecycle_pb2.RUN_STATE_CANCELLED,
            attempt_state=lifecycle_pb2.ATTEMPT_STATE_CANCELLED,
        )
    )
    assert await world.reconciler.reconcile(offer_id) is Outcome.TERMINAL
    record = world.inbox.get(offer_id)
    assert record is not None
    assert record.quarantine_reason is QuarantineReason.CONTROL_PLANE_TERMINAL
    assert "CompleteAttempt" not in world.client.calls, "an old Worker writes no terminal"
    identity = identity_of(record)
    assert identity is not None
    assert world.processes.poll(identity) is not None


async def test_a_fenced_refusal_is_a_lost_lease(world: World) -> None:
    offer_id = world.admit(["sleep", "30"])
    await world.reconciler.reconcile(offer_id)

    def refuse(_: ws.ControlLeaseRequest) -> ws.ControlLeaseResponse:
        raise CallFailed("ControlLease", grpc.StatusCode.ABORTED, "SESSION_FENCED")

    world.client.control_answer = refuse
    assert await world.reconciler.reconcile(offer_id) is Outcome.LEASE_LOST
    record = world.inbox.get(offer_id)
    assert record is not None
    assert record.detail is not None
    assert record.detail.startswith("SESSION_FENCED")


async def test_a_transient_failure_changes_nothing(world: World) -> None:
    offer_id = world.admit(["sleep", "30"])
    await world.reconciler.reconcile(offer_id)
    before = world.inbox.get(offer_id)

    def unavailable(_: ws.ControlLeaseRequest) -> ws.ControlLeaseResponse:
        raise CallFailed("ControlLease", grpc.StatusCode.UNAVAILABLE, None)

    world.client.control_answer = unavailable
    assert await world.reconciler.reconcile(offer_id) is Outcome.WAITING
    assert world.inbox.get(offer_id) == before


async def test_reconcile_is_coalesced_per_offer(world: World) -> None:
    offer_id = world.admit(["sleep", "30"])
    await world.reconciler.reconcile(offer_id)
    world.client.control_gate = asyncio.Event()
    first = asyncio.create_task(world.reconciler.reconcile(offer_id))
    second = asyncio.create_task(world.reconciler.reconcile(offer_id))
    await asyncio.sleep(0.05)
    world.client.control_gate.set()
    assert await asyncio.gather(first, second) == [Outcome.RUNNING, Outcome.RUNNING]
    assert world.client.calls.count("ControlLease") == 1


async def test_a_one_sided_activation_is_a_start_failure_and_nothing_runs(
    world: World, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    offer_id = world.admit(["touch", str(marker)], timeout_ms=60_000)
    world.client.activation = _activation(None)  # the plan has a timeout; no deadline came
    assert await world.reconciler.reconcile(offer_id) is Outcome.START_FAILED
    assert world.client.calls == ["ClaimOffer", "AcknowledgeStarting", "ReportStartFailure"]
    record = world.inbox.get(offer_id)
    assert record is not None
    assert record.quarantine_reason is QuarantineReason.START_FAILED
    assert record.executor_pid is None
    await asyncio.sleep(0.1)
    assert not marker.exists()


async def test_a_missing_executable_is_reported_as_a_start_failure(world: World) -> None:
    offer_id = world.admit(["/nonexistent/qinglong-test-binary"])
    assert await world.reconciler.reconcile(offer_id) is Outcome.START_FAILED
    assert world.client.calls[-1] == "ReportStartFailure"
    record = world.inbox.get(offer_id)
    assert record is not None
    assert record.start_failure == "executable not found"


def test_activation_must_agree_with_the_plan() -> None:
    assert activation_problem(60_000, _activation(60_000)) == ""
    assert activation_problem(None, _activation(None)) == ""
    assert activation_problem(60_000, _activation(None))
    assert activation_problem(None, _activation(60_000))
    assert activation_problem(30_000, _activation(60_000))
    one_sided = _activation(60_000)
    one_sided.ClearField("deadline")
    assert activation_problem(60_000, one_sided)


def test_completion_outcome_follows_the_stop_reason_then_the_exit() -> None:
    assert completion_outcome(None, ExitStatus(0, None)) == "succeeded"
    assert completion_outcome(None, ExitStatus(3, None)) == "failed"
    assert completion_outcome(None, ExitStatus(None, None)) == "failed"
    assert completion_outcome("user", ExitStatus(0, None)) == "cancelled"
    assert completion_outcome("timeout", ExitStatus(None, 15)) == "timed_out"


def test_capabilities_are_strong_and_fresh() -> None:
    values = {new_capability() for _ in range(100)}
    assert len(values) == 100
    assert all(bounds.is_acceptable_lease_capability(value) for value in values)


class StubSession:
    worker_id = WORKER

    def __init__(self, active: ActiveSession | None) -> None:
        self._active = active

    async def ensure(self) -> ActiveSession | None:
        return self._active


def _lifecycle(world: World, *, max_concurrency: int, supervise_limit: int = 0) -> Lifecycle:
    offset = world.clock_offset_ms
    session = ActiveSession(
        SESSION, 1, worker_pb2.SESSION_STATE_ONLINE, renew_at=1e18, expires_at=1e18
    )
    return Lifecycle(
        settings=LifecycleSettings(
            tick_seconds=0.1, max_concurrency=max_concurrency, supervise_limit=supervise_limit
        ),
        inbox=world.inbox,
        client=world.client,  # type: ignore[arg-type]
        reconciler=world.reconciler,
        processes=world.processes,
        session=StubSession(session),  # type: ignore[arg-type]
        clock=lambda: wall_clock_ms() + offset[0],
    )


async def test_a_tick_supervises_first_then_pulls_within_capacity(world: World) -> None:
    lifecycle = _lifecycle(world, max_concurrency=2)
    world.client.offers = [world.offer(["sleep", "30"]) for _ in range(3)]
    first = await lifecycle.tick()
    assert first.pull == "pulled 2"
    assert [outcome for _, outcome in first.admitted] == [Outcome.RUNNING, Outcome.RUNNING]
    second = await lifecycle.tick()
    assert second.pull == "at capacity"
    assert world.client.calls.count("PullOffers") == 1


async def test_lease_loss_stops_pulling_for_that_tick(world: World) -> None:
    lifecycle = _lifecycle(world, max_concurrency=4)
    offer_id = world.admit(["sleep", "30"])
    await world.reconciler.reconcile(offer_id)
    world.clock_offset_ms[0] = 31_000
    world.client.offers = [world.offer(["sleep", "30"])]
    report = await lifecycle.tick()
    assert report.supervised == ((offer_id, Outcome.LEASE_LOST),)
    assert report.pull.startswith("lease lost")
    assert "PullOffers" not in world.client.calls


async def test_supervision_is_bounded_with_a_stable_cursor(world: World) -> None:
    lifecycle = _lifecycle(world, max_concurrency=4, supervise_limit=2)
    offers = [world.admit(["sleep", "30"]) for _ in range(3)]
    # Records still claiming are always due: each tick reconciles at most two, in turn.
    seen = [[offer for offer, _ in (await lifecycle.tick()).supervised] for _ in range(2)]
    assert seen == [offers[:2], offers[2:]]
