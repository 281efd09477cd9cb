"""The ingress gRPC server: the only public endpoint (mutual TLS, health, reflection) serving
WorkerService, TaskService and RunService, plus the internal channel to control.

`create_server` only assembles and binds; the caller starts and stops it (see
`main.serve`), so tests can run it in-process on port 0. Nothing here imports
qinglong_control: ingress reaches the runtime only over gRPC (SPEC R-ROLE-2).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from qinglong.admin.v1 import admin_service_pb2
from qinglong.control.v1 import (
    approval_service_pb2,
    run_service_pb2,
    task_service_pb2,
)
from qinglong.enrollment.v1 import enrollment_service_pb2
from qinglong.worker.v1 import worker_service_pb2
from qinglong_protocol import bounds
from qinglong_protocol.keepalive import internal_channel_options
from qinglong_protocol.telemetry import server_interceptors
from qinglong_protocol.tls import (
    TlsFiles,
    TlsMaterial,
    mutual_tls_channel_credentials,
    mutual_tls_server_credentials,
)

from qinglong_ingress.listener_limits import ENROLLMENT_LIMITS, PUBLIC_LIMITS, ListenerLimits
from qinglong_ingress.settings import ControlChannelSettings, IngressSettings
from qinglong_ingress.validation import MAX_RECEIVE_MESSAGE_BYTES

WORKER_SERVICE_NAME: str = worker_service_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name
TASK_SERVICE_NAME: str = task_service_pb2.DESCRIPTOR.services_by_name["TaskService"].full_name
RUN_SERVICE_NAME: str = run_service_pb2.DESCRIPTOR.services_by_name["RunService"].full_name
ADMIN_SERVICE_NAME: str = admin_service_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name
APPROVAL_SERVICE_NAME: str = approval_service_pb2.DESCRIPTOR.services_by_name[
    "ApprovalService"
].full_name
ENROLLMENT_SERVICE_NAME: str = enrollment_service_pb2.DESCRIPTOR.services_by_name[
    "EnrollmentService"
].full_name
PUBLIC_SERVICE_NAMES = (
    WORKER_SERVICE_NAME,
    TASK_SERVICE_NAME,
    RUN_SERVICE_NAME,
    ADMIN_SERVICE_NAME,
    APPROVAL_SERVICE_NAME,
)


async def create_server(
    settings: IngressSettings,
    handlers: Sequence[grpc.GenericRpcHandler] = (),
    limits: ListenerLimits = PUBLIC_LIMITS,
) -> tuple[grpc.aio.Server, int]:
    """Assemble the server and bind `settings.listen_address`; return it (not started) and
    the bound port.

    `handlers` serve the public API (see handlers.public_handlers); without them every
    public method answers UNIMPLEMENTED. Messages larger than the largest per-method
    byte cap are refused by the transport before any handler runs.
    """
    server = grpc.aio.server(
        interceptors=server_interceptors(),
        options=[
            ("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES),
            *limits.server_options(),
        ],
        maximum_concurrent_rpcs=limits.max_concurrent_rpcs,
    )
    server.add_generic_rpc_handlers(tuple(handlers))

    health_servicer = health.aio.HealthServicer()
    for service_name in ("", *PUBLIC_SERVICE_NAMES):
        await health_servicer.set(service_name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)

    reflection.enable_server_reflection(
        (*PUBLIC_SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )

    port = server.add_secure_port(
        settings.listen_address, mutual_tls_server_credentials(settings.tls)
    )
    return server, port


async def create_enrollment_server(
    address: str,
    tls: TlsFiles,
    handlers: Sequence[grpc.GenericRpcHandler],
    limits: ListenerLimits = ENROLLMENT_LIMITS,
) -> tuple[grpc.aio.Server, int]:
    """The Worker enrollment listener (R-ADM-2): the public server certificate, no client
    certificate asked for (a joining machine has none yet), EnrollmentService only (and
    health's Check), and a receive limit at its byte cap. TLS 1.3 is enforced by
    its admission stages, as on the public listener. Bound, not started."""
    server = grpc.aio.server(
        interceptors=server_interceptors(),
        options=[
            ("grpc.max_receive_message_length", bounds.ENROLLMENT_REQUEST_MAX_BYTES),
            *limits.server_options(),
        ],
        maximum_concurrent_rpcs=limits.max_concurrent_rpcs,
    )
    server.add_generic_rpc_handlers(tuple(handlers))
    # Anyone may reach this listener, without a certificate and outside the admission
    # stages (rate limit, audit) that JoinWorker passes: it holds no stream open for
    # them. Health answers Check (the probe's call) but not Watch, and there is no
    # reflection here (the mutual-TLS listener has it).
    health_servicer = _CheckOnlyHealth()
    for service_name in ("", ENROLLMENT_SERVICE_NAME):
        await health_servicer.set(service_name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_secure_port(
        address, mutual_tls_server_credentials(tls, require_client_auth=False)
    )
    return server, port


class _CheckOnlyHealth(health.aio.HealthServicer):  # type: ignore[misc]  # untyped base
    """Health for an anonymous listener: Check, and no Watch stream to hold open."""

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Watch is not served here")


def open_control_channel(
    settings: ControlChannelSettings, material: TlsMaterial | None = None
) -> grpc.aio.Channel:
    """The internal channel to control, with ingress's client identity (``material``, or
    read from ``settings.tls``). It connects lazily, on the first call; the caller closes
    it.

    ``address`` is one ``host:port`` (in Kubernetes, control's Service), or a
    comma-separated list of ``ip:port`` replicas: then the channel keeps a connection to
    each and spreads calls round robin, and a replica that dies is skipped at once, so a
    control restart costs callers nothing while another replica serves (R-HA-1).
    """
    addresses = [part.strip() for part in settings.address.split(",") if part.strip()]
    # A replica that died without closing its connections is found by pings.
    options: list[tuple[str, str | int]] = [*internal_channel_options()]
    target = settings.address
    if len(addresses) > 1:
        target = "ipv4:" + ",".join(addresses)
        # The certificate names the hosts, not the list: check it against the first host.
        options += [
            ("grpc.lb_policy_name", "round_robin"),
            ("grpc.ssl_target_name_override", addresses[0].rsplit(":", 1)[0]),
        ]
    credentials = mutual_tls_channel_credentials(settings.tls, material)
    return grpc.aio.secure_channel(target, credentials, options=options)
