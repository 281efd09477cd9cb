"""`qinglong-ingress probe` and `qinglong-control probe` work against the dev certificates
(a service's own server identity is also a client identity), as the Kubernetes probes use
them: each service asks its own server with its own certificate."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from qinglong_protocol.tls import TlsFiles

from tests.support.stack import Stack


async def probe(service: str, address: str, tls: TlsFiles, *more: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).with_name(f"qinglong-{service}")),
        "probe",
        "--address",
        address,
        *(f"--address={other}" for other in more),
        "--tls-ca",
        str(tls.ca_cert),
        "--tls-cert",
        str(tls.cert),
        "--tls-key",
        str(tls.key),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=30)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


@pytest.mark.parametrize("service", ["ingress", "control"])
async def test_a_probe_with_the_services_own_dev_certificate_reports_serving(
    stack: Stack, service: str
) -> None:
    if service == "ingress":
        address, tls = stack.ingress_address, stack.pki.ingress_server
    else:
        address, tls = stack.control_address, stack.pki.control_server
    code, out, err = await probe(service, address, tls)
    assert code == 0, err
    assert out.strip().endswith(": SERVING")


async def test_the_enrollment_listener_serves_health_to_the_probe(stack: Stack) -> None:
    """The Worker enrollment listener is a gRPC server of its own: it answers health
    checks (SPEC B-OPS), and the probe asks every --address given, all must serve. It is
    anonymous and outside admission, so it holds no stream open: no Watch, no reflection."""
    tls = stack.pki.ingress_server
    code, out, err = await probe("ingress", stack.enrollment_address, tls)
    assert code == 0, err
    assert out.strip().endswith(": SERVING")
    closed = "127.0.0.1:9"  # nothing listens there
    code, out, _ = await probe("ingress", stack.ingress_address, tls, closed)
    assert code == 1
    assert f"{stack.ingress_address}: SERVING" in out

    credentials = grpc.ssl_channel_credentials(root_certificates=stack.pki.ca_cert.read_bytes())
    async with grpc.aio.secure_channel(stack.enrollment_address, credentials) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        checked = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert checked.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as watch:
            async for _ in health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5):
                pass
        assert watch.value.code() == grpc.StatusCode.UNIMPLEMENTED
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as listing:
            async for _ in reflect.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
            ):
                pass
        assert listing.value.code() == grpc.StatusCode.UNIMPLEMENTED
