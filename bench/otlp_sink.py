"""An OTLP/gRPC collector for bench_e2e.py --tracing, in a process of its own.

It stands for the collector a production deployment runs elsewhere: during the
measurement it only keeps each export's bytes and answers, so its work costs the
processes being measured as little as a collector on this machine can (before, it ran
in the bench's own process and parsed every span there, holding the interpreter lock the
bench's Worker client needs). When its stdin closes, it parses what it kept, prints one
JSON line and exits:

    {"spans_by_service": {...}, "traces": [[service, ...], ...], "metric_exports": N}

    python bench/otlp_sink.py        # prints the port it listens on (127.0.0.1, plaintext)
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter, defaultdict

import grpc
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.resource.v1 import resource_pb2

TRACES = "opentelemetry.proto.collector.trace.v1.TraceService"
METRICS = "opentelemetry.proto.collector.metrics.v1.MetricsService"


def service_name(resource: resource_pb2.Resource) -> str:
    for attribute in resource.attributes:
        if attribute.key == "service.name":
            return str(attribute.value.string_value)
    return "?"


def summary(trace_exports: list[bytes], metric_exports: int) -> dict[str, object]:
    """Spans by service, and the services each trace reached."""
    by_service: Counter[str] = Counter()
    services_of: defaultdict[bytes, set[str]] = defaultdict(set)
    for raw in trace_exports:
        request = ExportTraceServiceRequest.FromString(raw)
        for resource_spans in request.resource_spans:
            service = service_name(resource_spans.resource)
            for scope_spans in resource_spans.scope_spans:
                by_service[service] += len(scope_spans.spans)
                for span in scope_spans.spans:
                    services_of[span.trace_id].add(service)
    return {
        "spans_by_service": dict(by_service),
        "traces": [sorted(services) for services in services_of.values()],
        "metric_exports": metric_exports,
    }


async def main() -> None:
    trace_exports: list[bytes] = []
    metric_exports = 0
    trace_answer = ExportTraceServiceResponse().SerializeToString()
    metric_answer = ExportMetricsServiceResponse().SerializeToString()

    async def export_traces(request: bytes, context: object) -> bytes:
        trace_exports.append(request)
        return trace_answer

    async def export_metrics(request: bytes, context: object) -> bytes:
        nonlocal metric_exports
        metric_exports += 1
        return metric_answer

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                TRACES, {"Export": grpc.unary_unary_rpc_method_handler(export_traces)}
            ),
            grpc.method_handlers_generic_handler(
                METRICS, {"Export": grpc.unary_unary_rpc_method_handler(export_metrics)}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    # Serve until the bench closes stdin (after both stacks flushed their last spans).
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(None)
    print(json.dumps(summary(trace_exports, metric_exports)), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
