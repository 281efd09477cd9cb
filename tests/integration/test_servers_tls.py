"""Control and ingress servers in-process on 127.0.0.1:0, with a freshly minted PKI:
mutual TLS, health, reflection, the control caller check, and the generated stubs."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from qinglong.control.v1 import (
    run_service_pb2,
    run_service_pb2_grpc,
    task_service_pb2,
    task_service_pb2_grpc,
)
from qinglong.runtime.v1 import runtime_service_pb2, runtime_service_pb2_grpc
from qinglong.worker.v1 import worker_service_pb2, worker_service_pb2_grpc
from qinglong_cli.pki import (
    DevPki,
    ensure_dev_pki,
    ensure_operator_identity,
    ensure_worker_identity,
    service_uri,
)
from qinglong_control.server import RUNTIME_SERVICE_NAME
from qinglong_control.server import create_server as create_control_server
from qinglong_control.settings import ControlSettings
from qinglong_ingress.server import PUBLIC_SERVICE_NAMES, open_control_channel
from qinglong_ingress.server import create_server as create_ingress_server
from qinglong_ingress.settings import ControlChannelSettings, IngressSettings
from qinglong_protocol.tls import TlsFiles, mutual_tls_channel_credentials

HEALTH = "grpc.health.v1.Health"
REFLECTION = "grpc.reflection.v1alpha.ServerReflection"
TIMEOUT = 5.0


@dataclass(frozen=True)
class Identities:
    pki: DevPki
    worker: TlsFiles
    operator: TlsFiles


@dataclass(frozen=True)
class Stack:
    control_address: str
    ingress_address: str
    ingress_settings: IngressSettings


@pytest.fixture(scope="module")
def identities(tmp_path_factory: pytest.TempPathFactory) -> Identities:
    pki = ensure_dev_pki(tmp_path_factory.mktemp("pki"))
    return Identities(
        pki=pki,
        worker=ensure_worker_identity(pki, "worker-1"),
        operator=ensure_operator_identity(pki, "operator-1"),
    )


@pytest.fixture(scope="module")
async def stack(identities: Identities) -> AsyncIterator[Stack]:
    pki = identities.pki
    control, control_port = await create_control_server(
        ControlSettings(
            listen_address="127.0.0.1:0",
            tls=pki.control_server,
            allowed_caller_uris=frozenset({service_uri(pki.trust_domain, "ingress")}),
        )
    )
    await control.start()
    control_address = f"127.0.0.1:{control_port}"
    ingress_settings = IngressSettings(
        listen_address="127.0.0.1:0",
        tls=pki.ingress_server,
        control=ControlChannelSettings(address=control_address, tls=pki.ingress_client),
    )
    ingress, ingress_port = await create_ingress_server(ingress_settings)
    await ingress.start()
    try:
        yield Stack(control_address, f"127.0.0.1:{ingress_port}", ingress_settings)
    finally:
        await ingress.stop(0)
        await control.stop(0)


def _channel(address: str, tls: TlsFiles) -> grpc.aio.Channel:
    return grpc.aio.secure_channel(address, mutual_tls_channel_credentials(tls))


async def _health(channel: grpc.aio.Channel, service: str) -> str:
    response = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT
    )
    name: str = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return name


async def _listed_services(channel: grpc.aio.Channel) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    call = stub.ServerReflectionInfo(iter([request]), timeout=TIMEOUT)
    names: set[str] = set()
    async for response in call:
        names.update(service.name for service in response.list_services_response.service)
    return names


async def test_ingress_health_is_serving_over_mutual_tls(
    stack: Stack, identities: Identities
) -> None:
    async with _channel(stack.ingress_address, identities.worker) as channel:
        for service in ("", *PUBLIC_SERVICE_NAMES):
            assert await _health(channel, service) == "SERVING", service


async def test_control_health_is_serving_for_any_certificate_of_the_ca(
    stack: Stack, identities: Identities
) -> None:
    # Health stays open to probes and tooling; only the runtime API is reserved for ingress.
    for tls in (identities.operator, identities.pki.ingress_client):
        async with _channel(stack.control_address, tls) as channel:
            for service in ("", RUNTIME_SERVICE_NAME):
                assert await _health(channel, service) == "SERVING"


async def test_reflection_lists_the_services(stack: Stack, identities: Identities) -> None:
    async with _channel(stack.ingress_address, identities.operator) as channel:
        assert await _listed_services(channel) == {*PUBLIC_SERVICE_NAMES, HEALTH, REFLECTION}
    async with _channel(stack.control_address, identities.pki.ingress_client) as channel:
        assert await _listed_services(channel) == {RUNTIME_SERVICE_NAME, HEALTH, REFLECTION}


@pytest.mark.parametrize("server", ["ingress", "control"])
async def test_a_client_without_certificate_is_refused(
    stack: Stack, identities: Identities, server: str
) -> None:
    address = stack.ingress_address if server == "ingress" else stack.control_address
    credentials = grpc.ssl_channel_credentials(identities.pki.ca_cert.read_bytes())
    async with grpc.aio.secure_channel(address, credentials) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _health(channel, "")
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_certificate_from_another_ca_is_refused(stack: Stack, tmp_path: Path) -> None:
    stranger_pki = ensure_dev_pki(tmp_path / "other-pki")
    stranger = ensure_worker_identity(stranger_pki, "worker-1")  # same name, wrong CA
    # Trust the real server (so the client side would accept it) but present the stranger.
    credentials = TlsFiles(
        ca_cert=stack.ingress_settings.tls.ca_cert, cert=stranger.cert, key=stranger.key
    )
    async with _channel(stack.ingress_address, credentials) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _health(channel, "")
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_public_rpcs_answer_unimplemented(stack: Stack, identities: Identities) -> None:
    async with _channel(stack.ingress_address, identities.worker) as channel:
        calls: list[Awaitable[object]] = [
            worker_service_pb2_grpc.WorkerServiceStub(channel).OpenSession(
                worker_service_pb2.OpenSessionRequest(), timeout=TIMEOUT
            ),
            task_service_pb2_grpc.TaskServiceStub(channel).GetTask(
                task_service_pb2.GetTaskRequest(), timeout=TIMEOUT
            ),
            run_service_pb2_grpc.RunServiceStub(channel).GetRun(
                run_service_pb2.GetRunRequest(), timeout=TIMEOUT
            ),
        ]
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as answered:
                await call
            assert answered.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_ingress_control_channel_reaches_the_runtime_api(stack: Stack) -> None:
    async with open_control_channel(stack.ingress_settings.control) as channel:
        assert await _health(channel, RUNTIME_SERVICE_NAME) == "SERVING"
        runtime = runtime_service_pb2_grpc.RuntimeServiceStub(channel)
        # An empty public request breaks the contract's rules: control refuses it itself.
        with pytest.raises(grpc.aio.AioRpcError) as empty:
            await runtime.OpenSession(runtime_service_pb2.OpenSessionRequest(), timeout=TIMEOUT)
        assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        open_session = worker_service_pb2.OpenSessionRequest(
            request_id="r-1", worker_id="edge-01", executor_types=[1], max_concurrent_attempts=1
        )
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await runtime.OpenSession(
                runtime_service_pb2.OpenSessionRequest(request=open_session), timeout=TIMEOUT
            )
        assert unary.value.code() == grpc.StatusCode.UNIMPLEMENTED
        # A server-streaming RPC goes through the caller check's streaming path.
        watch = run_service_pb2.WatchRunEventsRequest(
            project_id="proj-a", run_id="7c9e6679-7425-40de-944b-e07fc1f90ae7"
        )
        stream = runtime.WatchRunEvents(
            runtime_service_pb2.WatchRunEventsRequest(request=watch), timeout=TIMEOUT
        )
        with pytest.raises(grpc.aio.AioRpcError) as streamed:
            async for _ in stream:
                pass
        assert streamed.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("caller", ["worker", "operator"])
async def test_control_refuses_runtime_calls_from_anyone_but_ingress(
    stack: Stack, identities: Identities, caller: str
) -> None:
    tls = identities.worker if caller == "worker" else identities.operator
    async with _channel(stack.control_address, tls) as channel:
        runtime = runtime_service_pb2_grpc.RuntimeServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await runtime.OpenSession(runtime_service_pb2.OpenSessionRequest(), timeout=TIMEOUT)
        assert unary.value.code() == grpc.StatusCode.PERMISSION_DENIED
        stream = runtime.WatchRunEvents(
            runtime_service_pb2.WatchRunEventsRequest(), timeout=TIMEOUT
        )
        with pytest.raises(grpc.aio.AioRpcError) as streamed:
            async for _ in stream:
                pass
        assert streamed.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_a_service_certificate_also_identifies_its_service_as_a_client(
    stack: Stack, identities: Identities
) -> None:
    # As in Kubernetes (deploy/k8s/certificates: server auth + client auth), a service's
    # certificate is also a client identity: its probe asks its own health over mTLS. It
    # is still only its own service's identity (control's runtime API admits ingress's).
    async with _channel(stack.control_address, identities.pki.ingress_server) as channel:
        assert await _health(channel, "") == "SERVING"
