"""Asking a QingLong gRPC server whether it serves, over mutual TLS."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from qinglong_protocol.tls import TlsFiles, mutual_tls_channel_credentials

NOT_SERVING = "NOT_SERVING"


async def health_status(
    address: str,
    tls: TlsFiles,
    timeout_seconds: float,
    *,
    service: str = "",
    server_name: str | None = None,
) -> str:
    """SERVING, NOT_SERVING, or NOT_SERVING with the gRPC status that prevented an answer.

    `server_name` checks the server certificate against that name instead of the
    address's host (a pod probing itself on 127.0.0.1 with a certificate for localhost).
    """
    options = [] if server_name is None else [("grpc.ssl_target_name_override", server_name)]
    credentials = mutual_tls_channel_credentials(tls)
    async with grpc.aio.secure_channel(address, credentials, options=options) as channel:
        try:
            response = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_seconds
            )
        except grpc.aio.AioRpcError as error:
            return f"{NOT_SERVING} ({error.code().name})"
    status: str = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return status
