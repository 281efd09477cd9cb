"""The Worker's one connection to the control plane (SPEC R-W-5).

One ``grpc.aio`` secure channel per Worker process, mutual TLS from
:mod:`qinglong_protocol.tls`, thin typed calls with a deadline each. A failed call
raises :class:`CallFailed` carrying only the gRPC code and the typed ErrorInfo reason —
never the request, whose fence holds the lease capability. The Worker decides on the
:class:`ErrorReason` value; the code is consulted only when a call carries no QingLong
ErrorInfo, which means the transport itself failed (a lost connection, a deadline, our
own shutdown), or a reason this Worker does not know yet (a newer server: AIP-193 says to
act on its code then).

Retries (SPEC R-LC-8): every WorkerService command has a replay rule, so every call is
repeated when nothing was decided *as far as the Worker can tell*: a reason that says
storage, the audit or the runtime was unavailable, and without a reason ``UNAVAILABLE``,
``DEADLINE_EXCEEDED`` and a broken connection (a stream reset surfaces as ``INTERNAL``
or ``UNKNOWN`` without a QingLong ErrorInfo — the server itself never answers those
codes without one). The answer to the retry is the answer the lost one would have been:

* OpenSession by its request id (AIP-155); ClaimOffer by offer + capability;
* AcknowledgeStarting, AcknowledgeRunning, ReportStartFailure and CompleteAttempt are
  exact replays under the same fence;
* ControlLease: a renewal that committed but lost its answer leaves the lease at
  ``expected + 1``; the server answers the retry — same request, same expected version
  — with the current projection, without advancing again;
* RenewSession, DrainSession and PullOffers are harmless to repeat;
* AppendOutput by its offset: a chunk already stored is answered as a replay.

Everything else is final and raised at once: a fence (a fencing reason, see
:attr:`CallFailed.fenced`), a state conflict, a refusal of a field, an identity
problem, and ``CANCELLED`` (our own shutdown closing the channel).

Retries are bounded by a *budget* in seconds: the caller's (for a lease-holding command,
the time left on the record's local lease — after that SPEC R-W-2 step 3 applies, and
the process is stopped locally) or :attr:`RetryPolicy.default_budget_seconds`. No try's
deadline outlives the budget — but a *last word* (``last_word``: what reports an ended
executor, after the lease ran out) gets one plain try even with none left, and any other
call with less than one try's budget is not made. Between tries the call sleeps a
jittered, exponentially growing delay; the sleeping happens inside the caller's task
(the reconcile), so no timer exists per run, and cancelling that task (shutdown) ends the
retries at once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final, TypeVar

import grpc
from google.protobuf.message import Message
from qinglong.rpc.v1.error_reason_pb2 import ErrorReason
from qinglong.worker.v1 import worker_service_pb2 as ws
from qinglong.worker.v1 import worker_service_pb2_grpc
from qinglong_protocol import bounds
from qinglong_protocol.errors import error_info_of, reason_from_name, reason_name
from qinglong_protocol.keepalive import keepalive_options
from qinglong_protocol.tls import TlsFiles, mutual_tls_channel_credentials

from qinglong_worker import metrics
from qinglong_worker.clock import boot_clock_seconds

log = logging.getLogger(__name__)

_Response = TypeVar("_Response", bound=Message)

#: Keep-alive pings no more often than grpc servers accept by default (5 minutes).
_CHANNEL_OPTIONS: Final = (
    *keepalive_options(every_ms=300_000, timeout_ms=20_000),
    ("grpc.max_receive_message_length", bounds.WORKER_RESPONSE_MAX_BYTES),
)
#: Reasons that say nothing was decided (storage, audit or the runtime could not be
#: reached): always retried within the budget.
_RETRY_REASONS: Final = frozenset(
    {
        ErrorReason.ERROR_REASON_STORAGE_UNAVAILABLE,
        ErrorReason.ERROR_REASON_AUDIT_UNAVAILABLE,
        ErrorReason.ERROR_REASON_RUNTIME_UNAVAILABLE,
    }
)
#: Reasons after which the same state may simply try again later (at the next tick).
_TRANSIENT_REASONS: Final = _RETRY_REASONS | {ErrorReason.ERROR_REASON_INTERNAL}
#: Without a reason, the transport's own failures, retried within the budget: nothing
#: was decided, or the answer was lost — and INTERNAL or UNKNOWN without a reason is a
#: broken stream (e.g. a RST_STREAM), since the server never sends them without one.
_RETRY_CODES: Final = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
    }
)
#: Without a reason, failures after which the same state may try again at the next tick
#: (CANCELLED: our own shutdown closed the channel; RESOURCE_EXHAUSTED: a transport limit).
_TRANSIENT_CODES: Final = _RETRY_CODES | {
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.CANCELLED,
}
#: The reasons that say this Worker's authority is gone (SPEC §0 "fence"): the only
#: refusals that make a Worker stop an executor before its local lease runs out.
FENCE_REASONS: Final = frozenset(
    {
        ErrorReason.ERROR_REASON_LEASE_VERSION_FENCED,
        ErrorReason.ERROR_REASON_LEASE_TOKEN_MISMATCH,
        ErrorReason.ERROR_REASON_LEASE_EXPIRED,
        ErrorReason.ERROR_REASON_LEASE_NOT_LEASED,
        ErrorReason.ERROR_REASON_SESSION_FENCED,
        ErrorReason.ERROR_REASON_SESSION_EXPIRED,
        ErrorReason.ERROR_REASON_FENCE_MISMATCH,
    }
)
#: A reason a newer server sent that this Worker does not know: never a fence, and
#: judged by its code like a transport failure (but never as a broken stream).
UNKNOWN_REASON: Final = ErrorReason.ERROR_REASON_UNSPECIFIED


def typed_reason(wire_reason: str | None) -> ErrorReason.ValueType | None:
    """The ErrorReason of a call's ErrorInfo; ``None`` without one, :data:`UNKNOWN_REASON`
    for a reason this Worker does not know."""
    if wire_reason is None:
        return None
    return reason_from_name(wire_reason) or UNKNOWN_REASON


def is_retryable(code: grpc.StatusCode, reason: ErrorReason.ValueType | None) -> bool:
    """Whether a failed call is repeated (within its budget) inside the same call."""
    if reason is None:
        return code in _RETRY_CODES
    if reason == UNKNOWN_REASON:
        return code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    return reason in _RETRY_REASONS


class CallFailed(Exception):
    """A WorkerService call failed; ``reason`` is its ErrorInfo reason, ``None`` when the
    call carried none (the transport failed)."""

    def __init__(
        self,
        method: str,
        code: grpc.StatusCode,
        reason: ErrorReason.ValueType | None,
        *,
        tries: int = 1,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self.method = method
        self.code = code
        self.reason = reason
        self.tries = tries
        #: The ErrorInfo's metadata: what the refusal says to do (OUTPUT_OFFSET_GAP's
        #: ``expectedOffset``); never a secret.
        self.metadata: Mapping[str, str] = dict(metadata or {})
        super().__init__(f"{method} failed: {code.name} {self.label} (tries: {tries})")

    @property
    def transient(self) -> bool:
        """Nothing is known to have been decided: the same state may try again later."""
        if self.reason is None or self.reason == UNKNOWN_REASON:
            return self.code in _TRANSIENT_CODES
        return self.reason in _TRANSIENT_REASONS

    @property
    def fenced(self) -> bool:
        """The control plane says this Worker's authority (session, lease, version,
        capability) is no longer the present one."""
        return self.reason in FENCE_REASONS

    @property
    def label(self) -> str:
        """Low-cardinality text for logs and the inbox's ``detail``."""
        if self.reason is None or self.reason == UNKNOWN_REASON:
            return self.code.name
        return reason_name(self.reason)


@dataclass(frozen=True)
class RetryPolicy:
    """Jittered exponential backoff between the tries of one call.

    The n-th pause (n from 0) is ``min(max_delay, initial_delay * multiplier**n)``,
    shortened by a random fraction of at most ``jitter`` — so Workers that lost the
    same server at the same moment do not come back in step, and no pause is ever
    shorter than ``(1 - jitter)`` of the nominal one.
    """

    initial_delay_seconds: float = 0.1
    max_delay_seconds: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.5
    default_budget_seconds: float = 10.0
    """The bound of a call whose caller names none (a command without a lease)."""
    min_try_seconds: float = 0.05
    """No retry is started with less time than this left in the budget."""

    def __post_init__(self) -> None:
        if not 0 < self.initial_delay_seconds <= self.max_delay_seconds:
            raise ValueError("delays must be positive and initial <= max")
        if self.multiplier < 1:
            raise ValueError("multiplier must be at least 1")
        if not 0 <= self.jitter < 1:
            raise ValueError("jitter must be in [0, 1)")
        if not (self.default_budget_seconds > 0 and self.min_try_seconds > 0):
            raise ValueError("budgets must be positive")

    def nominal_delay(self, retry: int) -> float:
        exponent = min(retry, 64)  # no overflow; the cap is reached long before
        return min(self.max_delay_seconds, self.initial_delay_seconds * self.multiplier**exponent)

    def delay(self, retry: int, unit_random: float) -> float:
        """The pause before retry ``retry + 1``; ``unit_random`` is uniform in [0, 1)."""
        return self.nominal_delay(retry) * (1 - self.jitter * unit_random)


@dataclass(frozen=True)
class ClientSettings:
    ingress_address: str
    tls: TlsFiles
    call_timeout_seconds: float = 10.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)


class WorkerClient:
    """Typed WorkerService calls on one channel."""

    def __init__(
        self,
        settings: ClientSettings,
        *,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = boot_clock_seconds,
        unit_random: Callable[[], float] = random.random,
    ) -> None:
        """``interceptors``: e.g. the OpenTelemetry client span of
        :func:`qinglong_protocol.telemetry.client_interceptors` (method and status only,
        never a message body). ``sleep``, ``clock`` and ``unit_random`` are the retry's
        pause, clock and dice, replaceable in tests. The clock is the boot clock, as the
        lease budgets handed in are: it counts a suspend, so a retry loop resumed after
        one gives up once the local lease is spent (each try's own gRPC deadline may
        still run on after the resume, at most one try)."""
        self._settings = settings
        self._sleep = sleep
        self._clock = clock
        self._random = unit_random
        self._interceptors = list(interceptors)
        self._channel = self._open(settings.tls)
        self._stub = worker_service_pb2_grpc.WorkerServiceStub(self._channel)

    def _open(self, tls: TlsFiles) -> grpc.aio.Channel:
        return grpc.aio.secure_channel(
            self._settings.ingress_address,
            mutual_tls_channel_credentials(tls),
            options=list(_CHANNEL_OPTIONS),
            interceptors=self._interceptors or None,
        )

    async def close(self) -> None:
        """Close the channel; calls still in flight end CANCELLED."""
        await self._channel.close(grace=None)

    async def use_identity(self, tls: TlsFiles, grace_seconds: float = 30.0) -> None:
        """Switch to a renewed certificate: new calls go over a channel that presents it;
        calls already in flight on the old one get ``grace_seconds`` to finish. Nothing
        the Worker runs depends on the channel, so no work is dropped."""
        old = self._channel
        self._channel = self._open(tls)
        self._stub = worker_service_pb2_grpc.WorkerServiceStub(self._channel)
        await old.close(grace=grace_seconds)

    async def open_session(
        self, request: ws.OpenSessionRequest, *, budget_seconds: float | None = None
    ) -> ws.OpenSessionResponse:
        return await self._call("OpenSession", request, budget_seconds)

    async def renew_session(
        self, request: ws.RenewSessionRequest, *, budget_seconds: float | None = None
    ) -> ws.RenewSessionResponse:
        return await self._call("RenewSession", request, budget_seconds)

    async def drain_session(
        self, request: ws.DrainSessionRequest, *, budget_seconds: float | None = None
    ) -> ws.DrainSessionResponse:
        return await self._call("DrainSession", request, budget_seconds)

    async def pull_offers(
        self, request: ws.PullOffersRequest, *, budget_seconds: float | None = None
    ) -> ws.PullOffersResponse:
        return await self._call("PullOffers", request, budget_seconds)

    async def claim_offer(
        self, request: ws.ClaimOfferRequest, *, budget_seconds: float | None = None
    ) -> ws.ClaimOfferResponse:
        return await self._call("ClaimOffer", request, budget_seconds)

    async def acknowledge_starting(
        self, request: ws.AcknowledgeStartingRequest, *, budget_seconds: float | None = None
    ) -> ws.AcknowledgeStartingResponse:
        return await self._call("AcknowledgeStarting", request, budget_seconds)

    async def acknowledge_running(
        self,
        request: ws.AcknowledgeRunningRequest,
        *,
        budget_seconds: float | None = None,
        last_word: bool = False,
    ) -> ws.AcknowledgeRunningResponse:
        return await self._call("AcknowledgeRunning", request, budget_seconds, last_word=last_word)

    async def report_start_failure(
        self, request: ws.ReportStartFailureRequest, *, budget_seconds: float | None = None
    ) -> ws.ReportStartFailureResponse:
        # Nothing runs: the answer is still wanted once the local lease is gone.
        return await self._call("ReportStartFailure", request, budget_seconds, last_word=True)

    async def control_lease(
        self,
        request: ws.ControlLeaseRequest,
        *,
        budget_seconds: float | None = None,
        last_word: bool = False,
    ) -> ws.ControlLeaseResponse:
        return await self._call("ControlLease", request, budget_seconds, last_word=last_word)

    async def renew_certificate(
        self, request: ws.RenewCertificateRequest, *, budget_seconds: float | None = None
    ) -> ws.RenewCertificateResponse:
        return await self._call("RenewCertificate", request, budget_seconds)

    async def complete_attempt(
        self, request: ws.CompleteAttemptRequest, *, budget_seconds: float | None = None
    ) -> ws.CompleteAttemptResponse:
        # The executor has ended: its ending is still worth one answer after the lease.
        return await self._call("CompleteAttempt", request, budget_seconds, last_word=True)

    async def append_output(
        self, request: ws.AppendOutputRequest, *, budget_seconds: float | None = None
    ) -> ws.AppendOutputResponse:
        return await self._call("AppendOutput", request, budget_seconds)

    async def _call(
        self,
        method: str,
        request: Message,
        budget_seconds: float | None,
        *,
        last_word: bool = False,
    ) -> _Response:
        """The same request until it is answered, finally refused, or the budget ends.
        Each try looks the method up on the current stub: a renewed certificate
        (`use_identity`) closes the old channel, and a retry must not use it.

        ``last_word``: a report that nothing runs any more (a completion, a start
        failure, the start of an executor that has already ended) gets one plain try
        even with no budget left. Any other call holds a
        lease: with less budget than one try it is not made at all (it fails as
        DEADLINE_EXCEEDED, transient), so it never runs past the local lease."""
        policy = self._settings.retry
        budget = policy.default_budget_seconds if budget_seconds is None else budget_seconds
        deadline = self._clock() + budget
        tries = 0
        while True:
            remaining = deadline - self._clock()
            if tries == 0 and remaining < policy.min_try_seconds:
                if not last_word:
                    raise CallFailed(method, grpc.StatusCode.DEADLINE_EXCEEDED, None, tries=0)
                # No budget at all (e.g. a completion reported after the local lease ran
                # out): the caller still wants this one answer; one plain try, no retry.
                timeout = self._settings.call_timeout_seconds
            else:
                # No try outlives the budget: a lease-holding command never waits past
                # the local lease.
                timeout = min(self._settings.call_timeout_seconds, remaining)
            tries += 1
            started = time.perf_counter()
            try:
                call: Callable[..., Awaitable[_Response]] = getattr(self._stub, method)
                response = await call(request, timeout=timeout)
            except grpc.aio.AioRpcError as error:
                info = error_info_of(error)
                code = error.code()
                reason = typed_reason(info.reason if info is not None and info.reason else None)
                # `from None`: the original error's text is the server's, not ours to log.
                failure = CallFailed(
                    method,
                    code,
                    reason,
                    tries=tries,
                    metadata=None if info is None else dict(info.metadata),
                )
                elapsed = time.perf_counter() - started
                metrics.CALL_DURATION.labels(method, failure.label).observe(elapsed)
                if failure.fenced:
                    metrics.FENCE_REJECTIONS.labels(method, failure.label).inc()
                if not is_retryable(code, reason):
                    raise failure from None
                pause = policy.delay(tries - 1, self._random())
                if self._clock() + pause + policy.min_try_seconds > deadline:
                    raise failure from None
                log.debug("%s: %s; try %d in %.2f s", method, failure.label, tries + 1, pause)
                await self._sleep(pause)
            else:
                metrics.CALL_DURATION.labels(method, "ok").observe(time.perf_counter() - started)
                return response
