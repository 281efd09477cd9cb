"""What the failover tests share: the test acting as a Worker over mTLS through ingress,
a snapshot of everything a replay must leave unchanged, the promotion itself, and a
caller that repeats one request until the new primary answers it.

The promotion follows CloudNativePG's order: the control backends are terminated, the old
primary is fenced (fast stop) and only then is the synchronous standby promoted, so no
service can ever reach two writable servers.
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import grpc
import psycopg
from qinglong.rpc.v1 import execution_pb2, fence_pb2
from qinglong.worker.v1 import worker_service_pb2 as ws
from qinglong.worker.v1 import worker_service_pb2_grpc
from qinglong_protocol.bounds import encode_lease_capability
from qinglong_protocol.tls import mutual_tls_channel_credentials

from tests.support.devstack_process import DevStack
from tests.support.postgres_control import PostgresControl

CALL_SECONDS: Final = 10.0
FAILOVER_SECONDS: Final = 30.0

_T = TypeVar("_T")


def snapshot(migration_url: str, run_id: str) -> dict[str, Any]:
    """The Run's state, version and event sequence, its Events (ids, sequences, types,
    dedupe keys) and its leases (versions, statuses): what a replay must leave as is."""
    with psycopg.connect(migration_url, connect_timeout=5) as conn:
        run = conn.execute(
            "SELECT state, version, event_sequence FROM qinglong.runs WHERE run_id = %s",
            (run_id,),
        ).fetchone()
        events = conn.execute(
            "SELECT event_id::text, sequence, event_type, dedupe_key FROM qinglong.run_events"
            " WHERE run_id = %s ORDER BY sequence",
            (run_id,),
        ).fetchall()
        leases = conn.execute(
            "SELECT attempt_id::text, version, status FROM qinglong.run_leases"
            " WHERE run_id = %s ORDER BY attempt_id",
            (run_id,),
        ).fetchall()
    return {"run": run, "events": events, "leases": leases}


def until_answered(call: Callable[[], _T], refusals: list[grpc.StatusCode]) -> _T:
    """Send the same request until it is answered; every refusal meanwhile is recorded
    (the tests then require that each was UNAVAILABLE, R-HA-2)."""
    deadline = time.monotonic() + FAILOVER_SECONDS
    while True:
        try:
            return call()
        except grpc.RpcError as error:
            refusals.append(error.code())
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@dataclass(frozen=True)
class Promotion:
    terminated: int
    promoted_at: float


def promote_standby(stack: DevStack) -> Promotion:
    """Terminate the control backends, fence the old primary, promote the standby."""
    primary = stack.postgres
    standby = PostgresControl.attach(stack.standby_dir)
    with psycopg.connect(primary.url("postgres", "postgres"), autocommit=True) as admin:
        terminated = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name = 'qinglong-control'"
        ).fetchall()
    primary.stop()
    promoted_at = time.monotonic()
    standby.promote()
    return Promotion(len(terminated), promoted_at)


def server_major_version(url: str) -> int:
    """The major version of the server `url` leads to: what a test really ran on."""
    with psycopg.connect(url, connect_timeout=5) as conn:
        return conn.info.server_version // 10000


def on_promoted_standby(stack: DevStack) -> list[str]:
    """Problems if the stack's multi-host URL does not lead to the promoted standby, of
    the version the stack was started with."""
    problems = []
    with psycopg.connect(stack.migration_url, connect_timeout=5) as conn:
        if conn.execute("SELECT pg_is_in_recovery()").fetchone() != (False,):
            problems.append("the services' URL did not lead to the promoted standby")
        if conn.info.host != str(stack.standby_dir):
            problems.append(f"connected to {conn.info.host}, not the promoted standby")
        wanted = stack.document["postgres"]["version"]
        if conn.info.server_version // 10000 != wanted:
            problems.append(f"the promoted standby runs {conn.info.server_version}, not {wanted}")
    return problems


class RawWorker:
    """The test as a Worker: one session through ingress, each Run claimed by hand."""

    def __init__(self, stack: DevStack, *, max_concurrent_attempts: int = 8) -> None:
        self.stack = stack
        self.channel = grpc.secure_channel(
            stack.ingress_address, mutual_tls_channel_credentials(stack.worker_tls)
        )
        self.stub = worker_service_pb2_grpc.WorkerServiceStub(self.channel)
        self.session = self.stub.OpenSession(
            ws.OpenSessionRequest(
                request_id=uuid.uuid4().hex,
                worker_id=stack.worker_id,
                executor_types=[execution_pb2.EXECUTOR_TYPE_REMOTE_WORKER],
                max_concurrent_attempts=max_concurrent_attempts,
            ),
            timeout=CALL_SECONDS,
        )
        self.calls = 1

    def close(self) -> None:
        self.channel.close()

    def claim(self, run_id: str) -> fence_pb2.Fence:
        """Pull the offer of `run_id` (the only queued Run) and claim it; the fence."""
        pulled = self.stub.PullOffers(
            ws.PullOffersRequest(
                worker_id=self.stack.worker_id,
                session_id=self.session.session_id,
                worker_generation=self.session.worker_generation,
                max_offers=1,
            ),
            timeout=CALL_SECONDS,
        )
        [offer] = pulled.offers
        capability = encode_lease_capability(secrets.token_bytes(32))
        claimed = self.stub.ClaimOffer(
            ws.ClaimOfferRequest(
                worker_id=self.stack.worker_id,
                session_id=self.session.session_id,
                worker_generation=self.session.worker_generation,
                offer_id=offer.offer_id,
                project_id=self.stack.project_id,
                run_id=run_id,
                lease_token=capability,
            ),
            timeout=CALL_SECONDS,
        )
        self.calls += 2
        return fence_pb2.Fence(
            worker_id=self.stack.worker_id,
            session_id=self.session.session_id,
            worker_generation=self.session.worker_generation,
            project_id=self.stack.project_id,
            run_id=run_id,
            attempt_id=claimed.attempt_id,
            offer_id=offer.offer_id,
            lease_generation=claimed.lease_generation,
            lease_token=capability,
            expected_lease_version=claimed.lease_version,
        )

    def start_running(
        self, fence: fence_pb2.Fence
    ) -> tuple[ws.AcknowledgeRunningRequest, ws.AcknowledgeRunningResponse]:
        """AcknowledgeStarting then AcknowledgeRunning; the running request and answer."""
        self.stub.AcknowledgeStarting(
            ws.AcknowledgeStartingRequest(fence=fence), timeout=CALL_SECONDS
        )
        request = ws.AcknowledgeRunningRequest(
            fence=fence,
            executor_handle=f"pid:{secrets.randbelow(1 << 20)}",
            callback_sequence=1,
            callback_token_digest=secrets.token_hex(32),
        )
        answer = self.stub.AcknowledgeRunning(request, timeout=CALL_SECONDS)
        self.calls += 2
        return request, answer

    @staticmethod
    def with_version(fence: fence_pb2.Fence, version: int) -> fence_pb2.Fence:
        renewed = fence_pb2.Fence()
        renewed.CopyFrom(fence)
        renewed.expected_lease_version = version
        return renewed
