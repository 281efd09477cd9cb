"""SPEC B-OBS: one trace per call across worker -> ingress -> control -> database, and a
latency histogram with low-cardinality attributes. In-memory exporters, real servers, and
the sampler `configure_telemetry` installs by default: polling starts no trace."""

from __future__ import annotations

import secrets
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from qinglong.control.v1 import run_service_pb2, run_service_pb2_grpc
from qinglong.rpc.v1 import execution_pb2
from qinglong.worker.v1 import worker_service_pb2, worker_service_pb2_grpc
from qinglong_control.db.pool import PoolSizing, open_runtime_pool
from qinglong_control.reconciler import Reconciler, ReconcilerLimits
from qinglong_protocol.bounds import encode_lease_capability
from qinglong_protocol.telemetry import client_interceptors, trace_sampler
from qinglong_protocol.tls import mutual_tls_channel_credentials

from tests.support.calls import opened_session
from tests.support.postgres import MigratedDatabase
from tests.support.stack import PROJECT, Stack, running_stack


@pytest.fixture(scope="module")
def telemetry() -> tuple[InMemorySpanExporter, InMemoryMetricReader]:
    spans = InMemorySpanExporter()
    # The sampler configure_telemetry installs when nothing overrides it.
    tracer_provider = TracerProvider(sampler=trace_sampler({}))
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    trace.set_tracer_provider(tracer_provider)
    reader = InMemoryMetricReader()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    return spans, reader


@pytest.fixture
async def stack(
    telemetry: Any, database_pg18: MigratedDatabase, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    async with running_stack(database_pg18, tmp_path_factory.mktemp("pki")) as running:
        yield running


def traced_channel(stack: Stack, worker_id: str) -> grpc.aio.Channel:
    return grpc.aio.secure_channel(
        stack.ingress_address,
        mutual_tls_channel_credentials(stack.worker_identity(worker_id)),
        interceptors=client_interceptors(),
    )


def _by_name(spans: list[ReadableSpan], fragment: str) -> list[ReadableSpan]:
    return [span for span in spans if fragment in span.name]


def _command_durations(reader: InMemoryMetricReader) -> list[dict[str, Any]]:
    data = reader.get_metrics_data()
    return [
        dict(point.attributes or {})
        for resource in (data.resource_metrics if data is not None else [])
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == "qinglong.control.command.duration"
        for point in metric.data.data_points
    ]


async def test_one_trace_from_worker_to_database(
    stack: Stack, telemetry: tuple[InMemorySpanExporter, InMemoryMetricReader]
) -> None:
    exporter, reader = telemetry
    exporter.clear()
    async with traced_channel(stack, "worker-a") as channel:
        await worker_service_pb2_grpc.WorkerServiceStub(channel).OpenSession(
            worker_service_pb2.OpenSessionRequest(
                request_id=uuid.uuid4().hex,
                worker_id="worker-a",
                executor_types=[execution_pb2.EXECUTOR_TYPE_REMOTE_WORKER],
                max_concurrent_attempts=1,
            )
        )
    spans = list(exporter.get_finished_spans())
    public = _by_name(spans, "qinglong.worker.v1.WorkerService/OpenSession")
    internal = _by_name(spans, "qinglong.runtime.v1.RuntimeService/OpenSession")
    database = _by_name(spans, "qinglong.db.transaction")
    assert len(public) == 2  # the worker's client span and ingress's server span
    # Control's server span, a child of ingress's: ingress records no span of its forward.
    assert len(internal) == 1
    assert len(database) == 1
    chain = [*public, *internal, *database]
    assert len({span.context.trace_id for span in chain}) == 1, "one propagated trace"
    ids = {span.context.span_id for span in chain}
    roots = [span for span in chain if span.parent is None]
    assert [root.kind for root in roots] == [trace.SpanKind.CLIENT], "the worker's call is the root"
    assert all(span.parent.span_id in ids for span in chain if span.parent is not None)
    (ingress,) = [span for span in public if span.kind == trace.SpanKind.SERVER]
    assert internal[0].parent is not None
    assert internal[0].parent.span_id == ingress.context.span_id, "control continues ingress's"
    assert "lock.worker" in str(database[0].attributes.get("qinglong.db.statements"))

    recorded = _command_durations(reader)
    assert {"rpc.method": "OpenSession", "outcome": "ok"} in recorded
    assert all(set(attributes) == {"rpc.method", "outcome"} for attributes in recorded)


async def test_a_refused_calls_spans_carry_its_code_and_no_secret(
    stack: Stack, telemetry: tuple[InMemorySpanExporter, InMemoryMetricReader]
) -> None:
    exporter, _ = telemetry
    exporter.clear()
    capability = encode_lease_capability(secrets.token_bytes(32))
    async with traced_channel(stack, "worker-a") as channel:
        worker = worker_service_pb2_grpc.WorkerServiceStub(channel)
        session = await opened_session(worker, "worker-a")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await worker.ClaimOffer(
                worker_service_pb2.ClaimOfferRequest(
                    worker_id="worker-a",
                    session_id=session.session_id,
                    worker_generation=session.worker_generation,
                    offer_id=str(uuid.uuid4()),
                    project_id=PROJECT,
                    run_id=str(uuid.uuid4()),
                    lease_token=capability,
                )
            )
    spans = list(exporter.get_finished_spans())
    exported = repr([(s.name, s.attributes, s.events, s.status) for s in spans])
    assert "ClaimOffer" in exported
    assert capability not in exported
    code = refused.value.code()
    assert code is grpc.StatusCode.NOT_FOUND
    servers = [
        span for span in _by_name(spans, "/ClaimOffer") if span.kind == trace.SpanKind.SERVER
    ]
    # Ingress's and control's: each records the code it answered (or relayed). (The
    # span's status stays unset for NOT_FOUND: OpenTelemetry marks a server span ERROR
    # only for the codes that mean a fault of the server.)
    assert len(servers) == 2
    for span in servers:
        assert span.attributes is not None
        assert span.attributes.get("rpc.grpc.status_code") == code.value[0], span.name


async def test_every_runtime_method_is_timed_in_one_place_unary_and_streaming(
    stack: Stack, telemetry: tuple[InMemorySpanExporter, InMemoryMetricReader]
) -> None:
    """Control's error interceptor records the histogram for each method, the outcome
    being the reason it answered: a refusal inside a stream is timed like a unary one."""
    _, reader = telemetry
    meta = (("authorization", f"Bearer {stack.tokens['vera']}"),)
    missing = str(uuid.uuid4())
    async with stack.channel(stack.operator_identity("ops")) as channel:
        runs = run_service_pb2_grpc.RunServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError):
            await runs.GetRun(
                run_service_pb2.GetRunRequest(project_id=PROJECT, run_id=missing), metadata=meta
            )
        with pytest.raises(grpc.aio.AioRpcError):
            async for _ in runs.WatchRunEvents(
                run_service_pb2.WatchRunEventsRequest(project_id=PROJECT, run_id=missing),
                metadata=meta,
                timeout=10,
            ):
                pass
    recorded = _command_durations(reader)
    assert {"rpc.method": "GetRun", "outcome": "RUN_NOT_FOUND"} in recorded
    assert {"rpc.method": "WatchRunEvents", "outcome": "RUN_NOT_FOUND"} in recorded
    assert all(set(attributes) == {"rpc.method", "outcome"} for attributes in recorded)


async def test_polling_starts_no_trace_but_is_traced_inside_one(
    stack: Stack, telemetry: tuple[InMemorySpanExporter, InMemoryMetricReader]
) -> None:
    """A Worker's PullOffers on its own is recorded nowhere — not by the Worker, ingress,
    control or the database — so idle polling cannot flood the traces; the same call made
    inside a sampled trace (someone debugging) is recorded at every hop of that trace."""
    exporter, _ = telemetry
    async with traced_channel(stack, "worker-a") as channel:
        worker = worker_service_pb2_grpc.WorkerServiceStub(channel)
        session = await opened_session(worker, "worker-a")
        pull = worker_service_pb2.PullOffersRequest(
            worker_id="worker-a",
            session_id=session.session_id,
            worker_generation=session.worker_generation,
            max_offers=1,
        )
        exporter.clear()
        for _ in range(3):
            await worker.PullOffers(pull)
        assert list(exporter.get_finished_spans()) == [], "an idle poll recorded spans"

        with trace.get_tracer("test").start_as_current_span("debugging") as parent:
            await worker.PullOffers(pull)
    spans = list(exporter.get_finished_spans())
    assert len(_by_name(spans, "WorkerService/PullOffers")) == 2  # worker and ingress
    assert len(_by_name(spans, "RuntimeService/PullOffers")) == 1  # control (ingress's is above)
    assert _by_name(spans, "qinglong.db.transaction")
    assert {span.context.trace_id for span in spans} == {parent.get_span_context().trace_id}


async def test_a_reconcile_cycle_starts_no_trace(
    stack: Stack, telemetry: tuple[InMemorySpanExporter, InMemoryMetricReader]
) -> None:
    """The reconciler runs on a timer, like a poll: its transactions (each cycle reads a
    page of Runs to converge in one, idle or not) are not a trace of their own each; its
    work is in the reconcile metrics."""
    exporter, _ = telemetry
    async with await open_runtime_pool(
        stack.database.urls.runtime, sizing=PoolSizing(1, 2)
    ) as pool:
        exporter.clear()
        report = await Reconciler(pool, ReconcilerLimits()).cycle()
    assert report.pages >= 1, "the cycle read nothing: the test would prove nothing"
    assert list(exporter.get_finished_spans()) == []


async def test_health_watch_works_on_every_listener_of_a_traced_process(stack: Stack) -> None:
    """This process records spans (the module's fixture), so ingress's listeners carry the
    OpenTelemetry server interceptor. gRPC's own Health servicer answers Watch by writing
    from a coroutine, which the interceptor cannot wrap: unless health is left out of
    tracing, Watch failed UNKNOWN on the mutual-TLS listener, and the enrollment
    listener's refusal (UNIMPLEMENTED) came back UNKNOWN too."""
    request = health_pb2.HealthCheckRequest(service="")
    async with grpc.aio.secure_channel(
        stack.ingress_address, mutual_tls_channel_credentials(stack.worker_identity("worker-a"))
    ) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(request, timeout=5)
        first = await watch.read()
        watch.cancel()
    assert first.status == health_pb2.HealthCheckResponse.SERVING
    credentials = grpc.ssl_channel_credentials(root_certificates=stack.pki.ca_cert.read_bytes())
    async with grpc.aio.secure_channel(stack.enrollment_address, credentials) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in health_pb2_grpc.HealthStub(channel).Watch(request, timeout=5):
                pass
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
