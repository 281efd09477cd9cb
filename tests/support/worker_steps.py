"""A Worker's first steps through ingress on the in-process stack (tests/support/stack.py):
a queued Run, a session, a claimed Attempt, an Attempt taken to `running`."""

from __future__ import annotations

import secrets
import uuid
from typing import Any

from qinglong.rpc.v1 import execution_pb2, fence_pb2
from qinglong.worker.v1 import worker_service_pb2 as ws
from qinglong.worker.v1 import worker_service_pb2_grpc
from qinglong_protocol.bounds import encode_lease_capability

from tests.support.calls import queued_run as queued_run_through
from tests.support.stack import PROJECT, Stack, bearer


async def queued_run(stack: Stack, operator: str = "alice") -> str:
    async with stack.channel(stack.operator_identity(operator)) as channel:
        return await queued_run_through(channel, bearer(stack, operator), PROJECT)


def session_request(worker_id: str) -> ws.OpenSessionRequest:
    """A new session for ``worker_id`` (a fresh request id)."""
    return ws.OpenSessionRequest(
        request_id=uuid.uuid4().hex,
        worker_id=worker_id,
        executor_types=[execution_pb2.EXECUTOR_TYPE_REMOTE_WORKER],
        max_concurrent_attempts=2,
    )


async def open_session(worker: worker_service_pb2_grpc.WorkerServiceStub, worker_id: str) -> Any:
    return await worker.OpenSession(session_request(worker_id), timeout=10)


async def claimed_attempt(stack: Stack, worker: worker_service_pb2_grpc.WorkerServiceStub) -> Any:
    """A queued Run claimed by worker-a through ingress (OpenSession, PullOffers,
    ClaimOffer); returns the Attempt's fence."""
    run_id = await queued_run(stack)
    session = await open_session(worker, "worker-a")
    [offer] = (
        await worker.PullOffers(
            ws.PullOffersRequest(
                worker_id="worker-a",
                session_id=session.session_id,
                worker_generation=session.worker_generation,
                max_offers=1,
            )
        )
    ).offers
    capability = encode_lease_capability(secrets.token_bytes(32))
    claimed = await worker.ClaimOffer(
        ws.ClaimOfferRequest(
            worker_id="worker-a",
            session_id=session.session_id,
            worker_generation=session.worker_generation,
            offer_id=offer.offer_id,
            project_id=PROJECT,
            run_id=run_id,
            lease_token=capability,
        )
    )
    return fence_pb2.Fence(
        worker_id="worker-a",
        session_id=session.session_id,
        worker_generation=session.worker_generation,
        project_id=PROJECT,
        run_id=run_id,
        attempt_id=claimed.attempt_id,
        offer_id=offer.offer_id,
        lease_generation=claimed.lease_generation,
        lease_token=capability,
        expected_lease_version=claimed.lease_version,
    )


async def running_attempt(stack: Stack, worker: worker_service_pb2_grpc.WorkerServiceStub) -> Any:
    """A Run taken to `running` by worker-a through ingress; returns its fence."""
    fence = await claimed_attempt(stack, worker)
    await worker.AcknowledgeStarting(ws.AcknowledgeStartingRequest(fence=fence))
    await worker.AcknowledgeRunning(
        ws.AcknowledgeRunningRequest(
            fence=fence,
            executor_handle="pid:9;start:1",
            callback_sequence=1,
            callback_token_digest="cd" * 32,
        )
    )
    return fence
