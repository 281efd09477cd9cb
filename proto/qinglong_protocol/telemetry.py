"""OpenTelemetry for every QingLong process: one trace across worker -> ingress -> control.

`configure_telemetry` installs the process's tracer and meter providers. Export follows
the standard variables: with `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_TRACES_EXPORTER` /
`OTEL_METRICS_EXPORTER` = `otlp`) spans and metrics go to that collector. Without them
no SDK provider is installed, so nothing is recorded only to be thrown away (about a
quarter of a millisecond per call, measured with bench/bench_e2e.py --tracing), and a
laptop without a collector sees no connection errors; the API's no-op tracer still
passes the caller's trace context on (W3C `traceparent`), so a trace begun by a Worker
continues in whichever service does export. `OTEL_SERVICE_NAME`,
`OTEL_RESOURCE_ATTRIBUTES` and the SDK's `OTEL_TRACES_SAMPLER`/`OTEL_TRACES_SAMPLER_ARG`
are honoured; `OTEL_SDK_DISABLED=true` turns everything off.

Attributes are low-cardinality on metrics (method, outcome) and never carry a secret:
the gRPC instrumentation records method names and status codes, not message bodies.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Final

import grpc
from opentelemetry import metrics, trace
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor


def _wants(environ: Mapping[str, str], signal: str) -> bool:
    chosen = environ.get(f"OTEL_{signal}_EXPORTER")
    if chosen is not None:
        return "otlp" in chosen.split(",")
    return bool(environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def configure_telemetry(service_name: str, environ: Mapping[str, str] | None = None) -> None:
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return
    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME", service_name)})
    if _wants(env, "TRACES"):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        tracer_provider = TracerProvider(resource=resource)
        tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(tracer_provider)
    if _wants(env, "METRICS"):
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        readers: list[MetricReader] = [PeriodicExportingMetricReader(OTLPMetricExporter())]
        metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=readers))


#: The W3C trace context headers (gRPC metadata keys): what a hop that records nothing
#: passes on unchanged so that the trace continues beyond it.
TRACE_CONTEXT_KEYS: Final = ("traceparent", "tracestate")


def tracing_enabled() -> bool:
    """Whether this process records spans (an SDK tracer provider is installed)."""
    return isinstance(trace.get_tracer_provider(), TracerProvider)


def server_interceptors() -> Sequence[grpc.aio.ServerInterceptor]:
    """A server span per call, continuing the caller's trace (W3C traceparent); none
    when this process records no spans (the instrumentation would only cost time)."""
    if not tracing_enabled():
        return []
    interceptor: grpc.aio.ServerInterceptor = aio_server_interceptor()  # type: ignore[no-untyped-call]
    return [interceptor]


def client_interceptors() -> Sequence[grpc.aio.ClientInterceptor]:
    """A client span per call, propagating its context to the server; none when this
    process records no spans (see `trace_context_of` for passing a caller's on)."""
    if not tracing_enabled():
        return []
    interceptors: Sequence[grpc.aio.ClientInterceptor] = aio_client_interceptors()  # type: ignore[no-untyped-call]
    return list(interceptors)


def trace_context_of(
    metadata: Iterable[tuple[str, str | bytes]] | None,
) -> tuple[tuple[str, str], ...]:
    """The caller's trace context headers, to pass on from a hop that records nothing."""
    return tuple(
        (key, value if isinstance(value, str) else value.decode("ascii", "replace"))
        for key, value in metadata or ()
        if key in TRACE_CONTEXT_KEYS
    )
