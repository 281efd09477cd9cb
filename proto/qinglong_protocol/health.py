"""Asking a QingLong gRPC server whether it serves, over mutual TLS."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from qinglong_protocol.tls import TlsFiles, mutual_tls_channel_credentials

NOT_SERVING = "NOT_SERVING"


async def health_status(address: str, tls: TlsFiles, timeout_seconds: float) -> str:
    """SERVING, NOT_SERVING, or NOT_SERVING with the gRPC status that prevented an answer."""
    async with grpc.aio.secure_channel(address, mutual_tls_channel_credentials(tls)) as channel:
        try:
            response = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_seconds
            )
        except grpc.aio.AioRpcError as error:
            return f"{NOT_SERVING} ({error.code().name})"
    status: str = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return status
