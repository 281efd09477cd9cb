"""The control service's gRPC server: mutual TLS, caller check, health, reflection, RuntimeService.

Every RuntimeService call passes, in order: OpenTelemetry's server span, the caller check
(only ingress's identity), the error interceptor (errors.py) that answers every failure
with a typed status and records the command's latency, and the contract's field rules on
the public request it carries (contract_bounds.py).

`create_server` only assembles and binds; the caller starts and stops it (see
`main.serve`), so tests can run it in-process on port 0.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from qinglong.rpc.v1.error_reason_pb2 import ErrorReason
from qinglong.runtime.v1 import runtime_service_pb2, runtime_service_pb2_grpc
from qinglong_protocol.errors import abort_with, status_for
from qinglong_protocol.keepalive import internal_server_options
from qinglong_protocol.telemetry import server_interceptors
from qinglong_protocol.tls import mutual_tls_server_credentials, peer_uris

from qinglong_control.answer_budget import answer_budget
from qinglong_control.contract_bounds import ContractBoundsInterceptor
from qinglong_control.errors import ErrorInterceptor
from qinglong_control.settings import ControlSettings
from qinglong_control.wrapping import (
    Behaviour,
    WrappingInterceptor,
    resolved,
    responses,
    rewrapped,
)

_log = logging.getLogger(__name__)

RUNTIME_SERVICE = runtime_service_pb2.DESCRIPTOR.services_by_name["RuntimeService"]
RUNTIME_SERVICE_NAME: str = RUNTIME_SERVICE.full_name
HEALTH_SERVICE_NAME: str = health.SERVICE_NAME
REFLECTION_SERVICE_NAME: str = reflection.SERVICE_NAME

# Any certificate from the CA may use these: probes and tooling need them, and
# they reveal nothing a caller could act on. Everything else is runtime API.
_OPEN_TO_ANY_CLIENT = frozenset({HEALTH_SERVICE_NAME, REFLECTION_SERVICE_NAME})


async def create_server(
    settings: ControlSettings,
    runtime_servicer: runtime_service_pb2_grpc.RuntimeServiceServicer | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> tuple[grpc.aio.Server, int]:
    """Assemble the server and bind `settings.listen_address`; return it (not started) and
    the bound port.

    Without `runtime_servicer`, the generated base servicer answers every runtime
    RPC with UNIMPLEMENTED.
    """
    server = grpc.aio.server(
        # Outermost first: the call's span (continuing ingress's trace) sees the caller
        # check and the typed status; only an allowed caller's call is answered and timed
        # by the error interceptor; `interceptors` (tests) see the servicer's behaviour.
        interceptors=[
            *server_interceptors(),
            AllowedCallerInterceptor(settings.allowed_caller_uris, _OPEN_TO_ANY_CLIENT),
            ErrorInterceptor(
                RUNTIME_SERVICE_NAME, partial(answer_budget, storage=settings.storage)
            ),
            ContractBoundsInterceptor(RUNTIME_SERVICE),
            *interceptors,
        ],
        options=internal_server_options(),
    )
    if runtime_servicer is None:
        # Abstract only in the type stubs; at run time every method answers UNIMPLEMENTED.
        runtime_servicer = runtime_service_pb2_grpc.RuntimeServiceServicer()  # type: ignore[abstract]
    runtime_service_pb2_grpc.add_RuntimeServiceServicer_to_server(runtime_servicer, server)

    health_servicer = health.aio.HealthServicer()
    for service_name in ("", RUNTIME_SERVICE_NAME):
        await health_servicer.set(service_name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)

    reflection.enable_server_reflection(
        (RUNTIME_SERVICE_NAME, HEALTH_SERVICE_NAME, REFLECTION_SERVICE_NAME), server
    )

    port = server.add_secure_port(
        settings.listen_address, mutual_tls_server_credentials(settings.tls)
    )
    return server, port


# --- caller identity ------------------------------------------------------------------------

_Check = Callable[[grpc.aio.ServicerContext[Any, Any]], Awaitable[None]]


class AllowedCallerInterceptor(WrappingInterceptor):
    """Refuse (PERMISSION_DENIED) every call whose verified client certificate carries none
    of `allowed_uris`, except calls to `open_services`.

    The TLS layer has already proven the certificate comes from our CA; this decides
    whether that identity may use the runtime API at all (ARCHITECTURE: only ingress).
    """

    def __init__(self, allowed_uris: frozenset[str], open_services: frozenset[str]) -> None:
        self._allowed_uris = allowed_uris
        self._open_services = open_services

    def covers(self, method: str) -> bool:
        return _service_of(method) not in self._open_services

    def wrap(
        self, handler: grpc.RpcMethodHandler[Any, Any], method: str
    ) -> grpc.RpcMethodHandler[Any, Any]:
        return _run_check_first(handler, self._check_caller)

    async def _check_caller(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        uris = peer_uris(context.auth_context())
        if self._allowed_uris.isdisjoint(uris):
            # Identities are not secrets; logging them makes a misrouted client obvious.
            _log.warning("refused caller %s: not an allowed runtime caller", list(uris))
            await abort_with(
                context,
                status_for(ErrorReason.ERROR_REASON_CALLER_NOT_INGRESS, "caller is not allowed"),
            )


def _service_of(method: str) -> str:
    # "/package.Service/Method" -> "package.Service"
    return method.lstrip("/").split("/", 1)[0]


def _run_check_first(
    handler: grpc.RpcMethodHandler[Any, Any], check: _Check
) -> grpc.RpcMethodHandler[Any, Any]:
    """The same handler, with `check` awaited before its behaviour runs."""

    async def unary(behaviour: Behaviour, request: Any, context: Any) -> Any:
        await check(context)
        return await resolved(behaviour(request, context))

    async def stream(behaviour: Behaviour, request: Any, context: Any) -> AsyncIterator[Any]:
        await check(context)
        async for response in responses(behaviour(request, context)):
            yield response

    return rewrapped(handler, unary, stream)
