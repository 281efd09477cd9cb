"""Failover evidence (SPEC §7 item 14, R-HA-2): a Worker command whose COMMIT the driver
confirmed survives the promotion of the synchronous standby, and its replay answers as a
replay.

`qinglong up --standby` gives both services multi-host URLs (primary, standby;
``target_session_attrs=read-write``). The test, acting as the Worker over mTLS through
ingress: claims a Run, sends AcknowledgeStarting and gets STARTING (control committed,
and with ``synchronous_commit=on`` the standby has flushed it). It then records the Run's
version, event sequence, Event ids and dedupe keys and the lease version; terminates the
control backends that served it; fences the old primary (fast stop) and `pg_ctl promote`s
the standby. The old primary is stopped before the promotion, not after, so no service
can reconnect to a second writable server in between (the order CloudNativePG keeps too).

The same AcknowledgeStarting is then sent again: while no primary is reachable it may be
answered UNAVAILABLE only; once the pools reach the new primary it answers
ALREADY_STARTING and everything recorded is unchanged. A ReportStartFailure and its
replay, and a real Worker's Run, then prove the stack works on the new primary without any
service restarting.

It runs on every PostgreSQL version the embedded binaries ship (16 and 18): the standby
setup (``pg_basebackup -R``, the replication slot, ``synchronous_standby_names``) and the
promotion must hold on each.
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import grpc
import psycopg
import pytest
from qinglong.rpc.v1 import execution_pb2, fence_pb2, lifecycle_pb2
from qinglong.worker.v1 import worker_pb2, worker_service_pb2_grpc
from qinglong.worker.v1 import worker_service_pb2 as ws
from qinglong_control.settings import ENV_RECONCILE_INTERVAL_SECONDS
from qinglong_protocol.bounds import encode_lease_capability
from qinglong_protocol.tls import mutual_tls_channel_credentials

from tests.support.devstack_process import DevStack, dev_stack
from tests.support.executor_marks import Marks, kill_leftovers, marked_command
from tests.support.failover_probe import (
    CALL_SECONDS,
    on_promoted_standby,
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
from tests.support.postgres_control import PostgresControl
from tests.support.worker_process import WorkerProcess

TERMINAL_SECONDS: Final = 60.0


@pytest.fixture
def stack(scratch: Path, postgres_version: int) -> Iterator[DevStack]:
    with dev_stack(
        scratch / "stack",
        environment={ENV_RECONCILE_INTERVAL_SECONDS: "1"},
        arguments=("--standby", "--postgres-version", str(postgres_version)),
    ) as up:
        yield up


def test_confirmed_command_survives_promotion_and_replays(
    stack: DevStack,
    scratch: Path,
    report_tally: Callable[[Tally], None],
    postgres_version: int,
) -> None:
    assert stack.document["postgres"]["standby"], "up --standby published no standby"
    running_on = server_major_version(stack.migration_url)
    assert running_on == postgres_version, f"the stack runs PostgreSQL {running_on}"
    primary = stack.postgres
    standby = PostgresControl.attach(stack.standby_dir)
    operator = OperatorClient(stack)
    problems: list[str] = []
    refusals: list[grpc.StatusCode] = []
    calls = 0
    marks = scratch / "executor-marks"
    worker: WorkerProcess | None = None
    terminated: list[Any] = []
    recovered = float("nan")
    run_id = after_run = ""
    try:
        run_id = operator.trigger(["true"], name="failover")
        channel = grpc.secure_channel(
            stack.ingress_address, mutual_tls_channel_credentials(stack.worker_tls)
        )
        stub = worker_service_pb2_grpc.WorkerServiceStub(channel)
        session = stub.OpenSession(
            ws.OpenSessionRequest(
                request_id=uuid.uuid4().hex,
                worker_id=stack.worker_id,
                executor_types=[execution_pb2.EXECUTOR_TYPE_REMOTE_WORKER],
                max_concurrent_attempts=1,
            ),
            timeout=CALL_SECONDS,
        )
        pulled = stub.PullOffers(
            ws.PullOffersRequest(
                worker_id=stack.worker_id,
                session_id=session.session_id,
                worker_generation=session.worker_generation,
                max_offers=1,
            ),
            timeout=CALL_SECONDS,
        )
        [offer] = pulled.offers
        capability = encode_lease_capability(secrets.token_bytes(32))
        claimed = stub.ClaimOffer(
            ws.ClaimOfferRequest(
                worker_id=stack.worker_id,
                session_id=session.session_id,
                worker_generation=session.worker_generation,
                offer_id=offer.offer_id,
                project_id=stack.project_id,
                run_id=run_id,
                lease_token=capability,
            ),
            timeout=CALL_SECONDS,
        )
        fence = fence_pb2.Fence(
            worker_id=stack.worker_id,
            session_id=session.session_id,
            worker_generation=session.worker_generation,
            project_id=stack.project_id,
            run_id=run_id,
            attempt_id=claimed.attempt_id,
            offer_id=offer.offer_id,
            lease_generation=claimed.lease_generation,
            lease_token=capability,
            expected_lease_version=claimed.lease_version,
        )
        starting_request = ws.AcknowledgeStartingRequest(fence=fence)
        first = stub.AcknowledgeStarting(starting_request, timeout=CALL_SECONDS)
        calls += 5
        assert first.outcome == worker_pb2.STARTING_OUTCOME_STARTING
        confirmed = snapshot(stack.migration_url, run_id)

        # The backends that served it die; the old primary is fenced; the standby promoted.
        with psycopg.connect(primary.url("postgres", "postgres"), autocommit=True) as admin:
            terminated = admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = 'qinglong-control'"
            ).fetchall()
        primary.stop()
        promoted_at = time.monotonic()
        standby.promote()

        replay = until_answered(
            lambda: stub.AcknowledgeStarting(starting_request, timeout=CALL_SECONDS), refusals
        )
        recovered = time.monotonic() - promoted_at
        calls += 1 + len(refusals)
        if replay.outcome != worker_pb2.STARTING_OUTCOME_ALREADY_STARTING:
            problems.append(f"the replay answered {replay.outcome}, not ALREADY_STARTING")
        after = snapshot(stack.migration_url, run_id)
        if after != confirmed:
            problems.append(f"the Run changed across the failover:\n{confirmed}\n{after}")
        problems += on_promoted_standby(stack)

        # The next command and its replay on the new primary.
        failure = ws.ReportStartFailureRequest(fence=fence, error_summary="failover probe")
        ended = until_answered(
            lambda: stub.ReportStartFailure(failure, timeout=CALL_SECONDS), refusals
        )
        ended_state = snapshot(stack.migration_url, run_id)
        again = stub.ReportStartFailure(failure, timeout=CALL_SECONDS)
        calls += 2
        if (again.run_state, again.error_code) != (ended.run_state, ended.error_code):
            problems.append(f"ReportStartFailure replay answered {again}, first {ended}")
        if ended.run_state != lifecycle_pb2.RUN_STATE_FAILED:
            problems.append(f"ReportStartFailure ended the Run {ended.run_state}")
        if snapshot(stack.migration_url, run_id) != ended_state:
            problems.append("the ReportStartFailure replay changed the Run")
        channel.close()

        # A real Worker on the new primary, through the same services (none restarted).
        worker = WorkerProcess(
            stack, scratch / "worker" / "inbox.db", address=stack.ingress_address
        )
        worker.start()
        after_run = operator.trigger(marked_command(marks, seconds=0.5, exit_code=0), name="after")
        if not wait_until_terminal(stack.migration_url, [after_run], TERMINAL_SECONDS):
            problems.append("a Run after the failover did not end")
        restarts = [e["restarts"] for kind in ("control", "ingress") for e in stack.replicas(kind)]
        if any(restarts):
            problems.append(f"a service had to be restarted to fail over: {restarts}")
    finally:
        if worker is not None and worker.alive():
            worker.stop()
        operator.close()
        kill_leftovers(marks)

    unexpected = [code for code in refusals if code is not grpc.StatusCode.UNAVAILABLE]
    if unexpected:
        problems.append(f"during the failover callers saw {unexpected}, not only UNAVAILABLE")
    tally = compute_tally(
        f"PostgreSQL {postgres_version}: promote the synchronous standby after a confirmed COMMIT",
        stack.migration_url,
        [
            Expected(run_id, "failed", error_code="EXECUTOR_START_FAILED", label="failover"),
            Expected(after_run, "succeeded", exit_code=0, label="after failover"),
        ],
        executions=Marks.read(marks).counts(),
        extra_calls=calls,
        extra_faults=2,  # the backend kill and the promotion
    )
    tally.notes.append(f"{len(terminated)} control backends terminated, 1 promotion")
    tally.notes.append(
        f"replay answered {recovered:.1f} s after the promotion; refusals meanwhile: "
        f"{[code.name for code in refusals]}"
    )
    report_tally(tally)
    if problems and worker is not None:
        problems.append("worker log tail:\n" + worker.log_tail())
    assert_verdict(tally, problems)
