"""`reconcile(offer_id)`: bring one inbox record one step closer to done (SPEC R-W-2).

Single-item, timer-free and coalesced per offer: a call while the same offer is being
reconciled joins that run instead of starting another. Each pass re-reads the record,
so every fence carries the newest *persisted* lease version, and goes, in order:

1. done if completion was acknowledged (or the record is otherwise closed) — but for
   the rest of its output, which is still shipped (below);
2. completion first: a process that exited is persisted as ``exited`` with its outcome
   (fixed once, from the exit status and any stop reason; an ending that says nothing of
   the executor's own — its supervisor stopped it at the lease's end, or was killed and
   left no status — closes the record as lease lost instead) and reported with
   CompleteAttempt — before anything else is asked of the control plane, once the rest
   of its output is shipped (R-OPS-1: a terminal Run's output is complete; the lease is
   kept meanwhile, and given up waiting for when the lease runs out locally or the
   Worker stops for shutdown: what is left is then shipped after the record closed);
3. if the local lease estimate ran out, the control plane is not called: the process
   is stopped by its durable identity and the record quarantined
   ``lease_lost_local_execution_stopped`` or ``…_unverified``;
4. otherwise ControlLease with the full fence; on ``renewed``/``stop_requested`` the
   new version is persisted (compare-and-set) *before* anything is stopped;
5. on ``terminal`` the exact process is stopped and the record quarantined
   ``control_plane_terminal``; nothing terminal is written to the control plane.

The start path of a claimed record runs here too: the capability is persisted before
ClaimOffer (``claiming``), then AcknowledgeStarting, the R-TO-2 check of the activation
against the plan, ``launching`` persisted, spawn, identity persisted (``started``),
AcknowledgeRunning (``running_acknowledged``). A start that cannot be established is
reported with ReportStartFailure. A ``launching`` record whose spawn outcome a crash
took with it is settled from its launch claim first (:mod:`qinglong_worker.launch`): a
started executor is adopted, and only one that never started is reported as a failure.

Output (:mod:`qinglong_worker.output`): while the executor runs, a reconcile with output
to ship and no lease control due ships a bounded number of chunks, and stops when lease
control falls due (which then follows at once); lease control comes first whenever it is
due. A closed record (completed, or quarantined: the lease ran out locally, the control
plane answered terminal, the Worker stopped before all was shipped) goes on shipping the
rest of its file without a lease, best effort, a bounded pass per reconcile, until the
control plane holds all of it (``output_shipped``) or refused it for good
(``output_given_up``; a live record's refusal is persisted the same way and not sent
again). The lifecycle reconciles such records each tick, after the live ones, and a
restarted Worker does the same from its inbox.

Every call is retried inside the reconcile (see :mod:`qinglong_worker.client`) on
``UNAVAILABLE``, ``DEADLINE_EXCEEDED`` and a broken connection, for a lease-holding
command never beyond the record's local lease time (SPEC R-LC-8). Only a genuine fence
(``ABORTED`` with a fencing reason: the session, lease, version or capability is no
longer ours) means the authority is lost: the process is stopped like in step 3 and the
reason kept in ``detail``. Any other refusal and a failure that outlived its retries
change nothing; the next tick tries again, and step 3 ends the wait once the lease has
run out locally — except for an executor that has ended by itself: its report (the
ending, and the start before it if that was never acknowledged) is a *last word*, one
try per pass past the local lease too, until control answers. The local estimate bounds
how long an executor runs without control's word; control judges a report by its own
clock, and giving one up would turn the executor's own outcome into ``lost``.

Shutdown (SPEC §4, graceful drain): in :attr:`Mode.DRAINING` nothing new is claimed or
started, while running Attempts are supervised as usual; in :attr:`Mode.STOPPING` a
running executor is stopped by the Worker itself — the stop reason ``local_shutdown`` is
persisted before the signal — and reported CANCELLED with ``stop_reason = SHUTDOWN``
(unless the control plane already asked for a stop, whose reason then stands).
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import functools
import hashlib
import logging
import secrets
from collections.abc import Callable, Iterable
from enum import StrEnum
from pathlib import Path
from typing import Any, Final

from qinglong.rpc.v1 import fence_pb2, lifecycle_pb2
from qinglong.rpc.v1.error_reason_pb2 import ErrorReason
from qinglong.worker.v1 import worker_pb2
from qinglong.worker.v1 import worker_service_pb2 as ws
from qinglong_protocol import bounds

from qinglong_worker import local_lease, metrics, supervisor
from qinglong_worker.client import CallFailed, WorkerClient
from qinglong_worker.clock import BootInstant, boot_now, wall_clock_ms
from qinglong_worker.inbox import (
    OPEN_STATES,
    Inbox,
    InboxRecord,
    InboxUnreadable,
    QuarantineReason,
    RecordState,
    parameters_of,
)
from qinglong_worker.launch import LaunchState, forget_launch, launch_key, resolve_launch
from qinglong_worker.metrics import StartPhases
from qinglong_worker.output import (
    Shipped,
    log_file,
    output_size,
    output_stream_id,
    ship_output,
)
from qinglong_worker.process import (
    UNOBSERVED_EXIT,
    ExecutorRefused,
    ExitStatus,
    LaunchUnanswered,
    ProcessController,
    ProcessIdentity,
    StopResult,
)

log = logging.getLogger(__name__)

#: The longest SIGTERM grace of an executor whose lease is gone: a long
#: ``--stop-grace-seconds`` is for stops the control plane asked for while the lease is
#: kept; without one, the stop must fit in control's ``--worker-stop-ms`` (20 s by
#: default, with this grace, the tick and the kill in it). The supervisor's own stop at
#: the lease's end uses the same.
LEASE_GONE_STOP_GRACE_SECONDS: Final = supervisor.LEASE_GONE_STOP_GRACE_SECONDS
#: The callback sequence `running` stores; completion presents it.
FIRST_CALLBACK_SEQUENCE: Final = 1
#: Passes of one reconcile before it yields to the next tick (a start takes four).
_MAX_PASSES: Final = 8
#: The start failure of a spawn a crash interrupted before its supervisor claimed the
#: launch (the restarted Worker claimed it "never started"); tests find it in the log.
RESTARTED_WHILE_LAUNCHING: Final = "worker restarted before the executor identity was recorded"
_LEASE_ENDED_BEFORE_THE_START: Final = "the local lease ran out before the executor started"
#: Refusals of CompleteAttempt that mean the control plane decided otherwise (as opposed
#: to this Worker's authority having lapsed).
_COMPLETION_CONFLICTS: Final = frozenset(
    {
        ErrorReason.ERROR_REASON_REPLAY_MISMATCH,
        ErrorReason.ERROR_REASON_STATE_CONFLICT,
        ErrorReason.ERROR_REASON_CALLBACK_SEQUENCE_FENCED,
    }
)
#: The stop reason of an executor this Worker stopped itself because it shut down (as
#: opposed to a reason the control plane sent, such as ``user``, ``timeout`` — or a
#: durable ``shutdown`` intent, which is the control plane's own).
LOCAL_SHUTDOWN: Final = "local_shutdown"
_SHUTDOWN_BEFORE_RUNNING: Final = "worker shut down before running was acknowledged"
#: States whose spawn may still have a launch claim on disk: it goes when they are left
#: (``started`` too: a crash may come between persisting it and removing the claim).
_CLAIMED_LAUNCH: Final = frozenset({RecordState.LAUNCHING, RecordState.STARTED})


class Mode(StrEnum):
    """What the Reconciler may still begin."""

    NORMAL = "normal"
    DRAINING = "draining"
    """No claim and no start; running Attempts are supervised and complete as usual."""
    STOPPING = "stopping"
    """As draining, and running executors are stopped for the Worker's shutdown."""


#: Errors of a spawn that are this machine's, not the task's: its disk is full or read
#: only, it is out of file descriptors, memory or processes, or its storage fails.
WORKER_FAULT_ERRNOS: Final = frozenset(
    {
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EROFS,
        errno.EIO,
        errno.EMFILE,
        errno.ENFILE,
        errno.ENOMEM,
        errno.EAGAIN,
    }
)


class Outcome(StrEnum):
    """What one reconcile achieved, for the lifecycle's pull decision and for tests."""

    MISSING = "missing"
    DONE = "done"
    RUNNING = "running"
    WAITING = "waiting"
    """A transient failure: nothing changed; try again at the next tick."""
    STOP_PENDING = "stop_pending"
    """A stop was requested but the process could not be confirmed stopped yet."""
    REFUSED = "refused"
    """The control plane refused without a fence: nothing changed locally; the next
    tick tries again until the lease runs out locally (the process is kept)."""
    HELD = "held"
    """Draining: the record is not yet started and will not be by this process."""
    IN_FLIGHT = "in_flight"
    """The reconcile is still running (e.g. retrying); the next tick joins it."""
    COMPLETED = "completed"
    START_FAILED = "start_failed"
    ABANDONED = "abandoned"
    LEASE_LOST = "lease_lost"
    TERMINAL = "terminal"
    SHIPPING = "shipping"
    """A closed record's output is still being shipped (best effort, no lease)."""
    WORKER_FAULT = "worker_fault"
    """Nothing could be started for a fault of this machine (disk full, no descriptors
    left): the record is given up unreported and the lifecycle pauses pulling."""

    @property
    def stops_pulling(self) -> bool:
        """Lease loss or a control-plane terminal answer: take no new work this tick."""
        return self in (
            Outcome.LEASE_LOST,
            Outcome.TERMINAL,
            Outcome.STOP_PENDING,
            Outcome.REFUSED,
            Outcome.IN_FLIGHT,
            Outcome.WORKER_FAULT,
        )


@dataclasses.dataclass(frozen=True)
class _Sent:
    """When a lease-holding request was sent: the boot clock for the estimate, the wall
    clock for humans."""

    boot: BootInstant
    wall_ms: int


def _observation(sent: _Sent, lease_remaining_ms: int) -> dict[str, Any]:
    """The record fields of a lease answer to a request sent at ``sent``."""
    return {
        "lease_observed_unix_ms": sent.wall_ms,
        "lease_observed_boot_ms": sent.boot.ms,
        "lease_observed_boot_id": sent.boot.boot_id,
        "lease_remaining_ms": lease_remaining_ms,
    }


def fence_of(record: InboxRecord) -> fence_pb2.Fence:
    """The full fence from the persisted record (never from anything in memory)."""
    if (
        record.attempt_id is None
        or record.lease_generation is None
        or (record.lease_version is None)
    ):
        raise ValueError(f"offer {record.offer_id} has no lease authority yet")
    return fence_pb2.Fence(
        worker_id=record.worker_id,
        session_id=record.session_id,
        worker_generation=record.worker_generation,
        project_id=record.project_id,
        run_id=record.run_id,
        attempt_id=record.attempt_id,
        offer_id=record.offer_id,
        lease_generation=record.lease_generation,
        lease_token=record.capability,
        expected_lease_version=record.lease_version,
    )


def new_capability() -> str:
    """A fresh lease capability: 32 random bytes, never a weak one (R-CLAIM-2)."""
    while True:
        capability = bounds.encode_lease_capability(secrets.token_bytes(32))
        if bounds.is_acceptable_lease_capability(capability):
            return capability


def callback_digest(token: str) -> str:
    return hashlib.sha256(token.encode("ascii")).hexdigest()


def activation_problem(timeout_ms: int | None, activation: worker_pb2.ActivationSnapshot) -> str:
    """Empty when the activation's deadline presence agrees with the plan (R-TO-2)."""
    present = (
        activation.HasField("timeout_ms"),
        activation.HasField("deadline"),
        activation.HasField("deadline_remaining"),
    )
    if timeout_ms is None:
        if any(present):
            return "activation has a deadline but the plan has no timeout"
        return ""
    if not all(present):
        return "activation lacks the deadline the plan's timeout requires"
    if activation.timeout_ms != timeout_ms:
        return "activation timeout differs from the plan"
    return ""


def _ended_by_itself(record: InboxRecord, status: ExitStatus, signalled: bool) -> bool:
    """A process found already gone when its stop began: did it end on its own?

    For the Worker's own shutdown, yes (it only stops what still runs). For a stop the
    control plane asked for, when nothing was ever signalled to it by this Worker and it
    ended with an exit code, not by a signal: an executor that finished while the stop
    answer was on its way succeeded or failed by itself, and control takes that fact
    whatever was asked. A Worker restarted after signalling a process that then handled
    the signal and exited with a code cannot tell; it reports the exit code too."""
    if record.stop_reason == LOCAL_SHUTDOWN:
        return True
    return not signalled and status.exit_code is not None and status.signal is None


def _lost_execution(record: InboxRecord, status: ExitStatus) -> str | None:
    """Why an ending says nothing of the executor's own outcome (None if it does):

    * its supervisor stopped it when the lease written for it ran out (the Worker was
      down, or too late to renew);
    * its supervisor ended without a status — killed with the Worker's container, by a
      reboot, or by hand (the executor died with it). A status that exists but cannot
      be read says the executor ended by itself: that one is reported, as not
      observable.

    Reporting either as `failed` would blame the task for what happened to the machine,
    and a policy that retries only `lost` would not retry it. A stop the Worker or the
    control plane asked for is an ending all the same (the stop reason says which)."""
    if record.stop_reason not in (None, LOCAL_SHUTDOWN):
        return None
    if status.lease_ran_out:
        return "stopped by its supervisor: the local lease ran out"
    if status.lost_with_supervisor and record.stop_reason is None:
        return "its supervisor ended without an exit status: the execution was lost with it"
    return None


def completion_outcome(stop_reason: str | None, status: ExitStatus) -> str:
    """succeeded | failed | cancelled | timed_out, fixed when the exit is persisted.

    Any stop reason — the control plane's or :data:`LOCAL_SHUTDOWN` — makes a stopped
    process ``cancelled`` (``timed_out`` for ``timeout``)."""
    if stop_reason == "timeout":
        return "timed_out"
    if stop_reason is not None:
        return "cancelled"
    return "succeeded" if status.exit_code == 0 else "failed"


def exit_summary(record: InboxRecord) -> str:
    if record.exit_code is not None:
        ending = f"exit code {record.exit_code}"
    elif record.exit_signal is not None:
        ending = f"terminated by signal {record.exit_signal}"
    else:
        ending = "exit status not observable"
    if record.stop_reason == LOCAL_SHUTDOWN:
        return f"stopped by the Worker's shutdown; {ending}"
    if record.stop_reason is not None:
        return f"stopped on request ({record.stop_reason}); {ending}"
    return ending


_OUTCOMES: Final = {
    "succeeded": worker_pb2.ATTEMPT_OUTCOME_SUCCEEDED,
    "failed": worker_pb2.ATTEMPT_OUTCOME_FAILED,
    "cancelled": worker_pb2.ATTEMPT_OUTCOME_CANCELLED,
    "timed_out": worker_pb2.ATTEMPT_OUTCOME_TIMED_OUT,
}


def _cancel_reason_name(reason: lifecycle_pb2.CancelReason.ValueType) -> str:
    return lifecycle_pb2.CancelReason.Name(reason).removeprefix("CANCEL_REASON_").lower()


def lease_control_in(record: InboxRecord, now: BootInstant, lease_control_ms: int) -> int:
    """Milliseconds (boot clock) until a running Attempt's lease is next controlled:
    every ``lease_control_ms``, and always before a third of its remaining time is used
    up. 0: at once (nothing observed yet, or observed in another boot)."""
    observed = record.lease_observed
    if observed is None or record.lease_remaining_ms is None or observed.boot_id != now.boot_id:
        return 0
    due_at = observed.ms + min(lease_control_ms, record.lease_remaining_ms // 3)
    return max(0, due_at - now.ms)


def lease_control_due(record: InboxRecord, now: BootInstant, lease_control_ms: int) -> bool:
    return lease_control_in(record, now, lease_control_ms) <= 0


def identity_of(record: InboxRecord) -> ProcessIdentity | None:
    if record.executor_pid is None or record.executor_start_ticks is None:
        return None
    return ProcessIdentity(
        record.executor_pid, record.executor_start_ticks, record.executor_boot_id
    )


class Reconciler:
    """Reconciles inbox records against the control plane and the local process."""

    def __init__(
        self,
        *,
        inbox: Inbox,
        client: WorkerClient,
        processes: ProcessController,
        lease_clock: Callable[[], BootInstant] = boot_now,
        wall_clock: Callable[[], int] = wall_clock_ms,
        stop_grace_seconds: float = 5.0,
        log_dir: Path | None = None,
        lease_control_seconds: float = 2.0,
    ) -> None:
        """``log_dir``: where executors write their output (one file per offer), which
        is shipped to the control plane; without it output is discarded.
        ``lease_control_seconds``: how often a running Attempt's lease is controlled
        (renewal, stop, terminal). ``lease_clock`` measures the local lease (the boot
        clock); ``wall_clock`` only stamps records for humans (:mod:`qinglong_worker.clock`)."""
        if not lease_control_seconds > 0:
            raise ValueError("lease_control_seconds must be positive")
        self._inbox = inbox
        self._client = client
        self._processes = processes
        self._now = lease_clock
        self._wall_clock = wall_clock
        self._grace = stop_grace_seconds
        self._log_dir = log_dir
        self._lease_control_ms = int(lease_control_seconds * 1000)
        self._inflight: dict[str, asyncio.Task[Outcome]] = {}
        self._mode = Mode.NORMAL
        self._fatal: InboxUnreadable | None = None
        self._phases = StartPhases()  # claim -> starting -> running latency (metrics)

    # --- entry points ---------------------------------------------------------------------

    @property
    def stop_grace_seconds(self) -> float:
        """Between SIGTERM and SIGKILL when this Reconciler stops an executor."""
        return self._grace

    @property
    def mode(self) -> Mode:
        return self._mode

    def set_mode(self, mode: Mode) -> None:
        """Draining, then stopping; a mode never goes back."""
        order = list(Mode)
        if order.index(mode) < order.index(self._mode):
            raise ValueError(f"cannot go back from {self._mode} to {mode}")
        self._mode = mode

    def lease_control_due(self, record: InboxRecord) -> bool:
        return lease_control_due(record, self._now(), self._lease_control_ms)

    def lease_lost_locally(self, record: InboxRecord) -> bool:
        """The local lease estimate of ``record`` has run out (on the boot clock)."""
        return record.lease_lost_locally(self._now())

    def output_pending(self, record: InboxRecord) -> bool:
        """The executor wrote output the control plane does not hold yet, and shipping
        it was not given up."""
        if record.output_given_up is not None or record.output_shipped:
            return False
        return output_size(self._log_path(record)) > record.output_offset

    @property
    def fatal(self) -> InboxUnreadable | None:
        """The inbox failure a reconcile met after its caller stopped waiting for it."""
        return self._fatal

    def admit(
        self,
        *,
        offer: worker_pb2.Offer,
        worker_id: str,
        session_id: str,
        worker_generation: int,
    ) -> bool:
        """Persist a pulled offer with a fresh capability (state ``claiming``) before
        anything is claimed. False if the offer is already in the inbox."""
        now = self._wall_clock()
        plan = offer.spec.plan
        record = InboxRecord(
            offer_id=offer.offer_id,
            revision=1,
            state=RecordState.CLAIMING,
            worker_id=worker_id,
            session_id=session_id,
            worker_generation=worker_generation,
            project_id=offer.project_id,
            run_id=offer.run_id,
            capability=new_capability(),
            argv=tuple(plan.command),
            timeout_ms=plan.timeout_ms if plan.HasField("timeout_ms") else None,
            parameters=parameters_of(offer.spec.parameters),
            created_unix_ms=now,
            updated_unix_ms=now,
        )
        admitted = self._inbox.admit(record)
        if admitted:
            log.info("offer %s run %s: admitted", record.offer_id, record.run_id)
        return admitted

    async def reconcile(self, offer_id: str) -> Outcome:
        """Reconcile one offer; joins a reconcile of the same offer already in flight."""
        task = self._inflight.get(offer_id)
        if task is None:
            task = asyncio.create_task(self._reconcile(offer_id), name=f"reconcile {offer_id}")
            self._inflight[offer_id] = task
            task.add_done_callback(functools.partial(self._forget, offer_id))
        # A cancelled caller does not cancel the shared work; abort() does.
        return await asyncio.shield(task)

    @property
    def log_dir(self) -> Path | None:
        """Where executors write their output (one file per offer)."""
        return self._log_dir

    def reconciling(self, offer_id: str) -> bool:
        """A reconcile of ``offer_id`` is in flight (perhaps a call on the wire)."""
        return offer_id in self._inflight

    async def abort(self) -> None:
        """Cancel every reconcile in flight (shutdown aborts in-flight requests)."""
        tasks = list(self._inflight.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def stop_remembered(self) -> int:
        """Stop every executor this process spawned or saw running, by the identities it
        remembers — for when the inbox cannot be read. Returns how many were stopped.

        The leases-revoked mark goes first: a supervisor stopped while it exists records
        its lease as run out, so the restarted Worker reports these Runs lost — the
        Worker's fault — not failed by SIGTERM (nothing can be written in the inbox to
        say so)."""
        self.set_mode(Mode.STOPPING)
        status_dir = self._processes.status_dir
        if status_dir is not None:
            try:
                (status_dir / supervisor.LEASES_REVOKED_FILE).write_text("inbox lost\n")
            except OSError as error:
                log.warning("leases-revoked mark not written (%s)", error.strerror)
        return len(await self._processes.stop_all(grace_seconds=self._grace))

    async def stop_everything(self) -> int:
        """The last step of a shutdown: stop every executor that still runs, by its
        verified identity, without calling the control plane; persist what it can
        (a stopped ``running_acknowledged`` record becomes ``exited`` with the stop
        reason ``local_shutdown``, so a restarted Worker reports it). Returns how many
        were stopped. Anything the inbox does not name but this process remembers is
        stopped too."""
        self.set_mode(Mode.STOPPING)
        running: list[InboxRecord] = []
        for record in self._inbox.records(OPEN_STATES):
            identity = identity_of(record)
            if identity is not None and self._processes.poll(identity) is None:
                running.append(record)
        await asyncio.gather(*(self._sweep(record) for record in running))
        leftovers = await self._processes.stop_all(grace_seconds=self._grace)
        return len(running) + len(leftovers)

    def _forget(self, offer_id: str, task: asyncio.Task[Outcome]) -> None:
        if self._inflight.get(offer_id) is task:
            del self._inflight[offer_id]
        if task.cancelled():
            return
        # Retrieved here, so that a reconcile nobody waits for any more cannot hide it.
        error = task.exception()
        if isinstance(error, InboxUnreadable) and self._fatal is None:
            self._fatal = error

    # --- the passes -----------------------------------------------------------------------

    async def _reconcile(self, offer_id: str) -> Outcome:
        for _ in range(_MAX_PASSES):
            record = self._inbox.get(offer_id)
            if record is None:
                return Outcome.MISSING
            outcome = await self._pass(record)
            if outcome is not None:
                return outcome
        return Outcome.WAITING

    async def _pass(self, record: InboxRecord) -> Outcome | None:
        """One step; None means "re-read the record and continue"."""
        state = record.state
        if state.is_terminal:
            return await self._ship_after_close(record)
        if self._mode is not Mode.NORMAL and state in (RecordState.CLAIMING, RecordState.CLAIMED):
            # Draining takes no new work: an unanswered or unstarted claim is left to
            # its lease, which expires and returns the Run to the queue (R-RETRY-1).
            return Outcome.HELD
        if state is RecordState.CLAIMING:
            return await self._claim(record)
        if state is RecordState.EXITED:  # (2) completion first, after the output
            return await self._complete_with_output(record)
        if state is RecordState.RUNNING_ACKNOWLEDGED:
            identity = identity_of(record)
            status = None if identity is None else self._processes.poll(identity)
            if status is not None:
                self._persist_exit(record, status)
                return None
        if state is RecordState.LAUNCHING and record.start_failure is None:
            # A spawn whose answer a crash took with it; local, so before (3): a
            # started executor is adopted, and then stopped like any other if need be.
            if await self._settle_launch(record):
                return None
            if not self.lease_lost_locally(record):
                return Outcome.WAITING
            # Still undecided past the lease: (3) quarantines it as unverified.
        if state is RecordState.STARTED and self._ended_unacknowledged(record):
            # Ended before its start was acknowledged, and the local lease is over (a
            # reboot took the answer and the estimate): nothing runs, so the start and
            # then the ending are reported as last words, like any ending (2).
            return await self._acknowledge_running(record, last_word=True)
        if self.lease_lost_locally(record):  # (3) no control call
            return await self._lease_lost(record, "local lease estimate expired")
        if state is RecordState.CLAIMED:
            return await self._start(record)
        if state is RecordState.LAUNCHING:
            return await self._report_start_failure(record)
        if state is RecordState.STARTED:
            return await self._acknowledge_running(record)
        if self._mode is Mode.STOPPING:
            return await self._stop_for_shutdown(record)
        if self.output_pending(record) and not self.lease_control_due(record):
            shipped = await self._ship(record)
            # Stopped at its deadline: lease control is due, and follows at once.
            due = shipped.pending and self.lease_control_due(shipped.record)
            return None if due else Outcome.RUNNING
        return await self._control(record)  # (4) and (5)

    async def _claim(self, record: InboxRecord) -> Outcome | None:
        sent = self._sent()
        try:
            # No lease yet: the client's default retry budget bounds the retries.
            claimed = await self._client.claim_offer(
                ws.ClaimOfferRequest(
                    worker_id=record.worker_id,
                    session_id=record.session_id,
                    worker_generation=record.worker_generation,
                    offer_id=record.offer_id,
                    project_id=record.project_id,
                    run_id=record.run_id,
                    lease_token=record.capability,
                )
            )
        except CallFailed as failure:
            if failure.transient:
                return self._waiting(record, failure)
            # Never launched: there is no output to ship later.
            self._save(
                record, state=RecordState.ABANDONED, detail=failure.label, output_shipped=True
            )
            return Outcome.ABANDONED
        plan = claimed.spec.plan
        self._phases.claimed(record.offer_id)
        self._save(
            record,
            state=RecordState.CLAIMED,
            attempt_id=claimed.attempt_id,
            lease_generation=claimed.lease_generation,
            lease_version=claimed.lease_version,
            **_observation(sent, claimed.lease_remaining.ToMilliseconds()),
            argv=tuple(plan.command),
            timeout_ms=plan.timeout_ms if plan.HasField("timeout_ms") else None,
            parameters=parameters_of(claimed.spec.parameters),
        )
        return None

    async def _start(self, record: InboxRecord) -> Outcome | None:
        """AcknowledgeStarting, check the activation, persist, spawn, persist identity."""
        try:
            starting = await self._client.acknowledge_starting(
                ws.AcknowledgeStartingRequest(fence=self._fence(record)),
                budget_seconds=self._lease_budget(record),
            )
        except CallFailed as failure:
            if failure.transient:
                return await self._after_transient(record, failure)
            # Nothing runs yet: any refusal closes the record.
            return await self._lease_lost(record, failure.label)
        self._phases.starting(record.offer_id)
        if starting.outcome == worker_pb2.STARTING_OUTCOME_ALREADY_RUNNING:
            # `running` is durable, yet this record never launched: whatever reported it
            # is not this inbox's process, and starting another would run the Run twice.
            # The record closes; the lease is left to its holder, or to expire.
            self._quarantine(
                record, QuarantineReason.RUNNING_ELSEWHERE, "starting answered ALREADY_RUNNING"
            )
            return Outcome.TERMINAL
        activation = starting.activation
        problem = activation_problem(record.timeout_ms, activation)
        has_deadline = not problem and activation.HasField("deadline")
        record = self._save(
            record,
            state=RecordState.LAUNCHING,
            deadline_unix_ms=activation.deadline.ToMilliseconds() if has_deadline else None,
            deadline_remaining_ms=(
                activation.deadline_remaining.ToMilliseconds() if has_deadline else None
            ),
            callback_sequence=FIRST_CALLBACK_SEQUENCE,
            callback_token=secrets.token_urlsafe(32),
            start_failure=problem or None,
        )
        if problem:
            return None  # the next pass reports the start failure
        if self.lease_lost_locally(record):
            # Answered after the local lease ran out: nothing starts without a lease.
            self._save(record, start_failure=_LEASE_ENDED_BEFORE_THE_START)
            return None
        # A drain that began while `starting` was on the wire still starts it: the
        # Attempt is `starting` now, and the drain grace may let it finish.
        # The spawn and the persisting of its identity are one step, as when the spawn
        # blocked the loop: a cancel (shutdown's abort) that comes while the supervisor
        # has yet to answer waits for both, so the record does not stay `launching` over
        # a supervisor that this process killed or lost track of. Other Runs' lease
        # control goes on meanwhile: the wait is on the loop.
        step = asyncio.ensure_future(self._spawn_and_record(record))
        step.add_done_callback(_retrieved)
        try:
            return await asyncio.shield(step)
        except asyncio.CancelledError:
            await asyncio.wait({step})  # cancelled again: the step ends on its own
            raise

    async def _spawn_and_record(self, record: InboxRecord) -> Outcome | None:
        try:
            identity = await self._processes.spawn_async(
                record.argv,
                timeout_ms=record.timeout_ms,
                deadline_unix_ms=record.deadline_unix_ms,
                extra_environment={
                    **parameter_environment(record.parameters),
                    "QINGLONG_PROJECT_ID": record.project_id,
                    "QINGLONG_RUN_ID": record.run_id,
                    "QINGLONG_ATTEMPT_ID": record.attempt_id or "",
                },
                log_path=self._log_path(record),
                launch_key=_launch_key(record),
            )
        except LaunchUnanswered:
            # The record stays `launching`: each pass settles it from the launch claim
            # (adopted once the supervisor says `ok`, a start failure if it never started
            # the executor), as after a Worker restart.
            log.warning(
                "offer %s run %s: the executor's supervisor is slow to report its start;"
                " settled from its launch claim",
                record.offer_id,
                record.run_id,
            )
            return Outcome.WAITING
        except OSError as error:
            if error.errno in WORKER_FAULT_ERRNOS:
                # Not the task's failure: reported as a start failure, it would end the
                # Run failed (and every Run pulled after it, the fault lasting). Nothing
                # started, so the lease is left to run out: the Attempt ends lost, and the
                # Run is retried after a lease lifetime.
                log.error(
                    "offer %s run %s: not started, a fault of this Worker (%s): given back",
                    record.offer_id,
                    record.run_id,
                    error.strerror or errno.errorcode.get(error.errno or 0, "?"),
                )
                self._quarantine(
                    record,
                    QuarantineReason.NOT_STARTED_WORKER_FAULT,
                    f"not started: {error.strerror or error.errno}",
                )
                return Outcome.WORKER_FAULT
            self._save(record, start_failure=_spawn_failure_summary(error))
            return None
        except ExecutorRefused as error:
            self._save(record, start_failure=_spawn_failure_summary(error))
            return None
        try:
            self._save(
                record,
                state=RecordState.STARTED,
                executor_pid=identity.pid,
                executor_start_ticks=identity.start_ticks,
                executor_boot_id=identity.boot_id,
            )
        except BaseException:
            # An identity that cannot be made durable must not leave an orphan behind.
            await self._processes.stop(identity, grace_seconds=0.0)
            raise
        log.info("offer %s run %s: started %s", record.offer_id, record.run_id, identity.handle)
        return None

    async def _settle_launch(self, record: InboxRecord) -> bool:
        """Settle an interrupted spawn from its launch claim; False while undecided."""
        key = _launch_key(record)
        try:
            verdict = resolve_launch(self._processes, key)
            if verdict.state is LaunchState.PENDING and self.lease_lost_locally(record):
                # Claimed but never answered, and the lease is gone: end the supervisor;
                # its claim then says how far it got.
                if verdict.identity is not None:
                    await self._processes.stop(verdict.identity, grace_seconds=self._grace)
                verdict = resolve_launch(self._processes, key)
        except OSError as error:
            log.warning("offer %s: launch claim unusable (%s)", record.offer_id, error.strerror)
            return False
        if verdict.state is LaunchState.PENDING:
            log.info("offer %s: its supervisor has not answered yet", record.offer_id)
            return False
        if verdict.state is LaunchState.STARTED and verdict.identity is not None:
            self._save(
                record,
                state=RecordState.STARTED,
                executor_pid=verdict.identity.pid,
                executor_start_ticks=verdict.identity.start_ticks,
                executor_boot_id=verdict.identity.boot_id,
            )
            log.info(
                "offer %s run %s: adopted %s, started before the Worker restarted",
                record.offer_id,
                record.run_id,
                verdict.identity.handle,
            )
            return True
        if verdict.identity is not None:
            # A supervisor that started nothing has ended, or is ending after its answer:
            # seen to its end (and reaped, if ours), so that nothing of it is kept to
            # supervise or stop for the rest of the Worker's life.
            await self._processes.stop(verdict.identity, grace_seconds=0.0)
            self._processes.release(verdict.identity)
        if verdict.error is not None and verdict.error.errno in WORKER_FAULT_ERRNOS:
            # As when the answer comes at once (_spawn): the machine's fault, not the
            # task's start failure; nothing started, the lease is left to run out.
            self._quarantine(
                record,
                QuarantineReason.NOT_STARTED_WORKER_FAULT,
                f"not started: {verdict.error.strerror or verdict.error.errno}",
            )
            return True
        summary = (
            RESTARTED_WHILE_LAUNCHING
            if verdict.error is None
            else _spawn_failure_summary(verdict.error)
        )
        self._save(record, start_failure=summary)
        return True

    def _ended_unacknowledged(self, record: InboxRecord) -> bool:
        """A started record past its local lease whose executor ended by itself, with an
        exit code: not by the hand of its supervisor or the machine, nor of this Worker
        (a launch still unanswered when its lease ran out is stopped, then adopted as
        started) — such endings are lost, not the task's."""
        if not self.lease_lost_locally(record):
            return False
        identity = identity_of(record)
        status = None if identity is None else self._processes.poll(identity)
        if identity is None or status is None or _lost_execution(record, status) is not None:
            return False
        return _ended_by_itself(record, status, self._processes.signalled(identity))

    async def _acknowledge_running(
        self, record: InboxRecord, *, last_word: bool = False
    ) -> Outcome | None:
        identity = identity_of(record)
        if identity is None or record.callback_token is None or record.callback_sequence is None:
            return await self._lease_lost(record, "executor identity missing")
        try:
            await self._client.acknowledge_running(
                ws.AcknowledgeRunningRequest(
                    fence=self._fence(record),
                    executor_handle=identity.handle,
                    log_artifact_id=(
                        None
                        if self._log_dir is None or record.attempt_id is None
                        else output_stream_id(record.attempt_id)
                    ),
                    callback_sequence=record.callback_sequence,
                    callback_token_digest=callback_digest(record.callback_token),
                ),
                budget_seconds=self._lease_budget(record),
                last_word=last_word,
            )
        except CallFailed as failure:
            if not last_word:
                return await self._refused(record, failure)
            if failure.transient:
                return self._ending_waits(record, failure, "start of an ended executor")
            return await self._lease_lost(record, failure.label)
        self._phases.running(record.offer_id)
        self._save(record, state=RecordState.RUNNING_ACKNOWLEDGED)
        # A short process may already be done: recover its completion right away.
        return None if self._processes.poll(identity) is not None else Outcome.RUNNING

    async def _report_start_failure(self, record: InboxRecord) -> Outcome:
        if record.start_failure is None:
            record = self._save(record, start_failure=RESTARTED_WHILE_LAUNCHING)
        summary = record.start_failure or RESTARTED_WHILE_LAUNCHING
        try:
            failed = await self._client.report_start_failure(
                ws.ReportStartFailureRequest(fence=self._fence(record), error_summary=summary),
                budget_seconds=self._lease_budget(record),
            )
        except CallFailed as failure:
            if failure.transient:
                return self._waiting(record, failure)
            self._quarantine(record, QuarantineReason.START_FAILED, failure.label)
            return Outcome.START_FAILED
        self._quarantine(
            record,
            QuarantineReason.START_FAILED,
            f"{failed.error_code}: {summary}",  # why, in the log line too
            lease_version=failed.completed_lease_version,
        )
        return Outcome.START_FAILED

    async def _control(self, record: InboxRecord) -> Outcome | None:
        sent = self._sent()
        try:
            # Retried with the same request (same expected version): a renewal whose
            # answer was lost is answered with the current projection (R-LC-8).
            answer = await self._client.control_lease(
                ws.ControlLeaseRequest(fence=self._fence(record)),
                budget_seconds=self._lease_budget(record),
            )
        except CallFailed as failure:
            return await self._refused(record, failure)
        result = answer.WhichOneof("result")
        if result == "renewed":
            # A shutdown stop of an earlier incarnation that never happened: the process
            # runs on under this one, and ends with its own outcome.
            stop_reason = None if record.stop_reason == LOCAL_SHUTDOWN else record.stop_reason
            self._save(
                record,
                # The steady state, not waiting for the disk -- unless it changes more
                # than the lease.
                durable=stop_reason != record.stop_reason,
                lease_version=answer.renewed.lease_version,
                **_observation(sent, answer.renewed.lease_remaining.ToMilliseconds()),
                stop_reason=stop_reason,
            )
            return Outcome.RUNNING
        if result == "stop_requested":
            stop = answer.stop_requested
            # Persist the new version (and why) BEFORE stopping: completion uses it.
            record = self._save(
                record,
                lease_version=stop.lease_version,
                **_observation(sent, stop.lease_remaining.ToMilliseconds()),
                stop_reason=_cancel_reason_name(stop.cancel_reason),
            )
            log.info(
                "offer %s run %s: stop requested (%s)",
                record.offer_id,
                record.run_id,
                record.stop_reason,
            )
            return await self._stop_for_completion(record)
        if result == "terminal":
            run_state = lifecycle_pb2.RunState.Name(answer.terminal.run_state)
            result_of_stop, status = await self._stop_exact(record)
            self._quarantine(
                record,
                # A process that may still run keeps the Worker from taking new work
                # while it is seen alive, whatever ended the Run.
                QuarantineReason.LEASE_LOST_LOCAL_EXECUTION_UNVERIFIED
                if result_of_stop is StopResult.UNVERIFIED
                else QuarantineReason.CONTROL_PLANE_TERMINAL,
                f"{run_state}; local process {result_of_stop}",
                status=status,
            )
            return Outcome.TERMINAL
        log.warning("offer %s: lease control answered nothing recognisable", record.offer_id)
        return Outcome.WAITING

    async def _stop_for_shutdown(self, record: InboxRecord) -> Outcome | None:
        """The Worker's own stop of a running executor (its drain grace ran out)."""
        if record.stop_reason is None:
            # Durable before the signal: a restart after a crash mid-stop still knows
            # why the process ended, and reports it as this shutdown's.
            record = self._save(record, stop_reason=LOCAL_SHUTDOWN)
            log.info("offer %s run %s: stopping for shutdown", record.offer_id, record.run_id)
        return await self._stop_for_completion(record)

    async def _stop_for_completion(self, record: InboxRecord) -> Outcome | None:
        identity = identity_of(record)
        if identity is None:
            return await self._lease_lost(record, "executor identity missing")
        stopped = await self._processes.stop(identity, grace_seconds=self._grace)
        status = self._processes.poll(identity)
        if stopped is StopResult.UNVERIFIED or status is None:
            log.warning("offer %s: stop not confirmed; will retry", record.offer_id)
            return Outcome.STOP_PENDING
        if stopped is StopResult.ALREADY_EXITED and _ended_by_itself(
            record, status, self._processes.signalled(identity)
        ):
            # It ended by itself before our signal: its own outcome stands.
            record = self._save(record, stop_reason=None)
        self._persist_exit(record, status)
        return None  # the next pass completes

    async def _complete_with_output(self, record: InboxRecord) -> Outcome | None:
        """Ship the rest of an exited executor's output (a bounded part per pass, the
        lease kept meanwhile), then report the ending. The ending waits only while the
        output flows: a pass the control plane did not take (no answer, its store
        unavailable, an internal error) reports at once — lease control would otherwise
        keep the Run `running` for as long as that lasts —, and so do a shutdown, after
        one part, and a lease that ran out locally. What is left then is shipped after
        the record closed (:meth:`_ship_after_close`); the ending says how many bytes the
        output has, so readers wait for them."""
        if self.output_pending(record) and not self.lease_lost_locally(record):
            if self.lease_control_due(record):
                kept = await self._keep_lease(record)
                if isinstance(kept, Outcome):
                    return kept
                record = kept
            shipped = await self._ship(record)
            flowing = shipped.pending and shipped.unanswered is None
            if flowing and self._mode is not Mode.STOPPING:
                return Outcome.RUNNING  # the rest at the next tick
            record = shipped.record
        if self.output_pending(record):
            log.info(
                "offer %s: reporting the ending with output from offset %d still to ship;"
                " it is shipped after the record closes",
                record.offer_id,
                record.output_offset,
            )
        return await self._complete(record)

    async def _keep_lease(
        self, record: InboxRecord, *, last_word: bool = False
    ) -> InboxRecord | Outcome:
        """Lease control for an exited executor — while its output is still being
        shipped, or to learn the version its ending was refused for (``last_word``: one
        try even when the local lease is over): a new version is persisted; a stop asked
        for now changes nothing (the process has already ended with its own outcome);
        terminal closes the record."""
        sent = self._sent()
        try:
            answer = await self._client.control_lease(
                ws.ControlLeaseRequest(fence=self._fence(record)),
                budget_seconds=self._lease_budget(record),
                last_word=last_word,
            )
        except CallFailed as failure:
            if failure.fenced:
                return await self._lease_lost(record, failure.label)
            # The next pass tries again: while output flows, until the local lease runs
            # out; for an ending's last word, until control answers (_ending_waits).
            return record
        result = answer.WhichOneof("result")
        if result == "renewed" or result == "stop_requested":
            granted = answer.renewed if result == "renewed" else answer.stop_requested
            return self._save(
                record,
                lease_version=granted.lease_version,
                **_observation(sent, granted.lease_remaining.ToMilliseconds()),
            )
        if result == "terminal":
            self._quarantine(
                record,
                QuarantineReason.CONTROL_PLANE_TERMINAL,
                lifecycle_pb2.RunState.Name(answer.terminal.run_state),
            )
            return Outcome.TERMINAL
        return record

    async def _ship(self, record: InboxRecord) -> Shipped:
        """A bounded pass for a live record: it ends when lease control falls due, and no
        chunk's retries outlast the local lease. A refusal for good is persisted."""
        path = self._log_path(record)
        assert path is not None  # output is pending only where there is a file
        now = self._now()
        due_at = now.ms + lease_control_in(record, now, self._lease_control_ms)
        shipped = await ship_output(
            self._client,
            record,
            path,
            fence_of,
            self._save_output_offset,
            seconds_left=lambda: (due_at - self._now().ms) / 1000,
            lease_seconds_left=lambda: self._lease_budget(record),
        )
        return self._settle_refusal(shipped)

    async def _ship_after_close(self, record: InboxRecord) -> Outcome:
        """A closed record: ship a bounded part of what its file holds beyond what the
        control plane acknowledged, without a lease (the control plane accepts an
        Attempt's output from its Worker after the lease ended). Best effort: a transient
        failure waits for the next tick; a refusal for good gives the rest up; once all
        is held, the record is marked shipped and not looked at again."""
        if record.output_shipped or record.output_given_up is not None:
            return Outcome.DONE
        path = self._log_path(record)
        if path is None or record.attempt_id is None or record.lease_version is None:
            # Never claimed (or no files kept): there is no Attempt output to ship.
            self._save(record, output_shipped=True)
            return Outcome.DONE
        shipped = Shipped(record, pending=self.output_pending(record))
        if shipped.pending:
            shipped = self._settle_refusal(
                await ship_output(
                    self._client,
                    record,
                    path,
                    fence_of,
                    self._save_output_offset,
                )
            )
        record = shipped.record
        if shipped.refused is not None:
            return Outcome.DONE
        if shipped.pending or self._may_still_write(record):
            return Outcome.SHIPPING
        self._save(record, output_shipped=True)
        log.info(
            "offer %s: all output shipped (%d bytes) after the record closed",
            record.offer_id,
            record.output_offset,
        )
        return Outcome.DONE

    def _settle_refusal(self, shipped: Shipped) -> Shipped:
        """Persist a refusal no retry changes, so the rest is not sent again."""
        if shipped.refused is None:
            return shipped
        record = self._save(shipped.record, output_given_up=shipped.refused[:256])
        return dataclasses.replace(shipped, record=record)

    def _may_still_write(self, record: InboxRecord) -> bool:
        """A closed record's executor may still be writing to its file: no exit status
        was persisted (its stop could not be confirmed) and it is still seen running."""
        if record.exit_code is not None or record.exit_signal is not None:
            return False
        identity = identity_of(record)
        return identity is not None and self._processes.poll(identity) is None

    async def _complete(self, record: InboxRecord, *, refenced: bool = False) -> Outcome | None:
        """Report the ending. Refused at a stale lease version, it is sent once more after
        lease control at the stored version: a renewal control committed but whose answer
        was never kept (the Worker killed before saving it, a call cancelled at shutdown,
        retries given up) left control one version ahead, and that renewal's replay
        (R-LC-8) hands the version over without a second renewal. Anything else it
        answers is final as usual."""
        outcome = record.completion_outcome or "failed"
        request = ws.CompleteAttemptRequest(
            fence=self._fence(record),
            callback_sequence=record.callback_sequence or FIRST_CALLBACK_SEQUENCE,
            outcome=_OUTCOMES[outcome],
            summary=exit_summary(record),
        )
        if record.exit_code is not None:
            request.exit_code = record.exit_code
        if record.stop_reason == LOCAL_SHUTDOWN:
            request.stop_reason = lifecycle_pb2.CANCEL_REASON_SHUTDOWN
        log_path = self._log_path(record)
        if log_path is not None:
            # Readers wait for this much (some may be shipped after this report); output
            # whose shipping was given up will never come, so only what was shipped counts.
            given_up = record.output_given_up is not None
            request.output_bytes = record.output_offset if given_up else output_size(log_path)
        try:
            done = await self._client.complete_attempt(
                request, budget_seconds=self._lease_budget(record)
            )
        except CallFailed as failure:
            if failure.transient:
                return self._ending_waits(record, failure, "completion not delivered")
            if (
                failure.reason == ErrorReason.ERROR_REASON_STATE_CONFLICT
                and record.stop_reason == LOCAL_SHUTDOWN
            ):
                # The Run may have got its own stop intent since (user, timeout): then
                # the stop is reported the normal way, under the control plane's reason.
                return await self._learn_stop_intent(record, failure)
            if failure.reason in _COMPLETION_CONFLICTS:
                self._quarantine(record, QuarantineReason.CONTROL_PLANE_TERMINAL, failure.label)
                return Outcome.TERMINAL
            if failure.reason == ErrorReason.ERROR_REASON_LEASE_VERSION_FENCED and not refenced:
                return await self._complete_refenced(record, failure)
            self._quarantine(
                record, QuarantineReason.LEASE_LOST_LOCAL_EXECUTION_STOPPED, failure.label
            )
            return Outcome.LEASE_LOST
        self._save(
            record,
            state=RecordState.COMPLETION_ACKNOWLEDGED,
            lease_version=done.completed_lease_version,
            detail=done.error_code or None,
            # The executor has exited: when all it wrote is shipped, the record is settled
            # here rather than by a later pass of the closed-record shipping.
            output_shipped=not self.output_pending(record),
        )
        log.info(
            "offer %s run %s: completed %s (%s)",
            record.offer_id,
            record.run_id,
            outcome,
            lifecycle_pb2.RunState.Name(done.run_state),
        )
        return Outcome.COMPLETED

    async def _complete_refenced(self, record: InboxRecord, refusal: CallFailed) -> Outcome | None:
        """The ending was refused at the stored lease version: learn the present one from
        lease control (the replay of a renewal whose answer was lost), then report again."""
        log.info(
            "offer %s: ending refused at lease version %s (%s); asking lease control",
            record.offer_id,
            record.lease_version,
            refusal.label,
        )
        # A last word: after a reboot (the version's answer lost with the power) the
        # local lease counts as over, and without one try this ending would be lost.
        kept = await self._keep_lease(record, last_word=True)
        if isinstance(kept, Outcome):
            return kept  # fenced for good (lease lost) or terminal: settled there
        if kept.lease_version == record.lease_version:
            return self._ending_waits(record, refusal, "completion refused")  # no answer
        return await self._complete(kept, refenced=True)

    def _ending_waits(self, record: InboxRecord, failure: CallFailed, what: str) -> Outcome:
        """An ending control did not answer waits for its answer, the next pass trying
        again — past the local lease too. The local estimate bounds how long an executor
        may run without control's word; this one has ended, so it protects nothing here,
        and control judges the report by its own clock (a lease it expired refuses it,
        and the record then closes as lease lost). Given up at the local lease instead,
        an unanswered try would turn the executor's own outcome into ``lost`` — and the
        Run would run again: after a reboot, which leaves no local estimate, at the
        first unanswered try while control still holds the lease.

        The record stays open meanwhile, so the Worker takes no new work (a durable
        recovery fact, :mod:`qinglong_worker.lifecycle`); past the local lease each try
        is logged as a warning and counted (``qinglong_worker_late_last_words_total``), so
        an operator sees why."""
        if self.lease_lost_locally(record):
            metrics.LATE_LAST_WORDS.inc()
            log.warning(
                "offer %s: %s (%s) past the local lease; the ending waits for control's"
                " answer, and no new work is taken meanwhile",
                record.offer_id,
                what,
                failure.label,
            )
        else:
            log.info("offer %s: %s (%s); will retry", record.offer_id, what, failure)
        return Outcome.WAITING

    async def _learn_stop_intent(self, record: InboxRecord, refusal: CallFailed) -> Outcome | None:
        """A shutdown stop was refused as a state conflict: ask lease control why."""
        sent = self._sent()
        try:
            # Asked after the ending, like it: one try even when the local lease is over.
            answer = await self._client.control_lease(
                ws.ControlLeaseRequest(fence=self._fence(record)),
                budget_seconds=self._lease_budget(record),
                last_word=True,
            )
        except CallFailed as failure:
            if failure.transient:
                return self._waiting(record, failure)
            self._quarantine(
                record, QuarantineReason.LEASE_LOST_LOCAL_EXECUTION_STOPPED, failure.label
            )
            return Outcome.LEASE_LOST
        result = answer.WhichOneof("result")
        if result == "stop_requested":
            stop = answer.stop_requested
            reason = _cancel_reason_name(stop.cancel_reason)
            status = ExitStatus(record.exit_code, record.exit_signal)
            self._save(
                record,
                lease_version=stop.lease_version,
                **_observation(sent, stop.lease_remaining.ToMilliseconds()),
                stop_reason=reason,
                completion_outcome=completion_outcome(reason, status),
            )
            log.info("offer %s: the Run has its own stop intent (%s)", record.offer_id, reason)
            return None  # the next pass completes under that reason
        if result == "renewed":
            # No intent, and the shutdown stop is not accepted: give the lease up; it
            # expires and the Attempt ends lost (the process is stopped).
            self._quarantine(
                record,
                QuarantineReason.LEASE_LOST_LOCAL_EXECUTION_STOPPED,
                f"shutdown stop not accepted ({refusal.label})",
                lease_version=answer.renewed.lease_version,
            )
            return Outcome.LEASE_LOST
        self._quarantine(record, QuarantineReason.CONTROL_PLANE_TERMINAL, refusal.label)
        return Outcome.TERMINAL

    async def _refused(self, record: InboxRecord, failure: CallFailed) -> Outcome:
        """A lease-holding call with a running process failed: only a fence stops it."""
        if failure.transient:
            return await self._after_transient(record, failure)
        if failure.fenced:
            return await self._lease_lost(record, failure.label)
        log.warning(
            "offer %s: %s refused without a fence (%s); the process is kept until the"
            " lease runs out locally",
            record.offer_id,
            failure.method,
            failure.label,
        )
        return Outcome.REFUSED

    async def _after_transient(self, record: InboxRecord, failure: CallFailed) -> Outcome:
        """Retries ended without an answer: past the local lease, R-W-2 step 3 applies."""
        if self.lease_lost_locally(record):
            return await self._lease_lost(record, f"{failure.label}; local lease expired")
        return self._waiting(record, failure)

    async def _lease_lost(self, record: InboxRecord, detail: str) -> Outcome:
        """Stop the local process by its durable identity and quarantine the record."""
        if record.has_executor:
            stopped, status = await self._stop_exact(record)
            unverified = stopped is StopResult.UNVERIFIED
        else:
            # Nothing was spawned, unless a spawn's outcome was lost in a crash.
            stopped, status = None, None
            unverified = record.state is RecordState.LAUNCHING and record.start_failure is None
        reason = (
            QuarantineReason.LEASE_LOST_LOCAL_EXECUTION_UNVERIFIED
            if unverified
            else QuarantineReason.LEASE_LOST_LOCAL_EXECUTION_STOPPED
        )
        suffix = "" if stopped is None else f"; local process {stopped}"
        self._quarantine(record, reason, detail + suffix, status=status)
        return Outcome.LEASE_LOST

    async def _stop_exact(self, record: InboxRecord) -> tuple[StopResult, ExitStatus | None]:
        """Stop an executor that holds no lease any more (lost, or its Run ended): its
        TERM grace is at most :data:`LEASE_GONE_STOP_GRACE_SECONDS`, whatever
        ``--stop-grace-seconds`` says, so it is gone before the control plane may start the
        Run again elsewhere (control's ``--worker-stop-ms`` counts on that)."""
        identity = identity_of(record)
        if identity is None:
            return StopResult.ALREADY_EXITED, None
        grace = min(self._grace, LEASE_GONE_STOP_GRACE_SECONDS)
        stopped = await self._processes.stop(identity, grace_seconds=grace)
        status = self._processes.poll(identity)
        return stopped, status

    async def _sweep(self, record: InboxRecord) -> None:
        """Stop one running executor at shutdown; no control-plane call."""
        if record.state is RecordState.RUNNING_ACKNOWLEDGED:
            outcome = await self._stop_for_shutdown(record)
        else:
            outcome = await self._lease_lost(record, _SHUTDOWN_BEFORE_RUNNING)
        if outcome is Outcome.STOP_PENDING:
            log.error("offer %s: the executor could not be confirmed stopped", record.offer_id)

    # --- persistence ----------------------------------------------------------------------

    def _persist_exit(self, record: InboxRecord, status: ExitStatus) -> InboxRecord:
        lost = _lost_execution(record, status)
        if lost is not None:
            # Not the executor's own ending, and no stop anyone asked for: nothing is
            # reported. The record closes as lease lost; control expires the lease, and
            # the Attempt ends `lost` (retried if the policy allows, R-RETRY-2).
            return self._quarantine(
                record, QuarantineReason.LEASE_LOST_LOCAL_EXECUTION_STOPPED, lost, status=status
            )
        outcome = completion_outcome(record.stop_reason, status)
        written = self._save(
            record,
            state=RecordState.EXITED,
            exit_code=status.exit_code,
            exit_signal=status.signal,
            completion_outcome=outcome,
        )
        identity = identity_of(record)
        if identity is not None:
            self._processes.release(identity)
        log.info("offer %s run %s: exited (%s)", record.offer_id, record.run_id, outcome)
        return written

    def _quarantine(
        self,
        record: InboxRecord,
        reason: QuarantineReason,
        detail: str,
        *,
        status: ExitStatus | None = None,
        **changes: Any,
    ) -> InboxRecord:
        exit_fields: dict[str, Any] = {}
        if status is not None and status is not UNOBSERVED_EXIT:
            exit_fields = {"exit_code": status.exit_code, "exit_signal": status.signal}
        written = self._save(
            record,
            state=RecordState.QUARANTINED,
            quarantine_reason=reason,
            detail=detail[:256],
            **exit_fields,
            **changes,
        )
        identity = identity_of(record)
        if identity is not None and status is not None:
            self._processes.release(identity)
        log.warning(
            "offer %s run %s: quarantined %s (%s)", record.offer_id, record.run_id, reason, detail
        )
        return written

    def _fence(self, record: InboxRecord) -> fence_pb2.Fence:
        """The fence of a call that may advance or end the lease, after the inbox made
        every change durable (its docstring: control is then never more than one lease
        version ahead of what survives a power loss, as after a lost answer). AppendOutput
        compares no lease version and goes without."""
        self._inbox.sync()
        return fence_of(record)

    def _save_output_offset(self, record: InboxRecord, offset: int) -> InboxRecord:
        """What control acknowledged of the output; a lost one is shipped again."""
        return self._save(record, durable=False, output_offset=offset)

    def _save(self, record: InboxRecord, *, durable: bool = True, **changes: Any) -> InboxRecord:
        """Persist ``changes``; ``durable`` False only for what a reboot makes moot (the
        inbox's docstring): a running executor's renewal, the output offset."""
        updated = dataclasses.replace(record, updated_unix_ms=self._wall_clock(), **changes)
        written = self._inbox.compare_and_set(record, updated, durable=durable)
        local_lease.follow(self._processes, record, written)
        if written.state is not record.state and record.state in _CLAIMED_LAUNCH:
            # The identity (or the start failure) is durable in the inbox now.
            forget_launch(self._processes, _launch_key(record))
        if written.state is not record.state:
            log.info(
                "offer %s run %s: %s -> %s",
                record.offer_id,
                record.run_id,
                record.state,
                written.state,
            )
        return written

    def _sent(self) -> _Sent:
        return _Sent(self._now(), self._wall_clock())

    def _lease_budget(self, record: InboxRecord) -> float:
        """Seconds the local lease estimate has left: no retry of a lease-holding
        command goes beyond it (then R-W-2 step 3 applies)."""
        left = record.lease_left_ms(self._now())
        return 0.0 if left is None else left / 1000

    def _log_path(self, record: InboxRecord) -> Path | None:
        return None if self._log_dir is None else log_file(self._log_dir, record.offer_id)

    def _waiting(self, record: InboxRecord, failure: CallFailed) -> Outcome:
        log.info("offer %s: %s; will retry", record.offer_id, failure)
        return Outcome.WAITING


def _retrieved(task: asyncio.Future[Any]) -> None:
    """Mark a shielded step's failure as seen when nobody awaits it any more (its caller
    was cancelled); a failure that matters (an unreadable inbox) shows at the next tick."""
    if not task.cancelled():
        task.exception()


def parameter_environment(parameters: Iterable[tuple[str, str]]) -> dict[str, str]:
    """A Run's parameters as its executor receives them: ``QINGLONG_PARAM_<name>``, the
    value unchanged. The contract keeps names to ``[A-Z][A-Z0-9_]*`` and values to
    1024 bytes without control characters; a name outside the pattern or a value with
    NUL or over the bound (a control plane's fault, or a row changed by hand) refuses the
    start, reported as a start failure — a name with ``=`` or a value with NUL would
    otherwise fail the spawn in a way nothing reports."""
    prefix = bounds.RUN_PARAMETER_ENVIRONMENT_PREFIX
    environment: dict[str, str] = {}
    for name, value in parameters:
        if bounds.RUN_PARAMETER_NAME_PATTERN.match(name) is None:
            raise ExecutorRefused("a Run parameter's name breaks the contract")
        if "\x00" in value or bounds.utf8_length(value) > bounds.RUN_PARAMETER_VALUE_MAX_BYTES:
            raise ExecutorRefused(f"Run parameter {name}'s value breaks the contract")
        environment[prefix + name] = value
    return environment


def _launch_key(record: InboxRecord) -> str:
    return launch_key(record.offer_id, record.attempt_id or "")


def _spawn_failure_summary(error: Exception) -> str:
    """Low-sensitivity: the kind of failure, never paths, argv or environment values."""
    if isinstance(error, ExecutorRefused):
        return f"executor refused to start: {error}"[: bounds.ERROR_SUMMARY_MAX_CHARS]
    if isinstance(error, FileNotFoundError):
        return "executable not found"
    if isinstance(error, PermissionError):
        return "permission denied starting the executable"
    return f"could not start the executable ({type(error).__name__})"


__all__ = [
    "FIRST_CALLBACK_SEQUENCE",
    "LOCAL_SHUTDOWN",
    "Mode",
    "Outcome",
    "Reconciler",
    "activation_problem",
    "callback_digest",
    "completion_outcome",
    "fence_of",
    "identity_of",
    "lease_control_due",
    "new_capability",
    "wall_clock_ms",
]
