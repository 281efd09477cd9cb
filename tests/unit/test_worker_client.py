"""The Worker client's retries (SPEC R-LC-8, R-W-5) against a real gRPC server over mTLS.

What is real: the channel, TLS, the server, its status codes and ErrorInfo trailers, a
TCP connection that breaks in the middle of a call, and the deadline each try carries
(the server reads it). What is scripted: only the retry's clock and dice (``sleep``,
``monotonic`` and ``unit_random``), so that backoff and budgets are exact and fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from qinglong.rpc.v1 import fence_pb2
from qinglong.rpc.v1.error_reason_pb2 import ErrorReason
from qinglong.worker.v1 import worker_pb2, worker_service_pb2_grpc
from qinglong.worker.v1 import worker_service_pb2 as ws
from qinglong_cli.pki import ensure_dev_pki, ensure_worker_identity
from qinglong_protocol.errors import REASON_CODES, status_for
from qinglong_protocol.tls import TlsFiles, mutual_tls_server_credentials
from qinglong_worker.client import (
    FENCE_REASONS,
    UNKNOWN_REASON,
    CallFailed,
    ClientSettings,
    RetryPolicy,
    WorkerClient,
    is_retryable,
    typed_reason,
)
from qinglong_worker.clock import boot_clock_seconds

Action = Callable[[grpc.aio.ServicerContext[object, object]], Awaitable[None]]


def _fence(expected: int) -> fence_pb2.Fence:
    return fence_pb2.Fence(
        worker_id="worker-a",
        session_id=str(uuid.uuid4()),
        worker_generation=1,
        project_id="default",
        run_id=str(uuid.uuid4()),
        attempt_id=str(uuid.uuid4()),
        offer_id=str(uuid.uuid4()),
        lease_generation=1,
        lease_token="not-a-real-capability",
        expected_lease_version=expected,
    )


def _renewed(version: int) -> ws.ControlLeaseResponse:
    remaining = Duration()
    remaining.FromMilliseconds(30_000)
    return ws.ControlLeaseResponse(
        renewed=worker_pb2.LeaseRenewed(lease_version=version, lease_remaining=remaining)
    )


class LeaseServer(worker_service_pb2_grpc.WorkerServiceServicer):
    """ControlLease as R-LC-8 specifies it: a renewal commits ``expected + 1``; a retry
    of the same request while the lease is at ``expected + 1`` gets the current
    projection without advancing again. ``failures`` are played first, one per call."""

    def __init__(self) -> None:
        self.version = 1
        self.failures: list[Action] = []
        self.requests: list[ws.ControlLeaseRequest] = []
        self.time_remaining: list[float | None] = []
        self.commit_then_stall = 0
        """Calls that commit and then answer too late (a lost answer)."""
        self.arrived = asyncio.Event()

    async def ControlLease(
        self,
        request: ws.ControlLeaseRequest,
        context: grpc.aio.ServicerContext[ws.ControlLeaseRequest, ws.ControlLeaseResponse],
    ) -> ws.ControlLeaseResponse:
        self.requests.append(request)
        self.time_remaining.append(context.time_remaining())
        self.arrived.set()
        if self.failures:
            await self.failures.pop(0)(context)  # type: ignore[arg-type]
        expected = request.fence.expected_lease_version
        if expected == self.version:
            self.version += 1  # the renewal commits
        elif expected + 1 != self.version:
            await context.abort_with_status(
                status_for(ErrorReason.ERROR_REASON_LEASE_VERSION_FENCED, "stale version")
            )
        if self.commit_then_stall:
            self.commit_then_stall -= 1
            await asyncio.sleep(30)  # the client's deadline passes first
        return _renewed(self.version)

    async def CompleteAttempt(
        self,
        request: ws.CompleteAttemptRequest,
        context: grpc.aio.ServicerContext[ws.CompleteAttemptRequest, ws.CompleteAttemptResponse],
    ) -> ws.CompleteAttemptResponse:
        """Only the deadline a completion arrives with, and the failures, are of interest."""
        self.time_remaining.append(context.time_remaining())
        if self.failures:
            await self.failures.pop(0)(context)  # type: ignore[arg-type]
        return ws.CompleteAttemptResponse()


def _abort(code: grpc.StatusCode) -> Action:
    async def action(context: grpc.aio.ServicerContext[object, object]) -> None:
        await context.abort(code, "injected")

    return action


def _refuse(reason: ErrorReason.ValueType) -> Action:
    async def action(context: grpc.aio.ServicerContext[object, object]) -> None:
        await context.abort_with_status(status_for(reason, "injected"))

    return action


class Relay:
    """A TCP relay in front of the server whose connections a test can break."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream_port = upstream_port
        self._links: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []
        self.connections = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._link, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    def break_all(self) -> None:
        for downstream, upstream in self._links:
            downstream.transport.abort()
            upstream.transport.abort()
        self._links.clear()

    async def close(self) -> None:
        self.break_all()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._upstream_port)
        self._links.append((writer, up_writer))
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while data := await source.read(65536):
            sink.write(data)
            await sink.drain()
    sink.close()


@dataclass
class FakeClock:
    """The retry's clock: sleeping advances it; nothing waits for real."""

    now: float = 1000.0
    slept: list[float] = field(default_factory=list)
    on_sleep: Callable[[], Awaitable[None]] | None = None

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
        if self.on_sleep is not None:
            await self.on_sleep()
        await asyncio.sleep(0)


@dataclass
class Rig:
    server: LeaseServer
    relay: Relay
    address: str
    identity: TlsFiles
    clients: list[WorkerClient] = field(default_factory=list)

    def client(
        self,
        *,
        clock: FakeClock | None = None,
        policy: RetryPolicy | None = None,
        call_timeout: float = 5.0,
        dice: Callable[[], float] = lambda: 0.0,
    ) -> WorkerClient:
        clock = clock or FakeClock()
        client = WorkerClient(
            ClientSettings(self.address, self.identity, call_timeout, policy or RetryPolicy()),
            sleep=clock.sleep,
            clock=clock.monotonic,
            unit_random=dice,
        )
        self.clients.append(client)
        return client


@pytest.fixture(scope="module")
def identity(tmp_path_factory: pytest.TempPathFactory) -> tuple[TlsFiles, TlsFiles]:
    pki = ensure_dev_pki(Path(tmp_path_factory.mktemp("client-pki")))
    return pki.ingress_server, ensure_worker_identity(pki, "worker-a")


@pytest.fixture
async def rig(identity: tuple[TlsFiles, TlsFiles]) -> AsyncIterator[Rig]:
    server_identity, worker_identity = identity
    service = LeaseServer()  # type: ignore[abstract]  # only ControlLease is served
    server = grpc.aio.server()
    worker_service_pb2_grpc.add_WorkerServiceServicer_to_server(service, server)
    port = server.add_secure_port("127.0.0.1:0", mutual_tls_server_credentials(server_identity))
    await server.start()
    relay = Relay(port)
    relay_port = await relay.start()
    rig = Rig(service, relay, f"127.0.0.1:{relay_port}", worker_identity)
    try:
        yield rig
    finally:
        for client in rig.clients:
            await client.close()
        await relay.close()
        await server.stop(None)


async def test_unavailable_is_retried_with_the_same_request(rig: Rig) -> None:
    rig.server.failures = [_abort(grpc.StatusCode.UNAVAILABLE)] * 2
    clock = FakeClock()
    answer = await rig.client(clock=clock).control_lease(
        ws.ControlLeaseRequest(fence=_fence(1)), budget_seconds=30
    )
    assert answer.renewed.lease_version == 2
    assert len(rig.server.requests) == 3
    assert len({request.SerializeToString() for request in rig.server.requests}) == 1
    policy = RetryPolicy()
    first = policy.initial_delay_seconds
    assert clock.slept == [first, first * policy.multiplier], "exponential backoff"


async def test_a_lost_renewal_answer_is_recovered_by_replaying_the_same_request(
    rig: Rig,
) -> None:
    """The renewal commits but its answer misses the deadline (DEADLINE_EXCEEDED): the
    retry presents the same expected version and gets the current projection."""
    rig.server.commit_then_stall = 1
    answer = await rig.client(call_timeout=0.3).control_lease(
        ws.ControlLeaseRequest(fence=_fence(1)), budget_seconds=30
    )
    assert answer.renewed.lease_version == 2
    assert rig.server.version == 2, "the replay did not advance the lease again"
    assert [r.fence.expected_lease_version for r in rig.server.requests] == [1, 1]


async def test_a_broken_connection_is_retried_on_a_new_connection(rig: Rig) -> None:
    clock = FakeClock()
    client = rig.client(clock=clock)
    stalled: list[int] = []

    async def stall(_: grpc.aio.ServicerContext[object, object]) -> None:
        stalled.append(1)
        await asyncio.sleep(30)

    rig.server.failures = [stall]
    call = asyncio.create_task(
        client.control_lease(ws.ControlLeaseRequest(fence=_fence(1)), budget_seconds=30)
    )
    await asyncio.wait_for(rig.server.arrived.wait(), 10)
    rig.relay.break_all()  # the TCP connection dies in the middle of the call
    answer = await asyncio.wait_for(call, 10)
    assert answer.renewed.lease_version == 2
    assert stalled == [1]
    # A try right after the break may fail fast while the channel reconnects; only
    # the stalled try and the answered one reach the server.
    assert len(rig.server.requests) == 2
    assert rig.relay.connections == 2, "the one channel reconnected"
    assert clock.slept


@pytest.mark.parametrize("reason", sorted(FENCE_REASONS), ids=ErrorReason.Name)
async def test_a_fence_is_final_at_once(rig: Rig, reason: ErrorReason.ValueType) -> None:
    rig.server.failures = [_refuse(reason)]
    clock = FakeClock()
    with pytest.raises(CallFailed) as failed:
        await rig.client(clock=clock).control_lease(
            ws.ControlLeaseRequest(fence=_fence(1)), budget_seconds=30
        )
    assert failed.value.reason == reason
    assert failed.value.fenced
    assert not failed.value.transient
    assert (failed.value.tries, len(rig.server.requests), clock.slept) == (1, 1, [])


@pytest.mark.parametrize(
    "action",
    [
        _refuse(ErrorReason.ERROR_REASON_STATE_CONFLICT),
        _refuse(ErrorReason.ERROR_REASON_FIELD_INVALID),
        _refuse(ErrorReason.ERROR_REASON_PERMISSION_DENIED),
        _refuse(ErrorReason.ERROR_REASON_INTERNAL),
        _abort(grpc.StatusCode.RESOURCE_EXHAUSTED),
    ],
    ids=["state-conflict", "field-invalid", "permission-denied", "internal-reason", "exhausted"],
)
async def test_other_refusals_are_final_and_not_fences(rig: Rig, action: Action) -> None:
    rig.server.failures = [action]
    with pytest.raises(CallFailed) as failed:
        await rig.client().control_lease(ws.ControlLeaseRequest(fence=_fence(1)), budget_seconds=30)
    assert not failed.value.fenced
    assert failed.value.tries == 1
    assert len(rig.server.requests) == 1


async def test_retries_end_at_the_budget_and_no_try_outlives_it(rig: Rig) -> None:
    rig.server.failures = [_abort(grpc.StatusCode.UNAVAILABLE)] * 50
    clock = FakeClock()
    policy = RetryPolicy(initial_delay_seconds=0.5, max_delay_seconds=1.0, jitter=0.0)
    with pytest.raises(CallFailed) as failed:
        await rig.client(clock=clock, policy=policy, call_timeout=10.0).control_lease(
            ws.ControlLeaseRequest(fence=_fence(1)), budget_seconds=3.0
        )
    assert failed.value.transient
    # Pauses 0.5, 1, 1 = 2.5 s; another 1 s pause would leave no time for a try.
    assert clock.slept == [0.5, 1.0, 1.0]
    assert failed.value.tries == len(rig.server.requests) == 4
    # Each try's deadline (as the server saw it) is what is left of the budget, never
    # the 10 s call timeout: 3.0, 2.5, 1.5 and 0.5 s.
    seen = [remaining or 0.0 for remaining in rig.server.time_remaining]
    for remaining, allowed in zip(seen, [3.0, 2.5, 1.5, 0.5], strict=True):
        assert remaining <= allowed + 0.05
        assert remaining > allowed - 1.0


async def test_an_exhausted_budget_still_gets_one_plain_try_for_a_last_word(
    rig: Rig,
) -> None:
    """A completion after the local lease ran out: one answer is still wanted."""
    rig.server.failures = [_abort(grpc.StatusCode.UNAVAILABLE)] * 5
    clock = FakeClock()
    with pytest.raises(CallFailed) as failed:
        await rig.client(clock=clock, call_timeout=4.0).complete_attempt(
            ws.CompleteAttemptRequest(fence=_fence(1)), budget_seconds=0.0
        )
    assert (failed.value.tries, clock.slept) == (1, [])
    (remaining,) = rig.server.time_remaining
    assert remaining is not None
    assert 3.0 < remaining <= 4.0, "the call timeout, not a sliver of no budget"


@pytest.mark.parametrize("budget", [0.0, 0.02])
async def test_a_lease_holding_call_without_budget_is_not_made(rig: Rig, budget: float) -> None:
    """ControlLease with (almost) nothing of the local lease left: no try at all, so that
    no call keeps an executor running past its lease (it is stopped on the Worker's own
    clock instead)."""
    with pytest.raises(CallFailed) as failed:
        await rig.client(clock=FakeClock(), call_timeout=4.0).control_lease(
            ws.ControlLeaseRequest(fence=_fence(1)), budget_seconds=budget
        )
    assert failed.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert failed.value.transient
    assert rig.server.requests == []


async def test_without_a_budget_the_default_bounds_the_retries(rig: Rig) -> None:
    rig.server.failures = [_abort(grpc.StatusCode.UNAVAILABLE)] * 50
    clock = FakeClock()
    policy = RetryPolicy(default_budget_seconds=1.0, jitter=0.0)
    with pytest.raises(CallFailed):
        await rig.client(clock=clock, policy=policy).control_lease(
            ws.ControlLeaseRequest(fence=_fence(1))
        )
    assert sum(clock.slept) <= 1.0
    assert clock.slept == [0.1, 0.2, 0.4]


async def test_jitter_shortens_each_pause_within_its_bound(rig: Rig) -> None:
    rig.server.failures = [_abort(grpc.StatusCode.UNAVAILABLE)] * 3
    clock = FakeClock()
    dice = iter([0.999, 0.0, 0.5])
    policy = RetryPolicy(initial_delay_seconds=1.0, max_delay_seconds=8.0, jitter=0.5)
    await rig.client(clock=clock, policy=policy, dice=lambda: next(dice)).control_lease(
        ws.ControlLeaseRequest(fence=_fence(1)), budget_seconds=60
    )
    assert clock.slept == pytest.approx([1.0 * (1 - 0.4995), 2.0, 4.0 * 0.75])


def test_backoff_grows_to_its_cap_and_jitter_stays_in_bounds() -> None:
    policy = RetryPolicy(initial_delay_seconds=0.1, max_delay_seconds=2.0, multiplier=2.0)
    nominal = [policy.nominal_delay(n) for n in range(8)]
    assert nominal == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0, 2.0])
    assert policy.nominal_delay(10_000) == 2.0, "no overflow for a long outage"
    for n in range(8):
        for unit in (0.0, 0.25, 0.5, 0.999999):
            delay = policy.delay(n, unit)
            assert nominal[n] * (1 - policy.jitter) <= delay <= nominal[n]
    with pytest.raises(ValueError, match="jitter"):
        RetryPolicy(jitter=1.0)
    with pytest.raises(ValueError, match="initial"):
        RetryPolicy(initial_delay_seconds=3.0, max_delay_seconds=2.0)


_E = ErrorReason


@pytest.mark.parametrize(
    ("code", "reason", "retried"),
    [
        (grpc.StatusCode.UNAVAILABLE, None, True),
        (grpc.StatusCode.UNAVAILABLE, _E.ERROR_REASON_STORAGE_UNAVAILABLE, True),
        (grpc.StatusCode.UNAVAILABLE, _E.ERROR_REASON_AUDIT_UNAVAILABLE, True),
        (grpc.StatusCode.UNAVAILABLE, _E.ERROR_REASON_RUNTIME_UNAVAILABLE, True),
        (grpc.StatusCode.DEADLINE_EXCEEDED, None, True),
        (grpc.StatusCode.INTERNAL, None, True),  # a reset stream, not an answer
        (grpc.StatusCode.UNKNOWN, None, True),
        (grpc.StatusCode.INTERNAL, _E.ERROR_REASON_INTERNAL, False),  # the server's answer
        (grpc.StatusCode.ABORTED, _E.ERROR_REASON_LEASE_VERSION_FENCED, False),
        (grpc.StatusCode.ABORTED, _E.ERROR_REASON_STATE_CONFLICT, False),
        (grpc.StatusCode.CANCELLED, None, False),  # our own shutdown
        (grpc.StatusCode.RESOURCE_EXHAUSTED, None, False),
        (grpc.StatusCode.INVALID_ARGUMENT, _E.ERROR_REASON_FIELD_INVALID, False),
        # A reason from a newer server: judged by its code, never as a broken stream.
        (grpc.StatusCode.UNAVAILABLE, UNKNOWN_REASON, True),
        (grpc.StatusCode.INTERNAL, UNKNOWN_REASON, False),
        (grpc.StatusCode.ABORTED, UNKNOWN_REASON, False),
    ],
)
def test_which_failures_are_retried(
    code: grpc.StatusCode, reason: ErrorReason.ValueType | None, retried: bool
) -> None:
    assert is_retryable(code, reason) is retried


def test_the_retried_reasons_are_the_ones_the_contract_sends_as_unavailable() -> None:
    """One source: a reason whose fixed code is UNAVAILABLE says nothing was decided."""
    unavailable = {r for r, code in REASON_CODES.items() if code is grpc.StatusCode.UNAVAILABLE}
    retried = {r for r in unavailable if is_retryable(grpc.StatusCode.UNAVAILABLE, r)}
    assert retried == unavailable
    for reason in set(REASON_CODES) - unavailable:
        assert not is_retryable(REASON_CODES[reason], reason), ErrorReason.Name(reason)


def test_a_reason_this_worker_does_not_know_is_never_a_fence() -> None:
    assert typed_reason("SOMETHING_NEWER") == UNKNOWN_REASON
    assert typed_reason(None) is None
    assert typed_reason("LEASE_EXPIRED") == _E.ERROR_REASON_LEASE_EXPIRED
    newer = CallFailed("ControlLease", grpc.StatusCode.ABORTED, UNKNOWN_REASON)
    assert not newer.fenced
    assert not newer.transient
    assert newer.label == "ABORTED"


async def test_cancelling_the_caller_ends_the_retries_at_once(rig: Rig) -> None:
    """Shutdown aborts the reconcile: a retry that sleeps (really) ends promptly."""
    rig.server.failures = [_abort(grpc.StatusCode.UNAVAILABLE)] * 5
    policy = RetryPolicy(initial_delay_seconds=20.0, max_delay_seconds=20.0)
    client = WorkerClient(
        ClientSettings(rig.address, rig.identity, 5.0, policy), unit_random=lambda: 0.0
    )
    rig.clients.append(client)
    call = asyncio.create_task(
        client.control_lease(ws.ControlLeaseRequest(fence=_fence(1)), budget_seconds=60)
    )
    await asyncio.wait_for(rig.server.arrived.wait(), 10)
    await asyncio.sleep(0.2)  # the first try failed; the call sleeps before the next
    started = time.monotonic()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    # Promptly: well within the backoff it was sleeping (a cancel that waited it out
    # would take all of it).
    assert time.monotonic() - started < policy.initial_delay_seconds / 4
    assert len(rig.server.requests) == 1


async def test_the_retry_budget_runs_on_the_boot_clock(
    identity: tuple[TlsFiles, TlsFiles],
) -> None:
    """The budgets handed in are what is left of a lease measured on the boot clock; the
    loop must measure them on the same clock, which counts a suspend (CLOCK_MONOTONIC
    does not, and a loop resumed after one would retry past the lease)."""
    client = WorkerClient(ClientSettings("127.0.0.1:9", identity[1], 1.0, RetryPolicy()))
    try:
        assert client._clock is boot_clock_seconds
        before = time.clock_gettime(time.CLOCK_BOOTTIME)
        assert before <= boot_clock_seconds() <= time.clock_gettime(time.CLOCK_BOOTTIME)
    finally:
        await client.close()
