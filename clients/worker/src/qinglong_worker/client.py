"""The Worker's one connection to the control plane (SPEC R-W-5).

One ``grpc.aio`` secure channel per Worker process, mutual TLS from
:mod:`qinglong_protocol.tls`, thin typed calls with a deadline each. A failed call
raises :class:`CallFailed` carrying only the gRPC code and the ErrorInfo reason —
never the request, whose fence holds the lease capability.

Retries: a call is repeated only when it failed ``UNAVAILABLE`` (nothing was decided)
*and* its request is an idempotent command — the fenced start facts, start failure and
completion (exact replays are answers), ClaimOffer (idempotent by offer + capability),
OpenSession (by request id), and the harmless session/pull reads. ControlLease is
never retried: a renewal that committed but lost its answer would make the retry's
expected version stale.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Final, TypeVar

import grpc
from google.protobuf.message import Message
from qinglong.worker.v1 import worker_service_pb2 as ws
from qinglong.worker.v1 import worker_service_pb2_grpc
from qinglong_protocol.errors import error_reason_of
from qinglong_protocol.tls import TlsFiles, mutual_tls_channel_credentials

_Response = TypeVar("_Response", bound=Message)

#: Delays before the retries of an idempotent call that failed UNAVAILABLE.
RETRY_DELAYS_SECONDS: Final = (0.1, 0.4)
#: Keep-alive pings no more often than grpc servers accept by default (5 minutes).
_CHANNEL_OPTIONS: Final = (
    ("grpc.keepalive_time_ms", 300_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.max_receive_message_length", 4 * 1024 * 1024),
)
_TRANSIENT_CODES: Final = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.CANCELLED,
    }
)


class CallFailed(Exception):
    """A WorkerService call failed; ``reason`` is the ErrorInfo reason, if any."""

    def __init__(self, method: str, code: grpc.StatusCode, reason: str | None) -> None:
        super().__init__(f"{method} failed: {code.name} {reason or '-'}")
        self.method = method
        self.code = code
        self.reason = reason

    @property
    def transient(self) -> bool:
        """Nothing is known to have been decided: the same state may try again later."""
        return self.code in _TRANSIENT_CODES

    @property
    def label(self) -> str:
        """Low-cardinality text for logs and the inbox's ``detail``."""
        return self.reason or self.code.name


@dataclass(frozen=True)
class ClientSettings:
    ingress_address: str
    tls: TlsFiles
    call_timeout_seconds: float = 10.0


class WorkerClient:
    """Typed WorkerService calls on one channel."""

    def __init__(
        self,
        settings: ClientSettings,
        *,
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
    ) -> None:
        """``interceptors``: e.g. the OpenTelemetry client span of
        :func:`qinglong_protocol.telemetry.client_interceptors` (method and status only,
        never a message body)."""
        self._settings = settings
        self._channel = grpc.aio.secure_channel(
            settings.ingress_address,
            mutual_tls_channel_credentials(settings.tls),
            options=list(_CHANNEL_OPTIONS),
            interceptors=list(interceptors) or None,
        )
        self._stub = worker_service_pb2_grpc.WorkerServiceStub(self._channel)

    async def close(self) -> None:
        """Close the channel; calls still in flight end CANCELLED."""
        await self._channel.close(grace=None)

    async def open_session(self, request: ws.OpenSessionRequest) -> ws.OpenSessionResponse:
        return await self._call("OpenSession", self._stub.OpenSession, request, idempotent=True)

    async def renew_session(self, request: ws.RenewSessionRequest) -> ws.RenewSessionResponse:
        return await self._call("RenewSession", self._stub.RenewSession, request, idempotent=True)

    async def drain_session(self, request: ws.DrainSessionRequest) -> ws.DrainSessionResponse:
        return await self._call("DrainSession", self._stub.DrainSession, request, idempotent=True)

    async def pull_offers(self, request: ws.PullOffersRequest) -> ws.PullOffersResponse:
        return await self._call("PullOffers", self._stub.PullOffers, request, idempotent=True)

    async def claim_offer(self, request: ws.ClaimOfferRequest) -> ws.ClaimOfferResponse:
        return await self._call("ClaimOffer", self._stub.ClaimOffer, request, idempotent=True)

    async def acknowledge_starting(
        self, request: ws.AcknowledgeStartingRequest
    ) -> ws.AcknowledgeStartingResponse:
        return await self._call(
            "AcknowledgeStarting", self._stub.AcknowledgeStarting, request, idempotent=True
        )

    async def acknowledge_running(
        self, request: ws.AcknowledgeRunningRequest
    ) -> ws.AcknowledgeRunningResponse:
        return await self._call(
            "AcknowledgeRunning", self._stub.AcknowledgeRunning, request, idempotent=True
        )

    async def report_start_failure(
        self, request: ws.ReportStartFailureRequest
    ) -> ws.ReportStartFailureResponse:
        return await self._call(
            "ReportStartFailure", self._stub.ReportStartFailure, request, idempotent=True
        )

    async def control_lease(self, request: ws.ControlLeaseRequest) -> ws.ControlLeaseResponse:
        return await self._call("ControlLease", self._stub.ControlLease, request, idempotent=False)

    async def complete_attempt(
        self, request: ws.CompleteAttemptRequest
    ) -> ws.CompleteAttemptResponse:
        return await self._call(
            "CompleteAttempt", self._stub.CompleteAttempt, request, idempotent=True
        )

    async def _call(
        self,
        method: str,
        call: Callable[..., Awaitable[_Response]],
        request: Message,
        *,
        idempotent: bool,
    ) -> _Response:
        delays = RETRY_DELAYS_SECONDS if idempotent else ()
        attempt = 0
        while True:
            try:
                return await call(request, timeout=self._settings.call_timeout_seconds)
            except grpc.aio.AioRpcError as error:
                code = error.code()
                if code is grpc.StatusCode.UNAVAILABLE and attempt < len(delays):
                    await asyncio.sleep(delays[attempt])
                    attempt += 1
                    continue
                # `from None`: the original error's text is the server's, not ours to log.
                raise CallFailed(method, code, error_reason_of(error)) from None
