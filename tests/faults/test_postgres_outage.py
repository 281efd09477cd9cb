"""PostgreSQL stop/start under load (issue 7, SPEC R-ERR-2, R-ING-3).

While two Runs execute, the stack's PostgreSQL is stopped for several seconds. Calls to
ingress during the outage -- an operator's GetRun and a Worker's RenewSession -- must be
answered UNAVAILABLE within the bound (R-ERR-2: 2 s by default), not held until the
caller's deadline. The services and the Worker must survive; once PostgreSQL is back,
the Runs in flight end with their executors' real outcomes and new work runs again.

Then the same with a database that is up but takes no writes (what a managed service
does on a full disk): UNAVAILABLE, never INTERNAL, and nothing lost.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Final

import grpc
import psycopg
from qinglong.worker.v1 import worker_service_pb2 as ws
from qinglong.worker.v1 import worker_service_pb2_grpc
from qinglong_protocol.errors import error_reason_of
from qinglong_protocol.storage import StorageBounds
from qinglong_protocol.tls import mutual_tls_channel_credentials

from tests.support.devstack_process import DevStack
from tests.support.fault_rig import FaultRig
from tests.support.fault_tally import Expected, Tally, assert_verdict
from tests.support.operator_client import OperatorClient
from tests.support.polling import wait_until
from tests.support.worker_process import WorkerProcess

#: SPEC R-ERR-2: the bound for answering UNAVAILABLE when PostgreSQL is down (the stack
#: runs with the default).
UNAVAILABLE_BOUND_SECONDS: Final = StorageBounds().timeout_seconds
#: The probes' own deadline: far beyond the bound, so a held call shows as held.
PROBE_DEADLINE_SECONDS: Final = 10.0
OUTAGE_SECONDS: Final = 6.0
PROBE_AT_SECONDS: Final = (0.5, 2.5, 4.5)
RUNNING_SECONDS: Final = 30.0
RECOVERY_SECONDS: Final = 30.0
CONVERGE_SECONDS: Final = 45.0


@dataclass(frozen=True)
class Probe:
    name: str
    at: float
    """Seconds after PostgreSQL stopped."""
    code: grpc.StatusCode
    seconds: float

    def __str__(self) -> str:
        return f"{self.name} at +{self.at:.1f} s: {self.code.name} in {self.seconds:.3f} s"


def _measure(name: str, call: Callable[[], object], outage_began: float) -> Probe:
    began = time.monotonic()
    try:
        call()
        code = grpc.StatusCode.OK
    except grpc.RpcError as error:
        code = error.code()
    return Probe(name, began - outage_began, code, time.monotonic() - began)


def _current_session(stack: DevStack) -> tuple[str, int]:
    with psycopg.connect(stack.migration_url, connect_timeout=5) as conn:
        row = conn.execute(
            "SELECT session_id::text, generation FROM qinglong.worker_sessions"
            " WHERE worker_id = %s ORDER BY generation DESC LIMIT 1",
            (stack.worker_id,),
        ).fetchone()
    assert row is not None, "the Worker has no session"
    return str(row[0]), int(row[1])


def _two_runs_in_flight(
    stack: DevStack, rig: FaultRig, label: str, *, seconds: float
) -> tuple[WorkerProcess, Expected, ws.RenewSessionRequest]:
    """A Worker running two Runs of ``seconds`` (one to exit 0, one 3); the Worker, the
    one that succeeds, and a RenewSession of its current session to probe with."""
    worker = rig.worker(max_concurrency=2).start()
    succeeds = rig.trigger(f"{label}-ok", seconds=seconds, exit_code=0)
    rig.trigger(f"{label}-fails", seconds=seconds, exit_code=3)
    running = wait_until(lambda: len(rig.live_executors()) == 2, RUNNING_SECONDS)
    assert running, "two executors never ran:\n" + worker.log_tail()
    session_id, generation = _current_session(stack)
    renew = ws.RenewSessionRequest(
        worker_id=stack.worker_id, session_id=session_id, worker_generation=generation
    )
    return worker, succeeds, renew


def _settled(rig: FaultRig, worker: WorkerProcess) -> list[str]:
    """What went wrong at the end: a Run not terminal in time, a Worker that did not stop
    cleanly on SIGINT."""
    problems = []
    if not rig.wait_terminal(CONVERGE_SECONDS):
        problems.append(f"not every Run was terminal after {CONVERGE_SECONDS:.0f} s")
    status = worker.stop()
    if status != 0:
        problems.append(f"the Worker exited {status} on SIGINT, not 0")
    return problems


def test_postgres_stop_start_fails_fast_and_loses_nothing(
    stack: DevStack,
    operator: OperatorClient,
    rig: FaultRig,
    report_tally: Callable[[Tally], None],
) -> None:
    worker, succeeds, renew = _two_runs_in_flight(stack, rig, "in-flight", seconds=10)
    problems: list[str] = []
    with grpc.secure_channel(
        stack.ingress_address, mutual_tls_channel_credentials(stack.worker_tls)
    ) as worker_channel:
        sessions = worker_service_pb2_grpc.WorkerServiceStub(worker_channel)

        def get_run() -> object:
            return operator.get_run(succeeds.run_id, timeout=PROBE_DEADLINE_SECONDS)

        def renew_session() -> object:
            return sessions.RenewSession(renew, timeout=PROBE_DEADLINE_SECONDS)

        # Warm both channels first: the probes measure ingress, not a TLS handshake.
        get_run()
        renew_session()

        # Probes run on their own threads at fixed offsets, so a held call cannot stretch
        # the outage: PostgreSQL comes back after OUTAGE_SECONDS whatever they do.
        with ThreadPoolExecutor(max_workers=2 * len(PROBE_AT_SECONDS)) as pool:
            stack.postgres.stop()
            outage_began = time.monotonic()
            pending: list[Future[Probe]] = []
            try:
                for at in PROBE_AT_SECONDS:
                    time.sleep(max(0.0, outage_began + at - time.monotonic()))
                    pending.append(pool.submit(_measure, "GetRun", get_run, outage_began))
                    pending.append(
                        pool.submit(_measure, "RenewSession", renew_session, outage_began)
                    )
                time.sleep(max(0.0, outage_began + OUTAGE_SECONDS - time.monotonic()))
            finally:
                stack.postgres.start()
            restarted = time.monotonic()
            probes = [future.result() for future in pending]

        def serving_again() -> bool:
            return _measure("GetRun", get_run, restarted).code is grpc.StatusCode.OK

        if not wait_until(serving_again, RECOVERY_SECONDS, interval=0.5):
            problems.append(f"ingress did not serve GetRun {RECOVERY_SECONDS:.0f} s after restart")
        recovered_after = time.monotonic() - restarted

    for probe in probes:
        if probe.code is not grpc.StatusCode.UNAVAILABLE:
            problems.append(f"{probe}: not UNAVAILABLE")
        elif probe.seconds > UNAVAILABLE_BOUND_SECONDS:
            problems.append(f"{probe}: slower than {UNAVAILABLE_BOUND_SECONDS} s (R-ERR-2)")
    if not stack.running():
        problems.append("qinglong up exited: a service did not survive the outage")
    if not worker.alive():
        problems.append("the Worker did not survive the outage")

    # New work after the outage runs too.
    rig.trigger("after-outage", seconds=0.5, exit_code=0)
    problems += _settled(rig, worker)

    tally = rig.tally("PostgreSQL stop/start", extra_faults=1)
    tally.calls += len(probes)
    tally.notes += [f"probe {probe}" for probe in probes]
    tally.notes.append(f"ingress served again {recovered_after:.1f} s after PostgreSQL restarted")
    report_tally(tally)
    if problems or not tally.clean:
        problems.append("worker log tail:\n" + worker.log_tail())
    assert_verdict(tally, problems)


#: How long the database stays read-only: longer than a Worker's tick and its call
#: retries, shorter than the 30 s lease (so the Runs in flight must keep their leases
#: across it and end with their executors' outcomes).
READ_ONLY_SECONDS: Final = 5.0


def _set_read_only(stack: DevStack, *, read_only: bool) -> None:
    """What a managed PostgreSQL does on a full disk: every session, new or open, takes
    no writes (``ALTER SYSTEM`` and a reload reach the open ones too). The superuser's own
    session stays writable, so the setting can be taken back."""
    superuser = stack.postgres.url("postgres", "postgres")
    with psycopg.connect(superuser, autocommit=True, connect_timeout=5) as conn:
        conn.execute("SET default_transaction_read_only = off")
        if read_only:
            conn.execute("ALTER SYSTEM SET default_transaction_read_only = on")
        else:
            conn.execute("ALTER SYSTEM RESET default_transaction_read_only")
        conn.execute("SELECT pg_reload_conf()")

    def applied() -> bool:
        with psycopg.connect(stack.migration_url, connect_timeout=5) as probe:
            row = probe.execute("SHOW default_transaction_read_only").fetchone()
        return row is not None and (row[0] == "on") is read_only

    assert wait_until(applied, 10.0), f"read_only={read_only} never took effect"


def test_a_read_only_database_is_unavailable_not_internal_and_loses_nothing(
    stack: DevStack,
    operator: OperatorClient,
    rig: FaultRig,
    report_tally: Callable[[Tally], None],
) -> None:
    """A database that is up but takes no writes (SQLSTATE 25006) is the deployment's
    state, not a fault of the call: callers get UNAVAILABLE with ingress's
    AUDIT_UNAVAILABLE (its audit row is every call's first write), and retry; the Runs in
    flight keep going and end with their executors' outcomes once it is writable again."""
    worker, succeeds, renew = _two_runs_in_flight(stack, rig, "read-only", seconds=8)
    problems: list[str] = []
    reasons: list[str] = []
    with grpc.secure_channel(
        stack.ingress_address, mutual_tls_channel_credentials(stack.worker_tls)
    ) as worker_channel:
        sessions = worker_service_pb2_grpc.WorkerServiceStub(worker_channel)
        calls: dict[str, Callable[[], object]] = {
            "GetRun": lambda: operator.get_run(succeeds.run_id, timeout=PROBE_DEADLINE_SECONDS),
            "RenewSession": lambda: sessions.RenewSession(renew, timeout=PROBE_DEADLINE_SECONDS),
        }
        for call in calls.values():
            call()  # warm both channels: the probes measure ingress, not a handshake

        _set_read_only(stack, read_only=True)
        began = time.monotonic()
        try:
            for name, call in calls.items():
                try:
                    call()
                    reasons.append(f"{name}: answered OK from a read-only database")
                except grpc.RpcError as error:
                    reasons.append(f"{name}: {error.code().name} {error_reason_of(error)}")
            time.sleep(max(0.0, began + READ_ONLY_SECONDS - time.monotonic()))
        finally:
            _set_read_only(stack, read_only=False)
        writable = time.monotonic()
        served = wait_until(
            lambda: _measure("GetRun", calls["GetRun"], writable).code is grpc.StatusCode.OK,
            RECOVERY_SECONDS,
            interval=0.5,
        )
        if not served:
            problems.append("ingress did not serve GetRun once the database was writable")

    for reason in reasons:
        if not reason.endswith("UNAVAILABLE AUDIT_UNAVAILABLE"):
            problems.append(f"{reason}: not UNAVAILABLE AUDIT_UNAVAILABLE")
    if not stack.running():
        problems.append("qinglong up exited: a service did not survive the read-only spell")
    problems += _settled(rig, worker)

    tally = rig.tally("PostgreSQL read-only", extra_faults=1)
    tally.calls += len(calls)
    tally.notes += reasons
    report_tally(tally)
    if problems or not tally.clean:
        problems.append("worker log tail:\n" + worker.log_tail())
    assert_verdict(tally, problems)
