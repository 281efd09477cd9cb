"""`reconcile(offer_id)` and the lifecycle's decisions (SPEC R-W-2, R-W-4, R-TO-2), with a real
inbox and real processes; only the network is a scripted stand-in, so that the order of
what is persisted, stopped and sent can be observed exactly."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import itertools
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, Final

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp
from prometheus_client import REGISTRY
from qinglong.rpc.v1 import execution_pb2, lifecycle_pb2
from qinglong.rpc.v1.error_reason_pb2 import ErrorReason
from qinglong.worker.v1 import worker_pb2
from qinglong.worker.v1 import worker_service_pb2 as ws
from qinglong_protocol import bounds
from qinglong_protocol.errors import EXPECTED_OFFSET
from qinglong_worker import inbox as inbox_module
from qinglong_worker import process, supervisor
from qinglong_worker.client import CallFailed, RetryPolicy
from qinglong_worker.clock import BootInstant, boot_now
from qinglong_worker.heartbeat import Heartbeat, heartbeat_age
from qinglong_worker.inbox import Inbox, InboxRecord, QuarantineReason, RecordState
from qinglong_worker.launch import launch_key
from qinglong_worker.lifecycle import InboxFailed, Lifecycle, LifecycleSettings, ShutdownSignals
from qinglong_worker.output import CALL_BUDGET_SECONDS, CHUNKS_PER_PASS, log_file
from qinglong_worker.process import ExitStatus, ProcessController, StopResult
from qinglong_worker.reconcile import (
    LEASE_GONE_STOP_GRACE_SECONDS,
    LOCAL_SHUTDOWN,
    Mode,
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
        self.budgets: list[tuple[str, float | None]] = []
        self.lease_version = 1
        self.lease_ms = 30_000  # what a claim and a renewal leave of the lease
        self.last_words: list[bool] = []  # ControlLease asked after an ending (one try)
        self.activation: worker_pb2.ActivationSnapshot = _activation(60_000)
        self.starting_outcome: worker_pb2.StartingOutcome.ValueType = (
            worker_pb2.STARTING_OUTCOME_STARTING
        )
        self.control_answer: Callable[[ws.ControlLeaseRequest], ws.ControlLeaseResponse] = (
            self._renew
        )
        self.control_gate: asyncio.Event | None = None
        # Set: PullOffers waits for it (pull_waiting says one does).
        self.pull_gate: asyncio.Event | None = None
        self.pull_waiting = False
        self.offers: list[worker_pb2.Offer] = []
        self.seen_versions: list[int] = []
        self.plans: dict[str, execution_pb2.ExecutionPlan] = {}
        self.parameters: dict[str, dict[str, str]] = {}  # by offer, in its claim's spec
        self.completed = ws.CompleteAttemptRequest()
        self.completion_refusals: list[CallFailed] = []
        # Output as a correct server keeps it: one stream, idempotent by offset.
        # One stream per Attempt, as control keeps them: bytes sent under one Attempt's
        # fence can never count as another's.
        self.outputs: dict[str, bytearray] = {}
        self.appended: list[tuple[int, int, bool]] = []  # (offset, size, replayed)
        self.lose_append_answers: set[int] = set()  # 1-based append calls
        self.answer_gaps = False  # refuse a gap like control, instead of failing the test
        self.append_refusal: CallFailed | None = None  # every append is refused so
        self.on_append: Callable[[], None] = lambda: None  # e.g. time passing
        self.unreachable_attempts: set[str] = set()  # their appends fail UNAVAILABLE
        self.log_artifact_ids: list[str] = []

    async def append_output(
        self, request: ws.AppendOutputRequest, *, budget_seconds: float | None = None
    ) -> ws.AppendOutputResponse:
        self._record("AppendOutput", request, budget_seconds)
        self.on_append()
        if self.append_refusal is not None:
            raise self.append_refusal
        if request.fence.attempt_id in self.unreachable_attempts:
            raise CallFailed("AppendOutput", grpc.StatusCode.UNAVAILABLE, None)
        offset, data = request.offset, request.data
        output = self.outputs.setdefault(request.fence.attempt_id, bytearray())
        if offset > len(output) and self.answer_gaps:
            raise CallFailed(
                "AppendOutput",
                grpc.StatusCode.ABORTED,
                ErrorReason.ERROR_REASON_OUTPUT_OFFSET_GAP,
                metadata={EXPECTED_OFFSET: str(len(output))},
            )
        assert offset <= len(output), "a gap: the Worker skipped output"
        assert output[offset : offset + len(data)] == data[: len(output) - offset]
        replayed = offset + len(data) <= len(output)
        output[offset:] = data if not replayed else output[offset:]
        self.appended.append((offset, len(data), replayed))
        if len(self.appended) in self.lose_append_answers:
            raise CallFailed("AppendOutput", grpc.StatusCode.UNAVAILABLE, None)
        return ws.AppendOutputResponse(end_offset=len(output), replayed=replayed)

    @property
    def output(self) -> bytearray:
        """The one Attempt's stream, in tests that run one."""
        [stream] = self.outputs.values()
        return stream

    def _record(self, name: str, request: Any, budget_seconds: float | None) -> None:
        self.calls.append(name)
        self.budgets.append((name, budget_seconds))
        if hasattr(request, "fence"):
            self.seen_versions.append(request.fence.expected_lease_version)

    def _renew(self, request: ws.ControlLeaseRequest) -> ws.ControlLeaseResponse:
        self.lease_version = request.fence.expected_lease_version + 1
        return self._renewed(self.lease_version)

    def _renewed(self, version: int) -> ws.ControlLeaseResponse:
        return ws.ControlLeaseResponse(
            renewed=worker_pb2.LeaseRenewed(
                lease_version=version, lease_remaining=_duration(self.lease_ms)
            )
        )

    async def pull_offers(
        self, request: ws.PullOffersRequest, *, budget_seconds: float | None = None
    ) -> ws.PullOffersResponse:
        self._record("PullOffers", request, budget_seconds)
        if self.pull_gate is not None:
            self.pull_waiting = True
            await self.pull_gate.wait()
        offers, self.offers = self.offers[: request.max_offers], self.offers[request.max_offers :]
        return ws.PullOffersResponse(offers=offers)

    async def claim_offer(
        self, request: ws.ClaimOfferRequest, *, budget_seconds: float | None = None
    ) -> ws.ClaimOfferResponse:
        self._record("ClaimOffer", request, budget_seconds)
        assert bounds.is_acceptable_lease_capability(request.lease_token)
        return ws.ClaimOfferResponse(
            attempt_id=str(uuid.uuid4()),
            lease_generation=1,
            lease_version=1,
            lease_remaining=_duration(self.lease_ms),
            spec=worker_pb2.ExecutionSpec(
                plan=self.plans[request.offer_id],
                parameters=self.parameters.get(request.offer_id, {}),
            ),
        )

    async def acknowledge_starting(
        self, request: ws.AcknowledgeStartingRequest, *, budget_seconds: float | None = None
    ) -> ws.AcknowledgeStartingResponse:
        self._record("AcknowledgeStarting", request, budget_seconds)
        return ws.AcknowledgeStartingResponse(
            outcome=self.starting_outcome, activation=self.activation
        )

    async def acknowledge_running(
        self,
        request: ws.AcknowledgeRunningRequest,
        *,
        budget_seconds: float | None = None,
        last_word: bool = False,
    ) -> ws.AcknowledgeRunningResponse:
        self._record("AcknowledgeRunning", request, budget_seconds)
        assert bounds.is_sha256_hex(request.callback_token_digest)
        self.log_artifact_ids.append(request.log_artifact_id)
        return ws.AcknowledgeRunningResponse(
            outcome=worker_pb2.RUNNING_OUTCOME_RUNNING,
            lease_version=request.fence.expected_lease_version,
        )

    async def report_start_failure(
        self, request: ws.ReportStartFailureRequest, *, budget_seconds: float | None = None
    ) -> ws.ReportStartFailureResponse:
        self._record("ReportStartFailure", request, budget_seconds)
        return ws.ReportStartFailureResponse(
            attempt_state=lifecycle_pb2.ATTEMPT_STATE_FAILED,
            run_state=lifecycle_pb2.RUN_STATE_FAILED,
            error_code="EXECUTOR_START_FAILED",
            completed_lease_version=request.fence.expected_lease_version + 1,
        )

    async def control_lease(
        self,
        request: ws.ControlLeaseRequest,
        *,
        budget_seconds: float | None = None,
        last_word: bool = False,
    ) -> ws.ControlLeaseResponse:
        self._record("ControlLease", request, budget_seconds)
        self.last_words.append(last_word)
        if self.control_gate is not None:
            await self.control_gate.wait()
        return self.control_answer(request)

    async def complete_attempt(
        self, request: ws.CompleteAttemptRequest, *, budget_seconds: float | None = None
    ) -> ws.CompleteAttemptResponse:
        self._record("CompleteAttempt", request, budget_seconds)
        self.completed = request
        if self.completion_refusals:
            raise self.completion_refusals.pop(0)
        return ws.CompleteAttemptResponse(
            outcome=worker_pb2.COMPLETION_OUTCOME_COMPLETED,
            completed_lease_version=request.fence.expected_lease_version + 1,
        )


class RecordingProcesses(ProcessController):
    """The real controller; remembers what the inbox said when each stop began."""

    def __init__(self, inbox: Inbox) -> None:
        super().__init__(status_dir=inbox.path.parent / "exits")
        self.inbox = inbox
        self.versions_at_stop: list[int | None] = []
        self.reasons_at_stop: list[str | None] = []
        self.graces: list[float] = []
        self.refuse_signals = False
        self.refusal_seconds = 0.0  # how long a refused stop takes (its kill wait)
        self.refusing = self.most_refusing = 0

    async def stop(self, identity: Any, **kwargs: Any) -> StopResult:
        records = [r for r in self.inbox.records() if identity_of(r) == identity]
        self.versions_at_stop.extend(r.lease_version for r in records)
        self.reasons_at_stop.extend(r.stop_reason for r in records)
        self.graces.append(kwargs.get("grace_seconds", 5.0))
        if self.refuse_signals:
            self.refusing += 1
            self.most_refusing = max(self.most_refusing, self.refusing)
            try:
                await asyncio.sleep(self.refusal_seconds)
            finally:
                self.refusing -= 1
            return StopResult.UNVERIFIED
        return await super().stop(identity, **kwargs)


@dataclasses.dataclass
class World:
    inbox: Inbox
    client: ScriptedClient
    processes: RecordingProcesses
    reconciler: Reconciler
    clock_offset_ms: list[int]
    """How far the lease (boot) clock is ahead of the real one: time passing."""
    wall_offset_ms: list[int]
    """How far the wall clock was stepped (NTP, a resumed VM, an administrator)."""

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


def _lease_clock(offset: list[int]) -> Callable[[], BootInstant]:
    """The boot clock, ``offset[0]`` ms ahead."""

    def now() -> BootInstant:
        real = boot_now()
        return dataclasses.replace(real, ms=real.ms + offset[0])

    return now


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    inbox = Inbox.open(tmp_path / "inbox.db")
    client = ScriptedClient()
    processes = RecordingProcesses(inbox)
    offset, wall_offset = [0], [0]
    reconciler = Reconciler(
        inbox=inbox,
        client=client,  # type: ignore[arg-type]
        processes=processes,
        lease_clock=_lease_clock(offset),
        wall_clock=lambda: wall_clock_ms() + wall_offset[0],
        stop_grace_seconds=2.0,
        log_dir=tmp_path,
    )
    yield World(inbox, client, processes, reconciler, offset, wall_offset)
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


def _stop_answer(request: ws.ControlLeaseRequest) -> ws.ControlLeaseResponse:
    return ws.ControlLeaseResponse(
        stop_requested=worker_pb2.LeaseStopRequested(
            lease_version=request.fence.expected_lease_version + 1,
            lease_remaining=_duration(30_000),
            cancel_reason=lifecycle_pb2.CANCEL_REASON_USER,
        )
    )


async def _stop_answered_after(world: World, argv: list[str], meanwhile: Any) -> Outcome:
    """Lease control answers `stop_requested` (user) only once `meanwhile` has run: the
    executor may end by then, before the Worker signals anything."""
    offer_id = world.admit(argv)
    assert await world.reconciler.reconcile(offer_id) is Outcome.RUNNING
    world.client.control_answer = _stop_answer
    world.client.control_gate = asyncio.Event()
    world.clock_offset_ms[0] += 11_000  # lease control is due
    asked = world.client.calls.count("ControlLease")
    pass_ = asyncio.ensure_future(world.reconciler.reconcile(offer_id))
    # The pass is waiting for the answer: what `meanwhile` does happens while it travels,
    # not before the pass looked at the executor (which would be an ending of its own).
    await _until(lambda: world.client.calls.count("ControlLease") > asked)
    await meanwhile(_record_of(world, offer_id))
    world.client.control_gate.set()
    return await pass_


async def test_an_executor_that_ended_while_the_stop_was_on_its_way_keeps_its_outcome(
    world: World,
) -> None:
    """It exited 0 by itself while `stop_requested` travelled: nothing was signalled, so
    it succeeded — not `cancelled` (control takes success as a fact whatever was asked)."""

    async def let_it_exit(record: Any) -> None:
        identity = identity_of(record)
        assert identity is not None
        await _until(lambda: world.processes.poll(identity) is not None)

    outcome = await _stop_answered_after(world, ["sh", "-c", "sleep 0.3; exit 0"], let_it_exit)
    assert outcome is Outcome.COMPLETED
    request = world.client.completed
    assert (request.outcome, request.exit_code) == (worker_pb2.ATTEMPT_OUTCOME_SUCCEEDED, 0)


async def test_an_executor_killed_by_a_signal_before_the_stop_is_reported_stopped(
    world: World,
) -> None:
    """Found gone, but ended by a signal (here another's SIGKILL): not an outcome of its
    own, so the stop the control plane asked for is what is reported."""

    async def kill_it(record: Any) -> None:
        identity = identity_of(record)
        assert identity is not None
        os.killpg(identity.pid, signal.SIGKILL)
        await _until(lambda: world.processes.poll(identity) is not None)

    outcome = await _stop_answered_after(world, ["sleep", "30"], kill_it)
    assert outcome is Outcome.COMPLETED
    assert world.client.completed.outcome == worker_pb2.ATTEMPT_OUTCOME_CANCELLED


def _assert_ran_and_succeeded(world: World) -> None:
    """The executor's start was never reported as a failure; its own ending (exit 0) was."""
    assert "ReportStartFailure" not in world.client.calls
    request = world.client.completed
    assert (request.outcome, request.exit_code) == (worker_pb2.ATTEMPT_OUTCOME_SUCCEEDED, 0)


async def test_a_supervisor_slow_to_answer_is_settled_from_its_launch_claim(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The supervisor answers after the spawn's bound (its claim's fsyncs on a slow disk,
    here a bound shorter than its start): the executor it started is not killed and
    reported as a start that never happened; the launch claim settles the record, which
    is adopted and runs to its own ending, once."""
    monkeypatch.setattr(process, "_READY_TIMEOUT_SECONDS", 0.001)
    offer_id = world.admit(["sh", "-c", "sleep 0.3; exit 0"])
    outcomes = [await world.reconciler.reconcile(offer_id)]
    assert outcomes[0] is Outcome.WAITING, "the spawn's answer did not come in time"
    assert _record_of(world, offer_id).state is RecordState.LAUNCHING
    outcomes += await _reconciled_until(world.reconciler, offer_id, Outcome.COMPLETED.__eq__)
    assert world.client.calls.count("AcknowledgeRunning") == 1
    _assert_ran_and_succeeded(world)


async def test_a_slow_supervisor_that_started_nothing_is_forgotten_once_settled(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its answer (no such executable) came after the bound: the claim settles the record
    as a start failure, and the ended supervisor is not kept among the processes the
    Worker supervises and would stop (one entry per such start, for the Worker's life)."""
    monkeypatch.setattr(process, "_READY_TIMEOUT_SECONDS", 0.001)
    offer_id = world.admit(["/nonexistent/qinglong-test-binary"])
    assert await world.reconciler.reconcile(offer_id) is Outcome.WAITING
    assert world.processes.known(), "the unanswered supervisor is known while it may start"
    await _reconciled_until(world.reconciler, offer_id, Outcome.START_FAILED.__eq__)
    assert world.client.calls[-1] == "ReportStartFailure"
    assert _record_of(world, offer_id).start_failure == "executable not found"
    assert world.processes.known() == frozenset()


async def test_an_answer_that_came_while_the_loop_was_held_up_is_the_answer(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop is held up (a slow fsync, starved of CPU) past the spawn's bound while the
    supervisor answers and a short executor runs to its end: the answer and the timer
    come in the same turn of the loop. Before, the timer won, the answer was dropped, and
    an executor that had run and exited 0 was reported as a start failure (found by the
    replica failover test, once in about fifty runs)."""
    marks = tmp_path / "marks"
    waiting_for_answer = process._await_ready

    async def held_up(descriptor: int, timeout_seconds: float) -> str:
        # Once the reader and the timer are set, the loop stops for longer than both the
        # bound and the executor take.
        asyncio.get_running_loop().call_soon(time.sleep, 1.5)
        return await waiting_for_answer(descriptor, 0.2)

    monkeypatch.setattr(process, "_await_ready", held_up)
    script = f"echo start >> {marks}; sleep 0.1; echo end >> {marks}; exit 0"
    offer_id = world.admit(["sh", "-c", script])
    await _until_completed(world.reconciler, offer_id)
    assert marks.read_text().split() == ["start", "end"]
    _assert_ran_and_succeeded(world)


async def test_a_supervisor_that_ended_unheard_is_settled_from_its_claim(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No answer was read within the bound, and by then the supervisor had ended with its
    short executor: its launch claim says the executor started, so the record is adopted
    and its own ending reported, never a start failure."""
    marks = tmp_path / "marks"

    async def never_heard(descriptor: int, timeout_seconds: float) -> str:
        await _until(lambda: marks.exists() and "end" in marks.read_text())
        await asyncio.sleep(0.3)  # the supervisor records the status and exits
        raise OSError(errno.ETIMEDOUT, "the executor supervisor did not report its start")

    monkeypatch.setattr(process, "_await_ready", never_heard)
    script = f"echo start >> {marks}; echo end >> {marks}; exit 0"
    offer_id = world.admit(["sh", "-c", script])
    assert await world.reconciler.reconcile(offer_id) is Outcome.WAITING
    assert _record_of(world, offer_id).state is RecordState.LAUNCHING
    await _until_completed(world.reconciler, offer_id)
    _assert_ran_and_succeeded(world)


async def test_a_launch_claim_that_cannot_be_read_leaves_the_launch_undecided(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Worker restarted while a record was `launching` finds the supervisor's claim but
    cannot read it (here for real: a directory stands at its path, EISDIR; in life too
    many open files or an I/O error). Its executor may run, so the launch is not taken
    as never started — no start failure is reported — until the claim can be read; then
    the executor is adopted and runs to its own ending, once."""
    monkeypatch.setattr(process, "_READY_TIMEOUT_SECONDS", 0.001)
    offer_id = world.admit(["sh", "-c", "sleep 0.5; exit 0"])
    assert await world.reconciler.reconcile(offer_id) is Outcome.WAITING
    record = _record_of(world, offer_id)
    key = launch_key(record.offer_id, record.attempt_id or "")
    assert world.processes.status_dir == tmp_path / "exits"  # shared with the restart
    claim = world.processes.status_dir / supervisor.launch_file_name(key)
    await _until(lambda: claim.exists() and b'"ok ' in claim.read_bytes())
    restarted = _restarted(world, tmp_path)  # not the supervisor's parent: no spawn answer
    aside = claim.with_name(claim.name + ".aside")
    claim.rename(aside)
    claim.mkdir()
    for _ in range(3):
        assert await restarted.reconciler.reconcile(offer_id) is Outcome.WAITING
    assert _record_of(world, offer_id).state is RecordState.LAUNCHING
    assert "ReportStartFailure" not in world.client.calls
    claim.rmdir()
    aside.rename(claim)
    await _until_completed(restarted.reconciler, offer_id)
    _assert_ran_and_succeeded(world)


async def test_a_stop_without_a_lease_does_not_wait_out_a_long_stop_grace(
    world: World, tmp_path: Path
) -> None:
    """A fleet's long --stop-grace-seconds is for stops asked while the lease is kept.
    Once the lease is lost the control plane may start the Run elsewhere after its
    --worker-stop-ms: an executor that ignores SIGTERM is killed after the capped grace."""
    patient = dataclasses.replace(
        world,
        reconciler=Reconciler(
            inbox=world.inbox,
            client=world.client,  # type: ignore[arg-type]
            processes=world.processes,
            lease_clock=_lease_clock(world.clock_offset_ms),
            stop_grace_seconds=600.0,
            log_dir=tmp_path,
        ),
    )
    offer_id = patient.admit(["sh", "-c", "trap '' TERM; sleep 60"])
    assert await patient.reconciler.reconcile(offer_id) is Outcome.RUNNING
    patient.clock_offset_ms[0] = 31_000  # the local lease ran out
    assert await patient.reconciler.reconcile(offer_id) is Outcome.LEASE_LOST
    assert world.processes.graces == [LEASE_GONE_STOP_GRACE_SECONDS]
    record = _record_of(world, offer_id)
    assert record.quarantine_reason is QuarantineReason.LEASE_LOST_LOCAL_EXECUTION_STOPPED
    assert record.exit_signal == signal.SIGKILL  # it ignored SIGTERM; the grace ran out


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


async def test_a_wall_clock_step_moves_no_local_lease(world: World) -> None:
    """The local lease is measured on the boot clock, never on the wall clock. Stepped
    forward an hour (NTP, a resumed VM), the wall clock stops nothing early; stepped back
    a minute while ingress cannot be reached, it does not keep the executor a minute past
    the lease either: the control plane expires the lease on its own clock and may retry
    the Run elsewhere, so the Run would run twice."""
    offer_id = world.admit(["sleep", "30"])
    assert await world.reconciler.reconcile(offer_id) is Outcome.RUNNING
    identity = identity_of(_record_of(world, offer_id))
    assert identity is not None
    lifecycle = _lifecycle(world, max_concurrency=1)

    world.wall_offset_ms[0] = 3_600_000  # an hour forward; one second passes
    world.clock_offset_ms[0] = 1_000
    report = await lifecycle.tick()
    assert report.supervised == (), "neither lease control nor a lost lease is due"
    assert world.processes.poll(identity) is None, "the healthy executor runs on"

    def unreachable(_: ws.ControlLeaseRequest) -> ws.ControlLeaseResponse:
        raise CallFailed("ControlLease", grpc.StatusCode.UNAVAILABLE, None, tries=3)

    world.client.control_answer = unreachable
    world.wall_offset_ms[0] = -60_000  # a minute back; 20 s of the 30 s lease pass
    world.clock_offset_ms[0] = 20_000
    assert await world.reconciler.reconcile(offer_id) is Outcome.WAITING
    control = [budget for name, budget in world.client.budgets if name == "ControlLease"]
    assert control[-1] is not None
    assert 9.0 < control[-1] <= 10.0, "the retries' bound is what the boot clock leaves"
    calls = list(world.client.calls)
    world.clock_offset_ms[0] = 30_000  # the lease is over, whatever the wall clock says
    assert await world.reconciler.reconcile(offer_id) is Outcome.LEASE_LOST
    assert world.client.calls == calls, "the control plane was not called"
    record = _record_of(world, offer_id)
    assert record.quarantine_reason is QuarantineReason.LEASE_LOST_LOCAL_EXECUTION_STOPPED
    assert world.processes.poll(identity) is not None, "the executor was stopped on time"
    # Timestamps for humans do follow the wall clock.
    assert record.updated_unix_ms < wall_clock_ms() - 50_000


async def test_a_lease_observed_in_another_boot_is_lost(world: World) -> None:
    """A boot-clock reading means something only within its boot: a record whose lease
    was observed in another boot has no lease left, and nothing is asked of control."""
    offer_id = world.admit(["sleep", "30"])
    assert await world.reconciler.reconcile(offer_id) is Outcome.RUNNING
    record = _record_of(world, offer_id)
    assert record.lease_observed_boot_id is not None
    calls = list(world.client.calls)
    world.inbox.compare_and_set(
        record,
        dataclasses.replace(record, lease_observed_boot_id="11111111-2222-3333-4444-555555555555"),
    )
    assert world.reconciler.lease_lost_locally(_record_of(world, offer_id))
    assert await world.reconciler.reconcile(offer_id) is Outcome.LEASE_LOST
    assert world.client.calls == calls


async def test_a_running_record_of_a_schema_4_inbox_counts_as_lost(world: World) -> None:
    """A record a schema-4 Worker wrote measured its lease on the wall clock alone; the
    upgrade gives it no boot-clock observation (SQLite adds the columns empty), and so
    the upgraded Worker stops its executor at once, without trusting that estimate or
    calling control. Its ending is still reported once it is persisted."""
    offer_id = world.admit(["sleep", "30"])
    assert await world.reconciler.reconcile(offer_id) is Outcome.RUNNING
    ended_id = world.admit(["sh", "-c", "exit 0"])
    world.client.completion_refusals = [
        CallFailed("CompleteAttempt", grpc.StatusCode.UNAVAILABLE, None, tries=3)
    ]
    outcomes = await _reconciled_until(
        world.reconciler,
        ended_id,
        lambda _: _record_of(world, ended_id).state is RecordState.EXITED,  # its report is owed
    )
    assert set(outcomes) <= {Outcome.RUNNING, Outcome.WAITING}, outcomes
    calls = list(world.client.calls)
    world.inbox._db.execute(
        "UPDATE offers SET lease_observed_boot_ms = NULL, lease_observed_boot_id = NULL"
    )
    upgraded = _record_of(world, offer_id)
    assert upgraded.lease_observed_unix_ms is not None, "a fresh wall-clock estimate"
    assert upgraded.lease_observed is None
    assert await world.reconciler.reconcile(offer_id) is Outcome.LEASE_LOST
    assert world.client.calls == calls
    record = _record_of(world, offer_id)
    assert record.quarantine_reason is QuarantineReason.LEASE_LOST_LOCAL_EXECUTION_STOPPED
    assert record.exit_signal == signal.SIGTERM
    # The ending already persisted is reported all the same: one try, as a last word.
    assert await world.reconciler.reconcile(ended_id) is Outcome.COMPLETED
    assert world.client.calls[len(calls) :] == ["CompleteAttempt"]
    assert world.client.budgets[-1] == ("CompleteAttempt", 0.0)


async def test_an_unconfirmable_stop_is_quarantined_unverified(world: World) -> None:
    offer_id = world.admit(["sleep", "30"])
    await world.reconciler.reconcile(offer_id)
    world.processes.refuse_signals = True  # e.g. EPERM, or /proc unreadable
    world.clock_offset_ms[0] = 31_000
    assert await world.reconciler.reconcile(offer_id) is Outcome.LEASE_LOST
    record = world.inbox.get(offer_id)
    assert record is not None
    assert record.quarantine_reason is QuarantineReason.LEASE_LOST_LOCAL_EXECUTION_UNVERIFIED
    # A process that may still run keeps the Worker from taking new work...
    lifecycle = _lifecycle(world, max_concurrency=4)
    world.client.offers = [world.offer(["sleep", "30"])]
    assert (await lifecycle.tick()).pull == "an unverified process is still alive"
    # ...and each tick tries again to stop it: its lease is gone, and the Run may start
    # elsewhere. Once the stop can be done, it is, and work is taken again.
    world.processes.refuse_signals = False
    identity = identity_of(record)
    assert identity is not None
    assert world.processes.poll(identity) is None, "still running before the next tick"
    assert (await lifecycle.tick()).pull != "an unverified process is still alive"
    assert world.processes.poll(identity) is not None


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


async def test_a_terminal_answer_whose_stop_is_unconfirmed_keeps_pulls_blocked(
    world: World,
) -> None:
    offer_id = world.admit(["sleep", "30"])
    await world.reconciler.reconcile(offer_id)
    world.processes.refuse_signals = True  # e.g. EPERM, or /proc unreadable
    world.client.control_answer = lambda _: ws.ControlLeaseResponse(
        terminal=worker_pb2.LeaseTerminal(
            run_state=lifecycle_pb2.RUN_STATE_CANCELLED,
            attempt_state=lifecycle_pb2.ATTEMPT_STATE_CANCELLED,
        )
    )
    assert await world.reconciler.reconcile(offer_id) is Outcome.TERMINAL
    record = world.inbox.get(offer_id)
    assert record is not None
    assert record.quarantine_reason is QuarantineReason.LEASE_LOST_LOCAL_EXECUTION_UNVERIFIED
    assert record.detail is not None
    assert record.detail.startswith("RUN_STATE_CANCELLED")
    lifecycle = _lifecycle(world, max_concurrency=4)
    world.client.offers = [world.offer(["sleep", "30"])]
    assert (await lifecycle.tick()).pull == "an unverified process is still alive"
    world.processes.refuse_signals = False


async def test_executors_whose_stop_cannot_be_confirmed_are_stopped_again_together(
    world: World,
) -> None:
    """Each tick stops again every executor that outlived its lease unverified (one in
    uninterruptible sleep waits out its kill wait). One after another, N of them held
    the tick's lease control of every healthy Run back N kill waits; together, one."""
    offers = [world.admit(["sleep", "30"]) for _ in range(3)]
    for offer_id in offers:
        assert await world.reconciler.reconcile(offer_id) is Outcome.RUNNING
    world.processes.refuse_signals = True
    world.clock_offset_ms[0] += 60_000  # every local lease ran out
    for offer_id in offers:
        assert await world.reconciler.reconcile(offer_id) is Outcome.LEASE_LOST
    world.processes.refusal_seconds = 0.2
    await _lifecycle(world, max_concurrency=4).tick()
    assert world.processes.most_refusing == len(offers)
    world.processes.refuse_signals = False


async def test_a_starting_answered_already_running_starts_nothing(world: World) -> None:
    """`running` is durable although this inbox never launched: an inbox restored from a
    backup, or a copied volume. Starting an executor would run the Run twice."""
    offer_id = world.admit(["sleep", "30"])
    world.client.starting_outcome = worker_pb2.STARTING_OUTCOME_ALREADY_RUNNING
    assert await world.reconciler.reconcile(offer_id) is Outcome.TERMINAL
    assert world.client.calls == ["ClaimOffer", "AcknowledgeStarting"]
    record = world.inbox.get(offer_id)
    assert record is not None
    assert (record.state, record.quarantine_reason) == (
        RecordState.QUARANTINED,
        QuarantineReason.RUNNING_ELSEWHERE,
    )
    assert not record.has_executor
    assert world.processes.known() == frozenset(), "nothing was spawned"
    await world.reconciler.reconcile(offer_id)  # a closed record: nothing more is asked
    assert world.client.calls == ["ClaimOffer", "AcknowledgeStarting"]


async def test_a_fenced_refusal_is_a_lost_lease(world: World) -> None:
    offer_id = world.admit(["sleep", "30"])
    await world.reconciler.reconcile(offer_id)

    def refuse(_: ws.ControlLeaseRequest) -> ws.ControlLeaseResponse:
        raise CallFailed(
            "ControlLease", grpc.StatusCode.ABORTED, ErrorReason.ERROR_REASON_SESSION_FENCED
        )

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
    assert list(await asyncio.gather(first, second)) == [Outcome.RUNNING, Outcome.RUNNING]
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
        self.drained = 0
        self.forgotten: list[str] = []

    async def ensure(self) -> ActiveSession | None:
        return self._active

    def forget(self, session_id: str) -> None:
        self.forgotten.append(session_id)

    async def drain(self) -> None:
        self.drained += 1


def _online() -> StubSession:
    """The session as an online one that never needs renewing."""
    return StubSession(
        ActiveSession(SESSION, 1, worker_pb2.SESSION_STATE_ONLINE, renew_at=1e18, expires_at=1e18)
    )


def _lifecycle(
    world: World,
    *,
    max_concurrency: int,
    supervise_limit: int = 0,
    session: StubSession | None = None,
    **settings: Any,
) -> Lifecycle:
    return Lifecycle(
        settings=LifecycleSettings(
            tick_seconds=0.1,
            max_concurrency=max_concurrency,
            supervise_limit=supervise_limit,
            **settings,
        ),
        inbox=world.inbox,
        client=world.client,  # type: ignore[arg-type]
        reconciler=world.reconciler,
        processes=world.processes,
        session=session or _online(),  # type: ignore[arg-type]
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


# --- retries, fences and the local lease (SPEC R-LC-8, R-W-2) -----------------------------------


async def test_lease_holding_calls_may_retry_only_within_the_local_lease(world: World) -> None:
    offer_id = world.admit(["sleep", "30"])
    await world.reconciler.reconcile(offer_id)
    world.clock_offset_ms[0] = 20_000  # 20 of the 30 s the claim answered have passed
    assert await world.reconciler.reconcile(offer_id) is Outcome.RUNNING
    budgets = dict(world.client.budgets)
    assert budgets["ClaimOffer"] is None, "no lease yet: the client's default bound"
    for name in ("AcknowledgeStarting", "AcknowledgeRunning"):
        budget = budgets[name]
        assert budget is not None
        assert 29.0 < budget <= 30.0
    control = budgets["ControlLease"]
    assert control is not None
    assert 9.0 < control <= 10.0, "what is left of the local lease, not more"


async def test_a_refusal_without_a_fence_keeps_the_process_until_the_lease_runs_out(
    world: World,
) -> None:
    offer_id = world.admit(["sleep", "30"])
    await world.reconciler.reconcile(offer_id)
    before = world.inbox.get(offer_id)
    assert before is not None
    identity = identity_of(before)
    assert identity is not None

    def conflict(_: ws.ControlLeaseRequest) -> ws.ControlLeaseResponse:
        raise CallFailed(
            "ControlLease", grpc.StatusCode.ABORTED, ErrorReason.ERROR_REASON_STATE_CONFLICT
        )

    world.client.control_answer = conflict
    assert await world.reconciler.reconcile(offer_id) is Outcome.REFUSED
    assert Outcome.REFUSED.stops_pulling
    assert world.inbox.get(offer_id) == before, "nothing changed locally"
    assert world.processes.poll(identity) is None, "the executor still runs"
    world.clock_offset_ms[0] = 31_000
    assert await world.reconciler.reconcile(offer_id) is Outcome.LEASE_LOST
    after = world.inbox.get(offer_id)
    assert after is not None
    assert (after.quarantine_reason, after.exit_signal) == (
        QuarantineReason.LEASE_LOST_LOCAL_EXECUTION_STOPPED,
        signal.SIGTERM,
    )


async def test_retries_that_outlive_the_local_lease_stop_the_process_at_once(
    world: World,
) -> None:
    offer_id = world.admit(["sleep", "30"])
    await world.reconciler.reconcile(offer_id)

    def unavailable_until_the_lease_is_gone(_: ws.ControlLeaseRequest) -> ws.ControlLeaseResponse:
        world.clock_offset_ms[0] = 31_000  # the client's retries used up the lease
        raise CallFailed("ControlLease", grpc.StatusCode.UNAVAILABLE, None, tries=9)

    world.client.control_answer = unavailable_until_the_lease_is_gone
    assert await world.reconciler.reconcile(offer_id) is Outcome.LEASE_LOST
    record = world.inbox.get(offer_id)
    assert record is not None
    assert record.quarantine_reason is QuarantineReason.LEASE_LOST_LOCAL_EXECUTION_STOPPED
    assert record.detail is not None
    assert record.detail.startswith("UNAVAILABLE; local lease expired")
    assert record.exit_signal == signal.SIGTERM


def _slow_supervisor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every spawn's supervisor sleeps ``seconds`` before it is the real one (same
    process): a supervisor slow to answer, as on a slow disk. The seam is the program
    every spawn runs, ``process.SUPERVISOR_SCRIPT``."""
    script = tmp_path / "slow_supervisor.py"
    script.write_text(
        "import runpy, sys, time\n"
        f"time.sleep({seconds!r})\n"
        f"sys.argv[0] = {str(process.SUPERVISOR_SCRIPT)!r}\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    monkeypatch.setattr(process, "SUPERVISOR_SCRIPT", script)


async def _launching(world: World, offer_id: str) -> None:
    """Wait until the record is ``launching``: its spawn is under way."""
    await _until(lambda: _record_of(world, offer_id).state is RecordState.LAUNCHING)


async def test_other_runs_lease_control_goes_on_while_a_supervisor_is_slow_to_start(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spawn waits for its supervisor on the event loop: meanwhile another Run's lease
    is renewed, and a tick supervises and returns (the start is in flight)."""
    running = world.admit(["sleep", "30"])
    assert await world.reconciler.reconcile(running) is Outcome.RUNNING
    _slow_supervisor(tmp_path, monkeypatch, seconds=1.5)
    slow = world.admit(["sleep", "30"])
    starting = asyncio.create_task(world.reconciler.reconcile(slow))
    await _launching(world, slow)
    controls = world.client.calls.count("ControlLease")
    assert await world.reconciler.reconcile(running) is Outcome.RUNNING
    assert world.client.calls.count("ControlLease") == controls + 1, "renewed meanwhile"
    assert _record_of(world, running).lease_version == 2
    report = await _lifecycle(world, max_concurrency=4, reconcile_wait_seconds=0.2).tick()
    assert (slow, Outcome.IN_FLIGHT) in report.supervised
    assert _record_of(world, slow).state is RecordState.LAUNCHING, "still spawning"
    assert await starting is Outcome.RUNNING
    assert _record_of(world, slow).state is RecordState.RUNNING_ACKNOWLEDGED


async def test_a_shutdown_abort_during_a_slow_spawn_waits_for_its_identity(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The spawn and the persisting of the identity it returns stay one step, as when the
    spawn blocked: an abort that comes while the supervisor has yet to answer waits for
    both, so the record names its executor (and every stop can find it) instead of
    staying ``launching`` over a supervisor nobody tracks."""
    _slow_supervisor(tmp_path, monkeypatch, seconds=0.5)
    offer_id = world.admit(["sleep", "30"])
    starting = asyncio.create_task(world.reconciler.reconcile(offer_id))
    await _launching(world, offer_id)
    await world.reconciler.abort()
    assert starting.cancelled()
    record = _record_of(world, offer_id)
    assert record.state is RecordState.STARTED
    identity = identity_of(record)
    assert identity is not None
    assert world.processes.poll(identity) is None
    assert world.processes.known() == frozenset({identity})


async def test_a_restarted_worker_reports_the_exit_status_the_supervisor_kept(
    world: World, tmp_path: Path
) -> None:
    offer_id = world.admit(["sh", "-c", "sleep 0.3; exit 3"])
    assert await world.reconciler.reconcile(offer_id) is Outcome.RUNNING
    record = world.inbox.get(offer_id)
    assert record is not None
    identity = identity_of(record)
    assert identity is not None
    # Another controller on the same status directory: the supervisor is not its child.
    restarted = Reconciler(
        inbox=world.inbox,
        client=world.client,  # type: ignore[arg-type]
        processes=ProcessController(status_dir=tmp_path / "exits"),
        log_dir=tmp_path,
    )
    await _until_completed(restarted, offer_id)
    assert world.client.completed.outcome == worker_pb2.ATTEMPT_OUTCOME_FAILED
    assert world.client.completed.exit_code == 3
    assert world.processes.poll(identity) is not None  # reap the first's child


# --- shutdown ---------------------------------------------------------------------------------


async def test_draining_takes_no_new_work(world: World) -> None:
    offer_id = world.admit(["sleep", "30"])
    world.reconciler.set_mode(Mode.DRAINING)
    assert await world.reconciler.reconcile(offer_id) is Outcome.HELD
    assert world.client.calls == []
    with pytest.raises(ValueError, match="cannot go back"):
        world.reconciler.set_mode(Mode.NORMAL)


async def test_a_shutdown_stop_is_persisted_first_and_reported_as_shutdown(world: World) -> None:
    offer_id = world.admit(["sleep", "30"])
    await world.reconciler.reconcile(offer_id)
    world.reconciler.set_mode(Mode.STOPPING)
    assert await world.reconciler.reconcile(offer_id) is Outcome.COMPLETED
    assert world.processes.reasons_at_stop == [LOCAL_SHUTDOWN], "durable before the signal"
    assert "ControlLease" not in world.client.calls
    request = world.client.completed
    assert request.outcome == worker_pb2.ATTEMPT_OUTCOME_CANCELLED
    assert request.stop_reason == lifecycle_pb2.CANCEL_REASON_SHUTDOWN
    assert "shutdown" in request.summary
    record = world.inbox.get(offer_id)
    assert record is not None
    assert (record.state, record.exit_signal) == (
        RecordState.COMPLETION_ACKNOWLEDGED,
        signal.SIGTERM,
    )


async def test_a_stop_the_control_plane_asked_for_keeps_its_own_reason(world: World) -> None:
    offer_id = world.admit(["sleep", "30"])
    await world.reconciler.reconcile(offer_id)
    record = world.inbox.get(offer_id)
    assert record is not None
    # A user cancel was learnt but the stop had not happened yet when the drain ended.
    world.inbox.compare_and_set(record, dataclasses.replace(record, stop_reason="user"))
    world.reconciler.set_mode(Mode.STOPPING)
    assert await world.reconciler.reconcile(offer_id) is Outcome.COMPLETED
    request = world.client.completed
    assert request.outcome == worker_pb2.ATTEMPT_OUTCOME_CANCELLED
    assert request.stop_reason == lifecycle_pb2.CANCEL_REASON_UNSPECIFIED


def _version_fenced(name: str) -> CallFailed:
    return CallFailed(name, grpc.StatusCode.ABORTED, ErrorReason.ERROR_REASON_LEASE_VERSION_FENCED)


async def _ending_of(world: World, exit_code: int) -> tuple[str, Outcome]:
    """Admit an executor that ends by itself with `exit_code`; reconcile until its
    ending is reported (or the record settled otherwise)."""
    offer_id = world.admit(["sh", "-c", f"exit {exit_code}"])
    outcomes = await _reconciled_until(world.reconciler, offer_id, Outcome.RUNNING.__ne__)
    return offer_id, outcomes[-1]


async def test_an_ending_refused_at_a_stale_version_is_refenced_by_the_renewals_replay(
    world: World,
) -> None:
    """Control committed a renewal whose answer the Worker never kept (killed before
    saving it, the call cancelled at shutdown): it is one version ahead when the executor
    ends. The ending is refused as fenced; lease control at the stored version is that
    renewal's replay (R-LC-8) and hands over the version; the ending is reported with it
    and keeps the executor's own outcome."""
    world.client.completion_refusals = [_version_fenced("CompleteAttempt")]
    offer_id, outcome = await _ending_of(world, 3)
    assert outcome is Outcome.COMPLETED
    assert world.client.calls[-3:] == ["CompleteAttempt", "ControlLease", "CompleteAttempt"]
    assert world.client.seen_versions[-3:] == [1, 1, 2]
    request = world.client.completed
    assert (request.outcome, request.exit_code) == (worker_pb2.ATTEMPT_OUTCOME_FAILED, 3)
    assert _record_of(world, offer_id).state is RecordState.COMPLETION_ACKNOWLEDGED


async def test_an_ending_refused_again_after_lease_control_is_lost_not_retried(
    world: World,
) -> None:
    """Lease control asked once: refused too, the lease is lost (quarantined, no loop);
    answered but the ending refused again, likewise."""
    world.client.completion_refusals = [_version_fenced("CompleteAttempt")]

    def fenced(request: ws.ControlLeaseRequest) -> ws.ControlLeaseResponse:
        raise _version_fenced("ControlLease")

    world.client.control_answer = fenced
    offer_id, outcome = await _ending_of(world, 0)
    assert outcome is Outcome.LEASE_LOST
    assert world.client.calls[-2:] == ["CompleteAttempt", "ControlLease"]
    record = _record_of(world, offer_id)
    assert record.quarantine_reason is QuarantineReason.LEASE_LOST_LOCAL_EXECUTION_STOPPED

    world.client.control_answer = world.client._renew
    world.client.completion_refusals = [_version_fenced("CompleteAttempt")] * 2
    assert (await _ending_of(world, 0))[1] is Outcome.LEASE_LOST
    assert world.client.calls[-3:] == ["CompleteAttempt", "ControlLease", "CompleteAttempt"]


async def test_a_refused_shutdown_report_learns_the_runs_own_intent(world: World) -> None:
    offer_id = world.admit(["sleep", "30"])
    await world.reconciler.reconcile(offer_id)
    world.client.completion_refusals = [
        CallFailed(
            "CompleteAttempt", grpc.StatusCode.ABORTED, ErrorReason.ERROR_REASON_STATE_CONFLICT
        )
    ]
    world.client.control_answer = lambda request: ws.ControlLeaseResponse(
        stop_requested=worker_pb2.LeaseStopRequested(
            lease_version=request.fence.expected_lease_version + 1,
            lease_remaining=_duration(30_000),
            cancel_reason=lifecycle_pb2.CANCEL_REASON_TIMEOUT,
        )
    )
    world.reconciler.set_mode(Mode.STOPPING)
    assert await world.reconciler.reconcile(offer_id) is Outcome.COMPLETED
    assert world.client.calls[-3:] == ["CompleteAttempt", "ControlLease", "CompleteAttempt"]
    request = world.client.completed
    assert request.outcome == worker_pb2.ATTEMPT_OUTCOME_TIMED_OUT
    assert request.stop_reason == lifecycle_pb2.CANCEL_REASON_UNSPECIFIED
    assert world.client.seen_versions[-3:] == [1, 1, 2], "the newer version was used"
    assert world.client.last_words[-1], "asked after the ending: one try even past the lease"


async def test_a_renewal_clears_a_shutdown_stop_that_never_happened(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Worker that crashed between persisting the shutdown stop and signalling: the
    next incarnation keeps the process, which ends with its own outcome. The renewal that
    clears the stop waits for the disk, unlike a plain one: lost with the power, the stop
    would come back and the executor's own ending be reported as a shutdown."""
    offer_id = world.admit(["sh", "-c", "sleep 0.3; exit 0"])
    await world.reconciler.reconcile(offer_id)
    record = world.inbox.get(offer_id)
    assert record is not None
    world.inbox.compare_and_set(record, dataclasses.replace(record, stop_reason=LOCAL_SHUTDOWN))
    durability: list[bool] = []
    compare_and_set = world.inbox.compare_and_set

    def recording(current: Any, updated: Any, *, durable: bool = True) -> Any:
        durability.append(durable)
        return compare_and_set(current, updated, durable=durable)

    monkeypatch.setattr(world.inbox, "compare_and_set", recording)
    assert await world.reconciler.reconcile(offer_id) is Outcome.RUNNING
    assert durability == [True], "the renewal that cleared the stop is durable"
    monkeypatch.undo()
    renewed = world.inbox.get(offer_id)
    assert renewed is not None
    assert renewed.stop_reason is None
    await _until_completed(world.reconciler, offer_id)  # it ends by itself
    assert world.client.completed.outcome == worker_pb2.ATTEMPT_OUTCOME_SUCCEEDED


async def test_drain_lets_a_short_attempt_finish_and_pulls_nothing(world: World) -> None:
    session = _online()
    lifecycle = _lifecycle(world, max_concurrency=2, session=session, drain_grace_seconds=10.0)
    offer_id = world.admit(["sh", "-c", "sleep 0.4"])
    signals = ShutdownSignals()
    running = asyncio.create_task(lifecycle.run(signals))
    await _until(lambda: _state(world, offer_id) is RecordState.RUNNING_ACKNOWLEDGED)
    started = asyncio.get_running_loop().time()
    signals.signal()
    await _until(lambda: session.drained == 1)  # the loop took the signal: draining now
    pulls = world.client.calls.count("PullOffers")
    world.client.offers = [world.offer(["sleep", "30"])]  # work that comes too late
    await asyncio.wait_for(running, 5)
    assert asyncio.get_running_loop().time() - started < 3.0, "it did not wait out the grace"
    assert session.drained == 1
    assert world.client.calls.count("PullOffers") == pulls, "nothing pulled while draining"
    assert _state(world, offer_id) is RecordState.COMPLETION_ACKNOWLEDGED
    assert world.client.completed.outcome == worker_pb2.ATTEMPT_OUTCOME_SUCCEEDED
    assert world.client.completed.stop_reason == lifecycle_pb2.CANCEL_REASON_UNSPECIFIED


async def test_a_drain_lets_a_start_already_on_the_wire_land_and_run(world: World) -> None:
    """An idle Worker drained while AcknowledgeStarting is on the wire: control commits
    it, so the Attempt is `starting`. Cut off then, it would start nothing and end lost,
    using up an attempt; the drain waits for the answer and lets the executor finish."""
    answer_travels = asyncio.Event()
    acknowledge_starting = world.client.acknowledge_starting

    async def starting(request: Any, **options: Any) -> Any:
        answered = await acknowledge_starting(request, **options)  # control committed it
        await answer_travels.wait()
        return answered

    world.client.acknowledge_starting = starting  # type: ignore[method-assign]
    session = _online()
    lifecycle = _lifecycle(world, max_concurrency=1, session=session, drain_grace_seconds=30.0)
    offer = world.offer(["sh", "-c", "sleep 0.2"])
    world.client.offers = [offer]
    signals = ShutdownSignals()
    running = asyncio.create_task(lifecycle.run(signals))
    await _until(lambda: "AcknowledgeStarting" in world.client.calls)
    signals.signal()
    await _until(lambda: session.drained == 1)
    await asyncio.sleep(0.5)  # drain ticks while the answer is on its way
    answer_travels.set()
    await asyncio.wait_for(running, 30)
    assert _state(world, offer.offer_id) is RecordState.COMPLETION_ACKNOWLEDGED
    assert world.client.completed.outcome == worker_pb2.ATTEMPT_OUTCOME_SUCCEEDED


@pytest.mark.parametrize("second_signal", [False, True], ids=["grace-runs-out", "second-signal"])
async def test_what_outlives_the_drain_is_stopped_and_reported_as_shutdown(
    world: World, second_signal: bool
) -> None:
    grace = 30.0 if second_signal else 0.3
    lifecycle = _lifecycle(world, max_concurrency=2, drain_grace_seconds=grace)
    offer_id = world.admit(["sleep", "30"])
    signals = ShutdownSignals()
    running = asyncio.create_task(lifecycle.run(signals))
    await _until(lambda: _state(world, offer_id) is RecordState.RUNNING_ACKNOWLEDGED)
    record = world.inbox.get(offer_id)
    assert record is not None
    identity = identity_of(record)
    assert identity is not None
    started = asyncio.get_running_loop().time()
    signals.signal()
    if second_signal:
        await asyncio.sleep(0.3)
        assert not running.done(), "the first signal only drains"
        signals.signal()
    await asyncio.wait_for(running, 10)
    assert asyncio.get_running_loop().time() - started < 5.0
    assert world.processes.poll(identity) is not None, "nothing is left running"
    after = world.inbox.get(offer_id)
    assert after is not None
    assert (after.state, after.exit_signal) == (
        RecordState.COMPLETION_ACKNOWLEDGED,
        signal.SIGTERM,
    )
    assert world.client.completed.outcome == worker_pb2.ATTEMPT_OUTCOME_CANCELLED
    assert world.client.completed.stop_reason == lifecycle_pb2.CANCEL_REASON_SHUTDOWN


async def test_an_unreported_stop_is_left_exited_for_the_next_start(world: World) -> None:
    lifecycle = _lifecycle(world, max_concurrency=2, drain_grace_seconds=0.0)
    offer_id = world.admit(["sleep", "30"])
    await lifecycle.tick()
    world.client.completion_refusals = [
        CallFailed("CompleteAttempt", grpc.StatusCode.UNAVAILABLE, None)
    ] * 100
    signals = ShutdownSignals()
    signals.signal()
    await asyncio.wait_for(lifecycle.run(signals), 10)
    record = world.inbox.get(offer_id)
    assert record is not None
    assert (record.state, record.stop_reason, record.exit_signal) == (
        RecordState.EXITED,
        LOCAL_SHUTDOWN,
        signal.SIGTERM,
    )


async def test_an_unreadable_inbox_stops_the_executors_and_fails(world: World) -> None:
    lifecycle = _lifecycle(world, max_concurrency=2)
    offer_id = world.admit(["sleep", "30"])
    signals = ShutdownSignals()
    running = asyncio.create_task(lifecycle.run(signals))
    await _until(lambda: _state(world, offer_id) is RecordState.RUNNING_ACKNOWLEDGED)
    record = world.inbox.get(offer_id)
    assert record is not None
    identity = identity_of(record)
    assert identity is not None
    with world.inbox.path.open("r+b") as stream:
        stream.write(b"garbage" * 1000)
    with pytest.raises(InboxFailed) as failed:
        await asyncio.wait_for(running, 10)
    assert str(world.inbox.path) in str(failed.value)
    assert failed.value.stopped == 1
    # Stopped under the leases-revoked mark: recorded as its lease run out, so the
    # restarted Worker reports the Run lost (its fault), not failed by SIGTERM.
    assert world.processes.poll(identity) == ExitStatus(None, signal.SIGTERM, lease_ran_out=True)
    world.processes.release(identity)
    status_dir = world.processes.status_dir
    assert status_dir is not None
    assert (status_dir / supervisor.LEASES_REVOKED_FILE).exists()


async def test_a_starting_worker_removes_the_leases_revoked_mark(world: World) -> None:
    """An earlier run's mark has done its work (its executors were stopped then); a stop
    of this run must be read as this run's."""
    status_dir = world.processes.status_dir
    assert status_dir is not None
    status_dir.mkdir(parents=True, exist_ok=True)
    (status_dir / supervisor.LEASES_REVOKED_FILE).write_text("inbox lost\n")
    signals = ShutdownSignals()
    signals.signal()
    signals.signal()  # stop at once: the run only starts and ends
    await asyncio.wait_for(_lifecycle(world, max_concurrency=1).run(signals), 10)
    assert not (status_dir / supervisor.LEASES_REVOKED_FILE).exists()


async def test_a_slow_reconcile_does_not_hold_the_tick(world: World) -> None:
    lifecycle = _lifecycle(world, max_concurrency=2, reconcile_wait_seconds=0.2)
    offer_id = world.admit(["sleep", "30"])
    # Running, and no pass of it left in flight: a loaded machine may take longer than the
    # tick's 0.2 s to start the executor, and that pass would then meet the gate below.
    deadline = asyncio.get_running_loop().time() + _LIVENESS_SECONDS
    while _state(
        world, offer_id
    ) is not RecordState.RUNNING_ACKNOWLEDGED or world.reconciler.reconciling(offer_id):
        assert asyncio.get_running_loop().time() < deadline, "never running"
        await lifecycle.tick()
    world.clock_offset_ms[0] = 5_000  # lease control is due
    world.client.control_gate = asyncio.Event()
    first = await lifecycle.tick()
    assert first.supervised == ((offer_id, Outcome.IN_FLIGHT),)
    assert first.pull.startswith("lease lost, terminal, refused, in flight")
    second = await lifecycle.tick()  # joins the reconcile still in flight
    world.client.control_gate.set()
    assert second.supervised == ((offer_id, Outcome.IN_FLIGHT),)
    third = await lifecycle.tick()
    assert world.client.calls.count("ControlLease") == 1
    assert third.supervised in ((), ((offer_id, Outcome.RUNNING),))


async def test_each_tick_beats_the_heartbeat_and_a_stuck_tick_does_not(
    world: World, tmp_path: Path
) -> None:
    """The heartbeat is beaten as each tick begins: while the loop ticks it stays young,
    and a tick that never ends (a pull that never returns) lets it age."""
    beats = Heartbeat(tmp_path / "heartbeat")
    lifecycle = Lifecycle(
        settings=LifecycleSettings(tick_seconds=0.05, max_concurrency=1),
        inbox=world.inbox,
        client=world.client,  # type: ignore[arg-type]
        reconciler=world.reconciler,
        processes=world.processes,
        session=_online(),  # type: ignore[arg-type]
        heartbeat=beats,
    )
    signals = ShutdownSignals()
    running = asyncio.create_task(lifecycle.run(signals))
    try:
        await _until(lambda: (tmp_path / "heartbeat").exists())
        first = float((tmp_path / "heartbeat").read_text().split()[1])
        await _until(lambda: float((tmp_path / "heartbeat").read_text().split()[1]) > first)
        world.client.pull_gate = asyncio.Event()  # the next pull waits for ever
        await _until(lambda: world.client.pull_waiting)
        stuck = (tmp_path / "heartbeat").read_text()
        await asyncio.sleep(0.5)  # ten ticks' time
        assert (tmp_path / "heartbeat").read_text() == stuck
        assert heartbeat_age(tmp_path / "heartbeat") >= 0.5
    finally:
        if world.client.pull_gate is not None:
            world.client.pull_gate.set()
        signals.signal()
        signals.signal()
        await asyncio.wait_for(running, 30)
        beats.close()


def _state(world: World, offer_id: str) -> RecordState | None:
    record = world.inbox.get(offer_id)
    return None if record is None else record.state


# A liveness bound, not a timing claim: passes run executors (new interpreters) and ship
# their output, which on a loaded 2-core machine can take seconds; counting passes
# instead (each quick or slow by the machine's load) made the tests flaky under load.
_LIVENESS_SECONDS = 60.0


async def _until(condition: Callable[[], bool], seconds: float = _LIVENESS_SECONDS) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def _reconciled_until(
    reconciler: Reconciler, offer_id: str, settled: Callable[[Outcome], bool]
) -> list[Outcome]:
    """Reconcile `offer_id` pass after pass until an outcome is `settled`; every
    outcome seen, in order."""
    deadline = asyncio.get_running_loop().time() + _LIVENESS_SECONDS
    outcomes = [await reconciler.reconcile(offer_id)]
    while not settled(outcomes[-1]):
        assert asyncio.get_running_loop().time() < deadline, f"never settled: {outcomes[-5:]}"
        await asyncio.sleep(0.02)
        outcomes.append(await reconciler.reconcile(offer_id))
    return outcomes


async def _until_completed(reconciler: Reconciler, offer_id: str) -> None:
    await _reconciled_until(reconciler, offer_id, Outcome.COMPLETED.__eq__)


# --- output (R-OPS-1) ---------------------------------------------------------------------


def _printing(
    size: int, *, linger: float = 0.0, delay: float = 0.0, until: Path | None = None
) -> list[str]:
    """An executor that prints `size` bytes of numbered lines of 100 bytes (after `delay`
    seconds), then keeps running for `linger` seconds (and until the file `until`
    exists, if given) and exits 0."""
    script = (
        "import os, sys, time\n"
        f"time.sleep({delay})\n"
        f"for n in range({size} // 100): sys.stdout.write(f'{{n:09d}} ' + 'o' * 89 + '\\n')\n"
        "sys.stdout.flush()\n"
        f"time.sleep({linger})\n"
    )
    if until is not None:
        script += f"while not os.path.exists({str(until)!r}): time.sleep(0.02)\n"
    return [sys.executable, "-c", script]


def _printed(size: int) -> bytes:
    return b"".join(f"{n:09d} ".encode() + b"o" * 89 + b"\n" for n in range(size // 100))


async def test_output_is_shipped_whole_before_completion_and_named_by_running(
    world: World,
) -> None:
    size = 3 * bounds.OUTPUT_CHUNK_MAX_BYTES // 2 // 100 * 100  # 1.5 chunks, whole lines
    offer_id = world.admit(_printing(size))
    await _until_completed(world.reconciler, offer_id)
    assert bytes(world.client.output) == _printed(size)
    calls = world.client.calls
    assert calls.index("CompleteAttempt") > max(
        i for i, name in enumerate(calls) if name == "AppendOutput"
    ), "the ending is reported once all output is shipped"
    record = world.inbox.get(offer_id)
    assert record is not None
    assert record.output_offset == size
    # Settled by the completion itself: the closed-record shipping has nothing to visit.
    assert record.output_shipped
    assert world.inbox.closed_with_output(limit=8) == []
    assert all(length <= bounds.OUTPUT_CHUNK_MAX_BYTES for _, length, _ in world.client.appended)
    # `running` named the stream by the Attempt the claim returned (R-ACK-5).
    assert record.attempt_id is not None
    assert world.client.log_artifact_ids == [f"attempts/{record.attempt_id}/output"]


async def test_the_executor_receives_the_parameters_of_the_claim(world: World) -> None:
    """Each parameter as QINGLONG_PARAM_<name>, as the claim gave it (the claim's spec is
    the one the Run runs with), and no other QINGLONG_PARAM_ variable."""
    offer = world.offer(["sh", "-c", "env | grep '^QINGLONG_' | sort"])
    offer.spec.parameters["TARGET"] = "from the offer"
    world.client.parameters[offer.offer_id] = {"TARGET": "eu=west 1", "EMPTY": ""}
    assert world.reconciler.admit(
        offer=offer, worker_id=WORKER, session_id=SESSION, worker_generation=1
    )
    record = world.inbox.get(offer.offer_id)
    assert record is not None
    assert record.parameters == (("TARGET", "from the offer"),)
    await _until_completed(world.reconciler, offer.offer_id)
    printed = bytes(world.client.output).decode().splitlines()
    assert [line for line in printed if line.startswith("QINGLONG_PARAM_")] == [
        "QINGLONG_PARAM_EMPTY=",
        "QINGLONG_PARAM_TARGET=eu=west 1",
    ]


@pytest.mark.parametrize(
    ("name", "value"), [("BAD=NAME", "x"), ("lower", "x"), ("NUL", "a\x00b"), ("LONG", "a" * 1025)]
)
async def test_parameters_that_break_the_contract_refuse_the_start(
    world: World, name: str, value: str
) -> None:
    """A claim whose parameters the contract forbids (a control plane's fault): nothing
    runs, and the start failure is reported, never an exception out of the spawn."""
    offer = world.offer(["sh", "-c", "exit 0"])
    world.client.parameters[offer.offer_id] = {name: value}
    assert world.reconciler.admit(
        offer=offer, worker_id=WORKER, session_id=SESSION, worker_generation=1
    )
    await _reconciled_until(world.reconciler, offer.offer_id, Outcome.START_FAILED.__eq__)
    record = _record_of(world, offer.offer_id)
    assert record.start_failure is not None
    assert "breaks the contract" in record.start_failure
    assert value not in record.start_failure or value == "x"
    assert record.executor_pid is None
    assert "ReportStartFailure" in world.client.calls


async def test_shipping_resumes_from_the_inbox_and_resends_harmlessly(
    world: World, tmp_path: Path
) -> None:
    size = (CHUNKS_PER_PASS + 4) * bounds.OUTPUT_CHUNK_MAX_BYTES // 100 * 100
    world.client.lose_append_answers = {3}  # stored, but the Worker never learns it
    # Runs on until the restart below: on a loaded machine, the first Reconciler's passes
    # could otherwise ship everything and complete before it is replaced.
    go_on = tmp_path / "go-on"
    offer_id = world.admit(_printing(size, until=go_on))
    deadline = asyncio.get_running_loop().time() + _LIVENESS_SECONDS
    while len(world.client.appended) <= 3:  # until the chunk whose answer was lost went again
        assert asyncio.get_running_loop().time() < deadline, "the lost chunk was never re-sent"
        await world.reconciler.reconcile(offer_id)
        await asyncio.sleep(0.02)
    record = world.inbox.get(offer_id)
    assert record is not None
    # The lost answer: chunk 3 was re-sent from the offset the inbox held, as a replay.
    offsets = [offset for offset, _, _ in world.client.appended]
    assert offsets[2] == offsets[3]
    assert world.client.appended[3][2] is True
    # A restarted Worker (a new Reconciler on the same inbox) goes on from the inbox.
    shipped = record.output_offset
    already = len(world.client.appended)
    restarted = Reconciler(
        inbox=world.inbox,
        client=world.client,  # type: ignore[arg-type]
        processes=ProcessController(status_dir=tmp_path / "exits"),
        log_dir=tmp_path,
    )
    go_on.touch()
    await _until_completed(restarted, offer_id)
    assert world.client.appended[already][0] == shipped
    assert bytes(world.client.output) == _printed(size)
    assert any(call == "AcknowledgeRunning" for call in world.client.calls), (
        "running was acknowledged"
    )
    record = world.inbox.get(offer_id)
    assert record is not None
    assert record.output_offset == size
    # Every chunk went once, in order, but the one whose answer was lost: no gap, no
    # other re-send, across the restart too.
    assert [replayed for _, _, replayed in world.client.appended].count(True) == 1
    fresh = [(offset, length) for offset, length, replayed in world.client.appended if not replayed]
    starts = itertools.accumulate((length for _, length in fresh[:-1]), initial=0)
    assert [offset for offset, _ in fresh] == list(starts)


CHUNK = bounds.OUTPUT_CHUNK_MAX_BYTES


def _chunks(count: int) -> int:
    """`count` chunks' worth of output, in whole lines."""
    return count * CHUNK // 100 * 100


async def _written(world: World, offer_id: str, size: int) -> None:
    """Until the executor's file holds `size` bytes (the inbox's directory is `log_dir`)."""
    path = world.inbox.path.parent / f"{offer_id}.log"
    await _until(lambda: path.exists() and path.stat().st_size >= size)


def _record_of(world: World, offer_id: str) -> Any:
    record = world.inbox.get(offer_id)
    assert record is not None
    return record


def _restarted(world: World, tmp_path: Path) -> World:
    """The same inbox, files and control plane under a new Worker process."""
    reconciler = Reconciler(
        inbox=world.inbox,
        client=world.client,  # type: ignore[arg-type]
        processes=ProcessController(status_dir=tmp_path / "exits"),
        lease_clock=_lease_clock(world.clock_offset_ms),
        log_dir=tmp_path,
    )
    return dataclasses.replace(world, reconciler=reconciler)


async def test_an_offset_gap_resumes_from_the_expected_offset(world: World, tmp_path: Path) -> None:
    size = _chunks(CHUNKS_PER_PASS + 4)
    # Running until the gap is made: an executor that had ended would have its whole
    # output shipped by the next pass, before its ending is reported.
    go_on = tmp_path / "go-on"
    offer_id = world.admit(_printing(size, until=go_on))
    assert await world.reconciler.reconcile(offer_id) is Outcome.RUNNING
    await _written(world, offer_id, size)
    await world.reconciler.reconcile(offer_id)  # one pass: CHUNKS_PER_PASS chunks
    assert _record_of(world, offer_id).output_offset == CHUNKS_PER_PASS * CHUNK
    # The control plane holds less than the inbox says: the next chunk is a gap.
    del world.client.output[1000:]
    world.client.answer_gaps = True
    sent = len(world.client.appended)
    go_on.touch()
    await _until_completed(world.reconciler, offer_id)
    assert world.client.calls.count("AppendOutput") == len(world.client.appended) + 1
    assert world.client.appended[sent][0] == 1000, "resumed at the expected offset"
    assert bytes(world.client.output) == _printed(size)
    assert _record_of(world, offer_id).output_offset == size


async def test_output_left_when_the_lease_ran_out_is_shipped_after_the_record_closed(
    world: World,
) -> None:
    size = _chunks(3)
    offer_id = world.admit(_printing(size, linger=30))
    assert await world.reconciler.reconcile(offer_id) is Outcome.RUNNING
    await _written(world, offer_id, size)
    world.clock_offset_ms[0] = 31_000  # the Worker was away longer than the lease
    assert await world.reconciler.reconcile(offer_id) is Outcome.LEASE_LOST
    assert "AppendOutput" not in world.client.calls, "nothing is shipped under a lost lease"
    calls = len(world.client.calls)
    lifecycle = _lifecycle(world, max_concurrency=1)
    await lifecycle.tick()
    shipped = world.client.calls[calls:]
    assert shipped[: shipped.index("PullOffers")] == ["AppendOutput"] * 3
    assert bytes(world.client.output) == _printed(size)
    record = _record_of(world, offer_id)
    assert record.state is RecordState.QUARANTINED
    assert (record.output_offset, record.output_shipped) == (size, True)
    await lifecycle.tick()
    assert world.client.calls.count("AppendOutput") == 3, "a shipped record is left alone"


async def test_output_left_at_a_terminal_answer_is_shipped_by_a_restarted_worker(
    world: World, tmp_path: Path
) -> None:
    size = _chunks(2) + 300
    offer_id = world.admit(_printing(size, linger=30))
    assert await world.reconciler.reconcile(offer_id) is Outcome.RUNNING
    await _written(world, offer_id, size)
    world.client.control_answer = lambda _: ws.ControlLeaseResponse(
        terminal=worker_pb2.LeaseTerminal(
            run_state=lifecycle_pb2.RUN_STATE_CANCELLED,
            attempt_state=lifecycle_pb2.ATTEMPT_STATE_CANCELLED,
        )
    )
    world.clock_offset_ms[0] = 3_000  # lease control is due before any shipping
    assert await world.reconciler.reconcile(offer_id) is Outcome.TERMINAL
    assert "AppendOutput" not in world.client.calls
    restarted = _restarted(world, tmp_path)
    outcomes = [await restarted.reconciler.reconcile(offer_id) for _ in range(2)]
    assert outcomes == [Outcome.DONE, Outcome.DONE]
    assert bytes(world.client.output) == _printed(size)
    assert world.client.calls.count("AppendOutput") == 3
    assert "CompleteAttempt" not in world.client.calls
    assert _record_of(world, offer_id).output_shipped


async def test_a_shutdown_reports_after_one_pass_and_the_rest_is_shipped_later(
    world: World, tmp_path: Path
) -> None:
    size = _chunks(CHUNKS_PER_PASS + 4)  # more than one pass
    # Ends only when told: one that ended before the first pass was over would be
    # shipped and reported by it, however loaded the machine.
    go_on = tmp_path / "go-on"
    offer_id = world.admit(_printing(size, until=go_on))
    assert await world.reconciler.reconcile(offer_id) is Outcome.RUNNING
    await _written(world, offer_id, size)
    identity = identity_of(_record_of(world, offer_id))
    assert identity is not None
    go_on.touch()
    await _until(lambda: world.processes.poll(identity) is not None)
    world.reconciler.set_mode(Mode.STOPPING)
    assert await world.reconciler.reconcile(offer_id) is Outcome.COMPLETED
    calls = world.client.calls
    assert calls[calls.index("AppendOutput") :] == ["AppendOutput"] * CHUNKS_PER_PASS + [
        "CompleteAttempt"
    ]
    record = _record_of(world, offer_id)
    assert record.state is RecordState.COMPLETION_ACKNOWLEDGED
    assert (record.output_offset, record.output_shipped) == (CHUNKS_PER_PASS * CHUNK, False)
    # The next start ships the rest from the inbox, the record staying closed.
    restarted = _restarted(world, tmp_path)
    await _lifecycle(restarted, max_concurrency=1).tick()
    assert bytes(world.client.output) == _printed(size)
    record = _record_of(world, offer_id)
    assert (record.state, record.output_offset, record.output_shipped) == (
        RecordState.COMPLETION_ACKNOWLEDGED,
        size,
        True,
    )
    assert world.client.calls.count("CompleteAttempt") == 1


async def test_a_shipping_pass_stops_when_lease_control_falls_due(world: World) -> None:
    size = _chunks(10)
    offer_id = world.admit(_printing(size, linger=30))
    assert await world.reconciler.reconcile(offer_id) is Outcome.RUNNING
    await _written(world, offer_id, size)
    world.clock_offset_ms[0] = 2_500
    assert await world.reconciler.reconcile(offer_id) is Outcome.RUNNING  # lease control
    assert world.client.calls[-1] == "ControlLease"
    before = len(world.client.calls)

    def slow_append() -> None:  # each chunk takes 0.7 s: the third passes the 2 s mark
        world.clock_offset_ms[0] += 700

    world.client.on_append = slow_append
    assert await world.reconciler.reconcile(offer_id) is Outcome.RUNNING
    assert world.client.calls[before:] == ["AppendOutput"] * 3 + ["ControlLease"]
    budgets = [budget for name, budget in world.client.budgets if name == "AppendOutput"]
    assert all(budget is not None and budget <= CALL_BUDGET_SECONDS for budget in budgets)
    # A lease with less than a chunk's budget left caps each chunk's retries.
    world.client.on_append = lambda: None
    world.client.control_answer = lambda request: ws.ControlLeaseResponse(
        renewed=worker_pb2.LeaseRenewed(
            lease_version=request.fence.expected_lease_version + 1,
            lease_remaining=_duration(1_500),
        )
    )
    world.clock_offset_ms[0] += 10_000
    assert await world.reconciler.reconcile(offer_id) is Outcome.RUNNING
    assert world.client.calls[-1] == "ControlLease"
    sent = len(world.client.budgets)
    assert await world.reconciler.reconcile(offer_id) is Outcome.RUNNING
    capped = [budget for name, budget in world.client.budgets[sent:] if name == "AppendOutput"]
    assert capped, "shipping went on under the short lease"
    assert all(budget is not None and budget <= 1.5 for budget in capped)


async def test_a_refusal_for_good_is_persisted_and_not_sent_again(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    size = _chunks(2)
    offer_id = world.admit(_printing(size, linger=30))
    lifecycle = _lifecycle(world, max_concurrency=1)
    await lifecycle.tick()
    await _written(world, offer_id, size)
    world.client.append_refusal = CallFailed(
        "AppendOutput", grpc.StatusCode.ABORTED, ErrorReason.ERROR_REASON_REPLAY_MISMATCH
    )
    with caplog.at_level("WARNING", logger="qinglong_worker.output"):
        for _ in range(4):
            await lifecycle.tick()
    assert world.client.calls.count("AppendOutput") == 1
    record = _record_of(world, offer_id)
    assert record.output_given_up == "REPLAY_MISMATCH"
    assert not world.reconciler.output_pending(record)
    assert sum("given up" in message for message in caplog.messages) == 1
    # Closed, it is not shipped either; the record is not listed for shipping at all.
    world.clock_offset_ms[0] = 31_000
    assert await world.reconciler.reconcile(offer_id) is Outcome.LEASE_LOST
    await lifecycle.tick()
    assert world.client.calls.count("AppendOutput") == 1
    assert world.inbox.closed_with_output(limit=10) == []


async def test_an_ending_does_not_wait_for_output_the_control_plane_cannot_take(
    world: World,
) -> None:
    """AppendOutput fails transiently for as long as it lasts (here an INTERNAL answer):
    the ending is reported anyway, with the output's size, and the output follows once
    it is taken. Waiting for it kept the Run `running` for ever, the lease renewed."""
    size = _chunks(2)
    world.client.append_refusal = CallFailed("AppendOutput", grpc.StatusCode.INTERNAL, None)
    assert world.client.append_refusal.transient
    offer_id = world.admit(_printing(size))
    await _until_completed(world.reconciler, offer_id)
    assert world.client.completed.output_bytes == size
    assert world.client.appended == [], "no output was taken before the ending"
    record = _record_of(world, offer_id)
    assert record.state is RecordState.COMPLETION_ACKNOWLEDGED
    assert (record.output_offset, record.output_shipped) == (0, False)
    world.client.append_refusal = None
    lifecycle = _lifecycle(world, max_concurrency=1)
    for _ in range(2):
        await lifecycle.tick()
    assert bytes(world.client.output) == _printed(size)
    assert (
        _record_of(world, offer_id).output_offset,
        _record_of(world, offer_id).output_shipped,
    ) == (
        size,
        True,
    )


async def test_closed_records_are_shipped_in_turn_so_a_failing_one_holds_none_up(
    world: World,
) -> None:
    size = _chunks(1)
    offer_ids = [world.admit(_printing(size, linger=30)) for _ in range(3)]
    lifecycle = _lifecycle(world, max_concurrency=3)
    await lifecycle.tick()
    for offer_id in offer_ids:
        await _written(world, offer_id, size)
    first, second = (_record_of(world, offer_id) for offer_id in offer_ids[:2])
    world.client.unreachable_attempts = {first.attempt_id, second.attempt_id}
    world.clock_offset_ms[0] = 31_000  # every lease ran out: all three close
    for _ in range(2):
        await lifecycle.tick()
    assert [_record_of(world, offer_id).output_shipped for offer_id in offer_ids] == [
        False,
        False,
        True,
    ]
    world.client.unreachable_attempts = set()
    for _ in range(2):
        await lifecycle.tick()
    assert [(r.output_offset, r.output_shipped) for r in map(world.inbox.get, offer_ids)] == [
        (size, True)
    ] * 3
    # Each Attempt's stream holds its own file, whole.
    attempts = [_record_of(world, offer_id).attempt_id for offer_id in offer_ids]
    assert {a: bytes(world.client.outputs[a]) for a in attempts} == {
        a: _printed(size) for a in attempts
    }


async def test_a_start_answered_after_the_local_lease_ran_out_starts_nothing(
    world: World, tmp_path: Path
) -> None:
    """AcknowledgeStarting's answer arrives after the local lease ran out (a slow
    network): nothing may start without a lease, whatever the answer says."""
    marker = tmp_path / "ran"
    offer_id = world.admit(["touch", str(marker)])
    answer_starting = world.client.acknowledge_starting

    async def late(
        request: ws.AcknowledgeStartingRequest, *, budget_seconds: float | None = None
    ) -> ws.AcknowledgeStartingResponse:
        answered = await answer_starting(request, budget_seconds=budget_seconds)
        world.clock_offset_ms[0] += 31_000  # the 30 s lease of the claim is gone meanwhile
        return answered

    world.client.acknowledge_starting = late  # type: ignore[method-assign]
    await world.reconciler.reconcile(offer_id)
    record = world.inbox.get(offer_id)
    assert record is not None
    assert record.executor_pid is None
    assert record.start_failure == "the local lease ran out before the executor started"
    # Closed as any lease that ran out locally is, without another call.
    assert record.quarantine_reason is QuarantineReason.LEASE_LOST_LOCAL_EXECUTION_STOPPED
    assert world.client.calls == ["ClaimOffer", "AcknowledgeStarting"]
    await asyncio.sleep(0.1)
    assert not marker.exists()


class HangingSession(StubSession):
    """Renewing the session hangs (ingress unreachable, the renewal retrying)."""

    def __init__(self) -> None:
        super().__init__(None)
        self.calls = 0
        self.cancelled = asyncio.Event()

    async def ensure(self) -> ActiveSession | None:
        self.calls += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return None


async def test_a_hanging_session_renewal_does_not_hold_supervision(world: World) -> None:
    """The local lease runs out while the session's renewal hangs: each tick still
    supervises (and stops the executor on the Worker's own clock) after at most the
    reconcile wait, and the one renewal goes on across ticks instead of starting again."""
    session = HangingSession()
    lifecycle = _lifecycle(world, max_concurrency=4, session=session, reconcile_wait_seconds=0.2)
    offer_id = world.admit(["sleep", "30"])
    await world.reconciler.reconcile(offer_id)
    world.clock_offset_ms[0] = 31_000
    report = await asyncio.wait_for(lifecycle.tick(), 5)
    assert report.supervised == ((offer_id, Outcome.LEASE_LOST),)
    quiet = await asyncio.wait_for(lifecycle.tick(), 5)
    assert quiet.pull == "no session"
    assert session.calls == 1, "the renewal in flight is waited for, not begun again"
    tick = asyncio.create_task(lifecycle.tick())
    await asyncio.sleep(0.05)
    tick.cancel()  # a shutdown cancels the tick, and the renewal with it
    with pytest.raises(asyncio.CancelledError):
        await tick
    await asyncio.wait_for(session.cancelled.wait(), 5)


class FailingSession(StubSession):
    """The renewal fails after a tick stopped waiting for it (an inbox that can no longer
    be written): the next tick must not lose that."""

    def __init__(self) -> None:
        super().__init__(None)
        self.calls = 0

    async def ensure(self) -> ActiveSession | None:
        self.calls += 1
        await asyncio.sleep(0.3)
        raise RuntimeError("the inbox cannot be written")


async def test_a_renewal_that_failed_between_ticks_fails_the_next_tick(world: World) -> None:
    session = FailingSession()
    lifecycle = _lifecycle(world, max_concurrency=1, session=session, reconcile_wait_seconds=0.05)
    await lifecycle.tick()
    await asyncio.sleep(0.5)
    with pytest.raises(RuntimeError, match="cannot be written"):
        await lifecycle.tick()
    # Raised once: the tick after it renews again (and supervises) instead of raising the
    # same failure for ever.
    report = await lifecycle.tick()
    assert report.pull == "no session"
    assert session.calls == 2


async def test_a_pull_waits_no_longer_than_a_tick_does(world: World) -> None:
    lifecycle = _lifecycle(world, max_concurrency=1, reconcile_wait_seconds=1.5)
    await lifecycle.tick()
    assert dict(world.client.budgets)["PullOffers"] == 1.5


# --- the supervisor's lease watch (the Worker's side) ---------------------------------------


def _lease_file(world: World, record: Any) -> Path:
    directory = world.processes.status_dir
    assert directory is not None
    return directory / supervisor.lease_file_name(launch_key(record.offer_id, record.attempt_id))


def _written_deadline(world: World, record: Any) -> int | None:
    return supervisor.read_lease_deadline(
        str(_lease_file(world, record).parent),
        launch_key(record.offer_id, record.attempt_id),
        record.lease_observed_boot_id,
    )


def _estimate(record: Any) -> int:
    return int(record.lease_observed_boot_ms + record.lease_remaining_ms)


async def test_the_supervisor_is_handed_each_lease_the_worker_persists(world: World) -> None:
    offer_id = world.admit(["sleep", "30"])
    assert await world.reconciler.reconcile(offer_id) is Outcome.RUNNING
    started = _record_of(world, offer_id)
    assert _written_deadline(world, started) == _estimate(started), "the claim's lease"
    world.clock_offset_ms[0] += 20_000  # lease control falls due
    assert await world.reconciler.reconcile(offer_id) is Outcome.RUNNING
    renewed = _record_of(world, offer_id)
    assert renewed.lease_version > started.lease_version
    assert _written_deadline(world, renewed) == _estimate(renewed) > _estimate(started)


async def test_a_record_that_never_started_its_executor_leaves_no_lease_file(
    world: World,
) -> None:
    world.client.starting_outcome = worker_pb2.STARTING_OUTCOME_ALREADY_RUNNING
    offer_id = world.admit(["sleep", "30"])
    written_at_starting: list[bool] = []
    acknowledge_starting = world.client.acknowledge_starting

    async def starting(request: Any, **options: Any) -> Any:
        written_at_starting.append(_lease_file(world, _record_of(world, offer_id)).exists())
        return await acknowledge_starting(request, **options)

    world.client.acknowledge_starting = starting  # type: ignore[method-assign]
    assert await world.reconciler.reconcile(offer_id) is Outcome.TERMINAL
    record = _record_of(world, offer_id)
    assert record.quarantine_reason is QuarantineReason.RUNNING_ELSEWHERE
    assert written_at_starting == [True], "written at the claim, before any supervisor"
    assert not _lease_file(world, record).exists(), "removed when the record closed"


async def test_an_executor_not_confirmed_stopped_keeps_its_lease_file_for_its_supervisor(
    world: World,
) -> None:
    offer_id = world.admit(["sleep", "30"])
    assert await world.reconciler.reconcile(offer_id) is Outcome.RUNNING
    world.processes.refuse_signals = True
    world.clock_offset_ms[0] += 60_000  # the local lease ran out
    assert await world.reconciler.reconcile(offer_id) is Outcome.LEASE_LOST
    record = _record_of(world, offer_id)
    assert record.quarantine_reason is QuarantineReason.LEASE_LOST_LOCAL_EXECUTION_UNVERIFIED
    assert _lease_file(world, record).exists(), "its supervisor stops what the Worker could not"
    world.processes.refuse_signals = False


async def test_an_executor_its_supervisor_stopped_at_the_lease_is_lost_not_ended(
    world: World,
) -> None:
    """The Worker was away while the lease ran out: the supervisor stopped the executor
    (SIGTERM). That is no ending of the executor's own, and nobody asked for it: the
    record closes as lease lost, and no CompleteAttempt reports a signal as `failed`."""
    world.client.lease_ms = 1_500
    offer_id = world.admit(["sleep", "30"])
    status_file = await _running_with_status_file(world, offer_id)
    await _until(status_file.exists)  # no reconcile meanwhile: the Worker is away
    await world.reconciler.reconcile(offer_id)
    record = _record_of(world, offer_id)
    assert (record.state, record.quarantine_reason) == (
        RecordState.QUARANTINED,
        QuarantineReason.LEASE_LOST_LOCAL_EXECUTION_STOPPED,
    )
    assert record.exit_signal == signal.SIGTERM
    assert "CompleteAttempt" not in world.client.calls


@pytest.mark.parametrize("restarted", [False, True], ids=["same-worker", "restarted-worker"])
async def test_an_executor_lost_with_its_supervisor_is_lost_not_failed(
    world: World, tmp_path: Path, restarted: bool
) -> None:
    """The supervisor is killed from outside — with the Worker's container, say, where a
    restart kills every process — and the executor with it: how the executor would have
    ended is unknown. Reported `failed`, the task would be blamed and a policy retrying
    only `lost` would not retry it: nothing is reported, and the record closes as lost."""
    offer_id = world.admit(["sleep", "30"])
    assert await world.reconciler.reconcile(offer_id) is Outcome.RUNNING
    identity = identity_of(_record_of(world, offer_id))
    assert identity is not None
    os.kill(identity.pid, signal.SIGKILL)  # the supervisor alone
    if restarted:
        await _until(lambda: not os.path.exists(f"/proc/{identity.pid}/stat") or _zombie(identity))
        world = _restarted(world, tmp_path)
    await _reconciled_until(
        world.reconciler,
        offer_id,
        lambda _: _record_of(world, offer_id).state is RecordState.QUARANTINED,
    )
    record = _record_of(world, offer_id)
    assert record.quarantine_reason is QuarantineReason.LEASE_LOST_LOCAL_EXECUTION_STOPPED
    assert "without an exit status" in (record.detail or "")
    assert "CompleteAttempt" not in world.client.calls


async def _running_with_status_file(world: World, offer_id: str) -> Path:
    """Start ``offer_id``'s executor; where its supervisor writes its status."""
    assert await world.reconciler.reconcile(offer_id) is Outcome.RUNNING
    identity = identity_of(_record_of(world, offer_id))
    assert identity is not None
    status_dir = world.processes.status_dir
    assert status_dir is not None
    return status_dir / supervisor.status_file_name(identity.pid, identity.start_ticks)


def _zombie(identity: Any) -> bool:
    state = Path(f"/proc/{identity.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state == "Z"


async def test_a_pull_refused_as_fenced_lets_the_session_be_replaced_at_once(
    world: World,
) -> None:
    session = _online()
    lifecycle = _lifecycle(world, max_concurrency=1, session=session)

    async def fenced(request: Any, **options: Any) -> Any:
        raise CallFailed(
            "PullOffers", grpc.StatusCode.ABORTED, ErrorReason.ERROR_REASON_SESSION_FENCED
        )

    world.client.pull_offers = fenced  # type: ignore[method-assign]
    report = await lifecycle.tick()
    assert report.pull == "pull failed: SESSION_FENCED"
    assert session.forgotten == [SESSION]


async def test_a_finished_attempts_record_and_files_go_after_their_retention(
    world: World,
) -> None:
    offer_id = world.admit(["sh", "-c", "echo done"])
    await _until_completed(world.reconciler, offer_id)
    await _reconciled_until(
        world.reconciler, offer_id, lambda _: _record_of(world, offer_id).output_shipped
    )
    record = _record_of(world, offer_id)
    assert world.reconciler.log_dir is not None
    log_path = log_file(world.reconciler.log_dir, offer_id)
    status_dir = world.processes.status_dir
    assert status_dir is not None
    leftover = status_dir / supervisor.launch_file_name(launch_key(offer_id, record.attempt_id))
    leftover.write_text("{}")  # a launch claim the Worker wrote, kept with the record
    assert log_path.read_bytes() == b"done\n"
    kept = _lifecycle(world, max_concurrency=1)  # the default retention: 7 days
    await kept.tick()
    assert world.inbox.get(offer_id) is not None
    await asyncio.sleep(0.05)
    pruning = _lifecycle(world, max_concurrency=1, retention_seconds=0.01)
    await pruning.tick()
    assert world.inbox.get(offer_id) is None
    assert not log_path.exists()
    assert not leftover.exists()


@pytest.mark.parametrize("fault", ["status-unreadable", "status-unwritable"])
async def test_an_executor_that_ended_by_itself_is_reported_even_without_its_status(
    world: World, fault: str
) -> None:
    """Its supervisor wrote a status that cannot be read, or could not write one (and
    exited 4): either way the executor ended by itself. That is reported — `failed`,
    its status not observable — never taken for an execution lost with its supervisor
    (which the policy would run again although it may have done its work)."""
    offer_id = world.admit(["sh", "-c", "sleep 0.5"])
    status_file = await _running_with_status_file(world, offer_id)
    if fault == "status-unwritable":
        status_file.mkdir()  # a directory where the status goes: its rename fails
    else:
        await _until(status_file.exists)
        status_file.write_text("not a status")
    await _until_completed(world.reconciler, offer_id)
    assert world.client.completed.outcome == worker_pb2.ATTEMPT_OUTCOME_FAILED
    assert not world.client.completed.HasField("exit_code")


def _write_until_full(descriptor: int) -> None:
    while os.write(descriptor, b"\0" * 4096):
        pass


@contextlib.contextmanager
def _full_filesystem_at(directory: Path) -> Iterator[None]:
    """A 64 KiB tmpfs mounted at ``directory`` and filled: every new file there fails
    ENOSPC, as on a Worker whose disk is full (a real mount; the tests run as root)."""
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(directory)], check=True)
    try:
        fill = os.open(directory / "fill", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            with pytest.raises(OSError, match="No space left") as full:
                _write_until_full(fill)
        finally:
            os.close(fill)
        assert full.value.errno == errno.ENOSPC
        yield
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=True)


async def test_a_start_the_machine_cannot_make_is_given_back_not_failed(world: World) -> None:
    """A full disk under exits/ (where the supervisor claims each launch): the start is
    not reported as the task's failure (a Run failed, and every Run pulled after it the
    same way), the record is given back unreported — its lease runs out and the Attempt
    ends lost, to be retried — and the Worker pulls nothing for a while."""
    status_dir = world.processes.status_dir
    assert status_dir is not None
    lifecycle = _lifecycle(world, max_concurrency=2)
    world.client.offers = [world.offer(["sleep", "30"]) for _ in range(3)]
    with _full_filesystem_at(status_dir):
        first = await lifecycle.tick()  # pulls, and starts what it pulled
        second = await lifecycle.tick()
        third = await lifecycle.tick()
    assert first.pull.startswith("pulled")
    assert {outcome for _, outcome in first.admitted} == {Outcome.WORKER_FAULT}
    given_back = [r for r in world.inbox.records() if r.state is RecordState.QUARANTINED]
    assert given_back
    assert {r.quarantine_reason for r in given_back} == {QuarantineReason.NOT_STARTED_WORKER_FAULT}
    assert all("space" in (r.detail or "") for r in given_back), [r.detail for r in given_back]
    assert "ReportStartFailure" not in world.client.calls
    assert second.pull.startswith("paused")
    assert third.pull.startswith("paused")
    assert world.client.calls.count("PullOffers") == 1


async def test_a_pass_persists_its_output_offset_once_not_once_a_chunk(world: World) -> None:
    """Each persist is an fsync on the event loop's thread: sixteen a pass held up every
    other record's lease control on a slow disk. A pass of sixteen chunks writes the
    record once; the chunks are answered as replays should a Worker stop mid-pass."""
    size = _chunks(CHUNKS_PER_PASS + 4)
    offer_id = world.admit(_printing(size, linger=30))  # still running: no other change
    assert await world.reconciler.reconcile(offer_id) is Outcome.RUNNING
    await _written(world, offer_id, size)
    before = _record_of(world, offer_id)
    await world.reconciler.reconcile(offer_id)  # one pass: CHUNKS_PER_PASS chunks
    after = _record_of(world, offer_id)
    assert after.output_offset == CHUNKS_PER_PASS * CHUNK
    assert after.revision == before.revision + 1


async def test_a_launch_claim_that_records_a_machine_fault_is_given_back_too(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The supervisor's answer read from its launch claim (a Worker restarted after the
    answer was written, or a supervisor slower than the spawn's bound) is classified as
    the answer read at once: an errno of the machine (here EAGAIN, a fork that failed)
    gives the record back unreported; the task's own (ENOENT) is its start failure."""
    monkeypatch.setattr(process, "_READY_TIMEOUT_SECONDS", 0.001)
    offers = {name: world.admit([f"/nonexistent/{name}"]) for name in ("machine", "task")}
    for offer_id in offers.values():
        assert await world.reconciler.reconcile(offer_id) is Outcome.WAITING
    status_dir = world.processes.status_dir
    assert status_dir is not None
    claims = {
        name: status_dir
        / supervisor.launch_file_name(launch_key(offer_id, _attempt(world, offer_id)))
        for name, offer_id in offers.items()
    }
    for claim in claims.values():
        await _until(lambda claim=claim: claim.exists() and b'"error 2 ' in claim.read_bytes())
    # What a supervisor whose fork failed records (EAGAIN), in place of ENOENT.
    text = claims["machine"].read_text()
    claims["machine"].write_text(text.replace('"error 2 FileNotFoundError"', '"error 11 OSError"'))
    restarted = _restarted(world, tmp_path)
    for offer_id in offers.values():
        await restarted.reconciler.reconcile(offer_id)
    machine, task = (_record_of(world, offers[name]) for name in ("machine", "task"))
    assert machine.state is RecordState.QUARANTINED
    assert machine.quarantine_reason is QuarantineReason.NOT_STARTED_WORKER_FAULT
    assert task.start_failure == "executable not found"
    assert task.quarantine_reason in (None, QuarantineReason.START_FAILED)
    assert world.client.calls.count("ReportStartFailure") <= 1  # the task's alone
    for child in world.processes._children.values():  # the first Worker's, never answered
        child.wait(10)


def _attempt(world: World, offer_id: str) -> str:
    record = _record_of(world, offer_id)
    return record.attempt_id or ""


#: What a lease answer changes in a record.
_LEASE_FIELDS: Final = frozenset(
    {
        "lease_version",
        "lease_observed_unix_ms",
        "lease_observed_boot_ms",
        "lease_observed_boot_id",
        "lease_remaining_ms",
    }
)


async def test_only_renewals_and_output_offsets_are_written_without_waiting_for_the_disk(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The inbox's ``durable=False`` is for what a reboot makes moot: a running
    executor's renewal and the output offset. Every other change -- each step of the
    start, the exit, the ending -- waits for the disk, as before."""
    writes: list[tuple[frozenset[str], bool]] = []
    compare_and_set = world.inbox.compare_and_set

    def recording(current: Any, updated: Any, *, durable: bool = True) -> Any:
        changed = frozenset(
            field.name
            for field in dataclasses.fields(current)
            if field.name not in ("revision", "updated_unix_ms")
            and getattr(current, field.name) != getattr(updated, field.name)
        )
        writes.append((changed, durable))
        return compare_and_set(current, updated, durable=durable)

    monkeypatch.setattr(world.inbox, "compare_and_set", recording)
    gate = tmp_path / "go"
    offer_id = world.admit(_printing(1_000, until=gate))
    await _reconciled_until(world.reconciler, offer_id, Outcome.RUNNING.__eq__)
    for _ in range(3):
        world.clock_offset_ms[0] += 3_000  # lease control falls due
        assert await world.reconciler.reconcile(offer_id) is Outcome.RUNNING
    gate.touch()
    await _until_completed(world.reconciler, offer_id)
    relaxed = [changed for changed, durable in writes if not durable]
    print(f"{len(writes)} writes, {len(relaxed)} without waiting for the disk: {relaxed}")
    assert sum(1 for changed in relaxed if changed <= _LEASE_FIELDS) >= 3, "the renewals"
    assert frozenset({"output_offset"}) in relaxed
    for changed in relaxed:
        assert changed <= _LEASE_FIELDS or changed == {"output_offset"}, changed
    assert all(durable for changed, durable in writes if "state" in changed)


class VersionedControl(ScriptedClient):
    """Lease versions as control keeps them (domain/lease_control.py, fence.py): a
    renewal at the present version advances it, one a version behind is answered as
    the replay of a renewal whose answer was lost (R-LC-8), anything else is fenced; an
    ending is taken only at the present version, and sent again after it was taken it
    is answered as the same completion (completion.py's replay), while lease control
    answers terminal. And the real client's budget rule: a call that holds a lease is
    not sent with less budget than one try, unless it is a last word (client.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.version = 1
        self.unanswered = 0  # the next this many lease-holding calls get no answer
        self.endings_unanswered = 0  # the next this many endings commit; the answer is lost
        self.completions = 0  # endings committed

    def _fenced(self, method: str) -> CallFailed:
        return CallFailed(
            method, grpc.StatusCode.ABORTED, ErrorReason.ERROR_REASON_LEASE_VERSION_FENCED
        )

    def _sent(
        self, method: str, request: Any, budget_seconds: float | None, last_word: bool
    ) -> None:
        """The client's budget rule, then the network: the call is recorded as sent, and
        fails UNAVAILABLE while calls go unanswered."""
        too_late = budget_seconds is not None and budget_seconds < RetryPolicy().min_try_seconds
        if too_late and not last_word:
            raise CallFailed(method, grpc.StatusCode.DEADLINE_EXCEEDED, None, tries=0)
        self._record(method, request, budget_seconds)
        if self.unanswered > 0:
            self.unanswered -= 1
            raise CallFailed(method, grpc.StatusCode.UNAVAILABLE, None)

    async def acknowledge_running(
        self,
        request: ws.AcknowledgeRunningRequest,
        *,
        budget_seconds: float | None = None,
        last_word: bool = False,
    ) -> ws.AcknowledgeRunningResponse:
        self._sent("AcknowledgeRunning", request, budget_seconds, last_word)
        if request.fence.expected_lease_version != self.version:
            raise self._fenced("AcknowledgeRunning")
        return ws.AcknowledgeRunningResponse(
            outcome=worker_pb2.RUNNING_OUTCOME_RUNNING, lease_version=self.version
        )

    async def control_lease(
        self,
        request: ws.ControlLeaseRequest,
        *,
        budget_seconds: float | None = None,
        last_word: bool = False,
    ) -> ws.ControlLeaseResponse:
        self._sent("ControlLease", request, budget_seconds, last_word)
        if self.completions:
            return ws.ControlLeaseResponse(
                terminal=worker_pb2.LeaseTerminal(run_state=lifecycle_pb2.RUN_STATE_SUCCEEDED)
            )
        expected = request.fence.expected_lease_version
        if expected == self.version:
            self.version += 1
        elif expected != self.version - 1:
            raise self._fenced("ControlLease")
        return self._renewed(self.version)

    async def complete_attempt(
        self, request: ws.CompleteAttemptRequest, *, budget_seconds: float | None = None
    ) -> ws.CompleteAttemptResponse:
        self._sent("CompleteAttempt", request, budget_seconds, last_word=True)
        answer = ws.CompleteAttemptResponse(
            outcome=worker_pb2.COMPLETION_OUTCOME_COMPLETED,
            completed_lease_version=self.version + (0 if self.completions else 1),
        )
        replay = self.completions and request.fence.expected_lease_version == self.version - 1
        if replay and request.outcome == self.completed.outcome:
            return answer
        if request.fence.expected_lease_version != self.version:
            raise self._fenced("CompleteAttempt")
        self.completed = request
        self.completions += 1
        self.version += 1
        if self.endings_unanswered > 0:
            self.endings_unanswered -= 1
            raise CallFailed("CompleteAttempt", grpc.StatusCode.UNAVAILABLE, None)
        return answer


def _versioned_worker(world: World, tmp_path: Path) -> tuple[Reconciler, VersionedControl]:
    """A Reconciler of this boot against a control plane that keeps lease versions."""
    control = VersionedControl()
    control.plans = world.client.plans
    worker = Reconciler(
        inbox=world.inbox,
        client=control,  # type: ignore[arg-type]
        processes=world.processes,
        lease_clock=_lease_clock(world.clock_offset_ms),
        stop_grace_seconds=2.0,
        log_dir=tmp_path,
    )
    return worker, control


def _after_a_reboot(
    world: World, control: VersionedControl, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Reconciler:
    """The Worker back on the same inbox in the next boot (another boot id: every
    executor identity and lease observation of the last one is of another boot)."""
    next_boot = str(uuid.uuid4())
    monkeypatch.setattr(process, "_this_boot", lambda: next_boot)
    return Reconciler(
        inbox=world.inbox,
        client=control,  # type: ignore[arg-type]
        processes=RecordingProcesses(world.inbox),
        lease_clock=lambda: BootInstant(next_boot, 5_000),
        stop_grace_seconds=2.0,
        log_dir=tmp_path,
    )


async def _started_unacknowledged(
    world: World, worker: Reconciler, control: VersionedControl, argv: list[str]
) -> InboxRecord:
    """A record `started` whose AcknowledgeRunning went unanswered (the network gone once
    the executor started)."""
    offer = world.offer(argv)
    assert worker.admit(offer=offer, worker_id=WORKER, session_id=SESSION, worker_generation=1)
    control.unanswered = 1_000_000
    await _reconciled_until(worker, offer.offer_id, Outcome.WAITING.__eq__)
    started = _record_of(world, offer.offer_id)
    assert started.state is RecordState.STARTED
    return started


@pytest.mark.parametrize(("unanswered", "endings_unanswered"), [(0, 0), (3, 0), (0, 1)])
async def test_a_power_loss_after_an_executor_ended_by_itself_keeps_its_own_ending(
    world: World,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    unanswered: int,
    endings_unanswered: int,
) -> None:
    """Renewals are written without waiting for the disk; the executor then exits 0 (its
    supervisor records that durably) and the power goes before the Worker wrote so. What
    the disk kept is the record as of the last sync, which came before the last call
    that advanced the lease: at most one version behind control, as after a lost answer.
    The Worker back from the reboot asks lease control for it (a last word: its local
    lease counts as over) and reports the executor's own ending, never lost — also when
    control's first answers are lost (`unanswered`): an ending waits for control's word;
    and when control took the ending but its answer was lost (`endings_unanswered`), the
    ending sent again is answered as the same completion, taken once."""
    worker, control = _versioned_worker(world, tmp_path)
    kept: list[Any] = [None]  # the record as the disk holds it
    written: list[Any] = [None]  # the record as last committed
    compare_and_set, sync = world.inbox.compare_and_set, world.inbox.sync

    def recording(current: Any, updated: Any, *, durable: bool = True) -> Any:
        written[0] = compare_and_set(current, updated, durable=durable)
        if durable:
            kept[0] = written[0]
        return written[0]

    def syncing() -> bool:
        synced = sync()
        if synced:  # only what the inbox really synced: its own bookkeeping is tested too
            kept[0] = written[0]
        return synced

    monkeypatch.setattr(world.inbox, "compare_and_set", recording)
    monkeypatch.setattr(world.inbox, "sync", syncing)
    gate = tmp_path / "go"
    offer = world.offer(["sh", "-c", f'while [ ! -e "{gate}" ]; do sleep 0.02; done'])
    assert worker.admit(offer=offer, worker_id=WORKER, session_id=SESSION, worker_generation=1)
    offer_id = offer.offer_id
    await _reconciled_until(worker, offer_id, Outcome.RUNNING.__eq__)
    for _ in range(3):
        world.clock_offset_ms[0] += 3_000  # lease control falls due
        assert await worker.reconcile(offer_id) is Outcome.RUNNING
    running = _record_of(world, offer_id)
    identity = identity_of(running)
    assert identity is not None
    gate.touch()
    await asyncio.to_thread(world.processes._children[identity].wait)  # the status is on disk
    ahead = control.version - kept[0].lease_version
    print(f"control at version {control.version}, the disk kept {kept[0].lease_version}")
    assert ahead <= 1, "control is never more than one version ahead of what the disk kept"

    # The power goes: the row is what the disk kept; the next boot has another id.
    monkeypatch.undo()
    database = sqlite3.connect(world.inbox.path)
    values = inbox_module._row_values(kept[0])
    values["expected_revision"] = running.revision
    assert database.execute(inbox_module._UPDATE, values).rowcount == 1
    database.commit()
    database.close()
    rebooted = _after_a_reboot(world, control, tmp_path, monkeypatch)
    control.unanswered = unanswered
    control.endings_unanswered = endings_unanswered
    late_before = REGISTRY.get_sample_value("qinglong_worker_late_last_words_total")
    outcomes = await _reconciled_until(
        rebooted, offer_id, lambda outcome: outcome in (Outcome.COMPLETED, Outcome.LEASE_LOST)
    )
    assert outcomes[-1] is Outcome.COMPLETED, control.calls[-4:]
    assert control.completed.outcome == worker_pb2.ATTEMPT_OUTCOME_SUCCEEDED
    assert control.completions == 1
    assert outcomes.count(Outcome.WAITING) == unanswered + endings_unanswered, outcomes
    late = REGISTRY.get_sample_value("qinglong_worker_late_last_words_total")
    assert late is not None
    assert late_before is not None
    # Counted while past the local lease; an ending whose answer was lost after lease
    # control answered in this boot waits within the lease that answer gave: not late.
    assert late - late_before == unanswered
    done = _record_of(world, offer_id)
    assert (done.state, done.lease_version) == (
        RecordState.COMPLETION_ACKNOWLEDGED,
        control.version,
    )


@pytest.mark.parametrize("control_expired_it", [False, True])
async def test_a_reboot_reports_an_executor_that_ended_before_its_start_was_acknowledged(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, control_expired_it: bool
) -> None:
    """The executor exits 0 while AcknowledgeRunning goes unanswered, and the machine
    reboots: the record is `started`, its local lease counts as over. Nothing runs, so the
    start and then the ending are sent as last words, each waiting for control's answer
    (two lost), and the Run gets the executor's own outcome — unless control has expired
    the lease meanwhile: its fence then closes the record as lease lost, nothing ended."""
    worker, control = _versioned_worker(world, tmp_path)
    started = await _started_unacknowledged(world, worker, control, ["sh", "-c", "exit 0"])
    identity = identity_of(started)
    assert identity is not None
    await asyncio.to_thread(world.processes._children[identity].wait)  # the status is on disk

    rebooted = _after_a_reboot(world, control, tmp_path, monkeypatch)
    control.unanswered = 2
    if control_expired_it:
        control.version += 1  # as control's expiry leaves it: no fence of ours matches
    sent_before = len(control.calls)
    outcomes = await _reconciled_until(
        rebooted,
        started.offer_id,
        lambda outcome: outcome in (Outcome.COMPLETED, Outcome.LEASE_LOST),
    )
    after_reboot = control.calls[sent_before:]
    assert outcomes.count(Outcome.WAITING) == 2, outcomes
    if control_expired_it:
        assert outcomes[-1] is Outcome.LEASE_LOST
        assert "CompleteAttempt" not in after_reboot
        closed = _record_of(world, started.offer_id)
        assert closed.quarantine_reason is QuarantineReason.LEASE_LOST_LOCAL_EXECUTION_STOPPED
    else:
        assert outcomes[-1] is Outcome.COMPLETED, after_reboot
        assert control.completed.outcome == worker_pb2.ATTEMPT_OUTCOME_SUCCEEDED
        assert after_reboot[-2:] == ["AcknowledgeRunning", "CompleteAttempt"]


async def test_the_workers_own_stop_of_a_started_executor_is_not_reported_as_its_ending(
    world: World, tmp_path: Path
) -> None:
    """A started record whose executor this Worker signalled (as it does a launch still
    unanswered when its local lease ran out, adopted afterwards) and whose local lease is
    over: the stop is the Worker's, not the task's ending, so nothing is reported and the
    record closes as lease lost (found in review)."""
    worker, control = _versioned_worker(world, tmp_path)
    started = await _started_unacknowledged(world, worker, control, ["sleep", "30"])
    identity = identity_of(started)
    assert identity is not None
    assert await world.processes.stop(identity, grace_seconds=2.0) is StopResult.STOPPED
    world.clock_offset_ms[0] += 600_000  # the local lease has run out
    control.unanswered = 0
    outcomes = await _reconciled_until(
        worker, started.offer_id, lambda o: o in (Outcome.COMPLETED, Outcome.LEASE_LOST)
    )
    assert outcomes[-1] is Outcome.LEASE_LOST
    assert "CompleteAttempt" not in control.calls


async def test_a_launch_stopped_past_its_lease_and_adopted_is_not_reported_failed(
    world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real supervisor slow to answer its launch (its answer's rename waits 1 s, as on a
    slow disk) after it started the executor; the local lease runs out meanwhile, the
    Worker stops the supervisor (SIGTERM, forwarded to the executor), then adopts the
    launch as started. The executor's end by that SIGTERM is not the task's failure."""
    script = tmp_path / "slow_answer_supervisor.py"
    script.write_text(
        "import os, runpy, sys, time\n"
        "_rename = os.rename\n"
        "def slow(src, dst, *a, **k):\n"
        "    if 'launch-' in str(dst):\n"
        "        time.sleep(1.0)\n"
        "    return _rename(src, dst, *a, **k)\n"
        "os.rename = slow\n"
        f"sys.argv[0] = {str(process.SUPERVISOR_SCRIPT)!r}\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    monkeypatch.setattr(process, "SUPERVISOR_SCRIPT", script)
    monkeypatch.setattr(process, "_READY_TIMEOUT_SECONDS", 0.3)
    offer_id = world.admit(["sleep", "30"])
    assert await world.reconciler.reconcile(offer_id) is Outcome.WAITING
    assert _record_of(world, offer_id).state is RecordState.LAUNCHING
    world.clock_offset_ms[0] += 600_000  # the local lease runs out while it is pending
    outcomes = await _reconciled_until(
        world.reconciler,
        offer_id,
        lambda o: o in (Outcome.COMPLETED, Outcome.LEASE_LOST, Outcome.START_FAILED),
    )
    assert outcomes[-1] is Outcome.LEASE_LOST, world.client.calls
    assert "CompleteAttempt" not in world.client.calls
