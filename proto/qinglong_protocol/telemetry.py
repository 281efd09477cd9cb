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
are honoured (default ``parentbased_always_on``; docs/observability.md recommends
``parentbased_traceidratio`` in production); `OTEL_SDK_DISABLED=true` turns everything off.

Polling stays out of traces: a Worker calls PullOffers, RenewSession and ControlLease on
a timer whether or not anything happens, and traced they would be most of the spans.
Whatever the sampler, a span of one of those methods is recorded only inside a trace
that is already sampled (`PollingOutsideTraces`), so a poll never starts a trace — not at
the Worker, nor at ingress or control when the Worker does not trace. Such a poll does not
pass through the gRPC instrumentation at all (`instrumented_server_call`,
`instrumented_client_call`): its own work is most of what a traced call costs, and polls
are most calls. `QINGLONG_TRACE_POLLING=true` traces them like any other call.

Prometheus metrics are not OpenTelemetry's: see qinglong_protocol.metrics.

Attributes are low-cardinality on metrics (method, outcome) and never carry a secret:
the gRPC instrumentation records method names and status codes, not message bodies.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Final

import grpc
from opentelemetry import metrics, propagate, trace
from opentelemetry.context import Context
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    DEFAULT_OFF,
    DEFAULT_ON,
    ParentBasedTraceIdRatio,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, SpanKind, get_current_span
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import Attributes

_log = logging.getLogger(__name__)

#: WorkerService methods a Worker calls on a timer: kept out of traces unless a sampled
#: trace contains them (see the module's docstring).
POLLING_METHODS: Final = frozenset({"PullOffers", "RenewSession", "ControlLease"})
ENV_TRACE_POLLING: Final = "QINGLONG_TRACE_POLLING"
DEFAULT_SAMPLER: Final = "parentbased_always_on"


def _polling(method: str | bytes) -> bool:
    """Whether a gRPC method path (or span name) names a polling method. (The client's
    call details may carry the method as bytes.)"""
    name = method.decode("ascii", "replace") if isinstance(method, bytes) else method
    return name.rsplit("/", 1)[-1] in POLLING_METHODS


def _in_sampled_trace(context: Context | None) -> bool:
    parent = get_current_span(context).get_span_context()
    return parent.is_valid and parent.trace_flags.sampled


class PollingOutsideTraces(Sampler):
    """``inner``'s decision, except that a span of a polling method (`POLLING_METHODS`,
    by the gRPC span name's last part) is dropped unless its parent is sampled."""

    def __init__(self, inner: Sampler) -> None:
        self._inner = inner

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        if _polling(name) and not _in_sampled_trace(parent_context):
            return ALWAYS_OFF.should_sample(
                parent_context, trace_id, name, kind, attributes, links, trace_state
            )
        return self._inner.should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state
        )

    def get_description(self) -> str:
        return f"PollingOutsideTraces{{{self._inner.get_description()}}}"


def _ratio(argument: str | None) -> float:
    try:
        ratio = float(argument if argument is not None else "1.0")
    except ValueError:
        ratio = -1.0
    if not 0.0 <= ratio <= 1.0:
        _log.warning("OTEL_TRACES_SAMPLER_ARG must be a ratio in [0, 1]; using 1.0")
        return 1.0
    return ratio


def trace_sampler(environ: Mapping[str, str]) -> Sampler:
    """The sampler `OTEL_TRACES_SAMPLER`/`OTEL_TRACES_SAMPLER_ARG` name (as the SDK reads
    them), keeping polling out of traces unless `QINGLONG_TRACE_POLLING=true`."""
    name = environ.get("OTEL_TRACES_SAMPLER", DEFAULT_SAMPLER).strip().lower()
    argument = environ.get("OTEL_TRACES_SAMPLER_ARG")
    fixed: dict[str, Sampler] = {
        "always_on": ALWAYS_ON,
        "always_off": ALWAYS_OFF,
        "parentbased_always_on": DEFAULT_ON,
        "parentbased_always_off": DEFAULT_OFF,
    }
    inner: Sampler
    if name in fixed:
        inner = fixed[name]
    elif name == "traceidratio":
        inner = TraceIdRatioBased(_ratio(argument))
    elif name == "parentbased_traceidratio":
        inner = ParentBasedTraceIdRatio(_ratio(argument))
    else:
        _log.warning("unknown OTEL_TRACES_SAMPLER %r; using %s", name, DEFAULT_SAMPLER)
        inner = DEFAULT_ON
    if _tracing_polling(environ):
        return inner
    return PollingOutsideTraces(inner)


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

        tracer_provider = TracerProvider(resource=resource, sampler=trace_sampler(env))
        tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(tracer_provider)
    if _wants(env, "METRICS"):
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        readers: list[MetricReader] = [PeriodicExportingMetricReader(OTLPMetricExporter())]
        metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=readers))


_TRACE_CONTEXT: Final = TraceContextTextMapPropagator()

#: The W3C trace context headers (gRPC metadata keys): what a hop that records nothing
#: passes on unchanged so that the trace continues beyond it.
TRACE_CONTEXT_KEYS: Final = ("traceparent", "tracestate")


def tracing_enabled() -> bool:
    """Whether this process records spans (an SDK tracer provider is installed)."""
    return isinstance(trace.get_tracer_provider(), TracerProvider)


def _tracing_polling(environ: Mapping[str, str]) -> bool:
    return environ.get(ENV_TRACE_POLLING, "").strip().lower() == "true"


def instrumented_server_call(details: grpc.HandlerCallDetails) -> bool:
    """Server side: whether the instrumentation should see a call at all. A poll outside
    a sampled trace would make a span the sampler drops (`PollingOutsideTraces`), and
    the instrumentation's own work (context, attributes, wrappers) is most of what a
    traced call costs: polls are most calls, so they skip it."""
    if not _polling(details.method):
        return True
    carrier = {
        key: value for key, value in details.invocation_metadata or () if isinstance(value, str)
    }
    return _in_sampled_trace(propagate.extract(carrier))


def instrumented_client_call(details: grpc.aio.ClientCallDetails) -> bool:
    """Client side, likewise: a poll is instrumented only inside a sampled trace."""
    return not _polling(details.method) or _in_sampled_trace(None)


def _keeps_polls_out(provider: object) -> bool:
    """Whether ``provider`` samples as `trace_sampler` does by default: polls only inside
    a sampled trace. The instrumentation then skips polls outside one, so whether polls
    are traced is decided once, where the sampler is made (`QINGLONG_TRACE_POLLING`)."""
    return isinstance(getattr(provider, "sampler", None), PollingOutsideTraces)


#: Services the server instrumentation never wraps: gRPC's own health and reflection
#: servicers answer their streams by writing to the context from a coroutine, and the
#: OpenTelemetry aio interceptor iterates every stream handler's result, so a wrapped
#: Health/Watch failed UNKNOWN ("'async for' requires an object with __aiter__") on
#: every listener of a process that records spans. Probes are no trace's business
#: anyway.
UNTRACED_SERVICES: Final = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1.ServerReflection/",
    "/grpc.reflection.v1alpha.ServerReflection/",
)


def traced_server_call(details: grpc.HandlerCallDetails) -> bool:
    """Whether the server instrumentation wraps a call at all: never a health check or
    reflection (`UNTRACED_SERVICES`)."""
    return not details.method.startswith(UNTRACED_SERVICES)


def server_interceptors() -> Sequence[grpc.aio.ServerInterceptor]:
    """A server span per call, continuing the caller's trace (W3C traceparent); none
    when this process records no spans (the instrumentation would only cost time). Health
    checks and reflection are not instrumented (`traced_server_call`), nor, when the
    sampler keeps polls out of traces, a poll outside a sampled trace
    (`instrumented_server_call`)."""
    if not tracing_enabled():
        return []
    provider = trace.get_tracer_provider()
    polls_out = _keeps_polls_out(provider)

    def chosen(details: grpc.HandlerCallDetails) -> bool:
        if not traced_server_call(details):
            return False
        return instrumented_server_call(details) if polls_out else True

    interceptor: grpc.aio.ServerInterceptor = aio_server_interceptor(filter_=chosen)  # type: ignore[no-untyped-call]
    return [interceptor]


def client_interceptors(
    tracer_provider: TracerProvider | None = None,
) -> Sequence[grpc.aio.ClientInterceptor]:
    """A client span per call, propagating its context to the server; none when no
    spans are recorded (by `tracer_provider`, else this process's). A poll outside a
    sampled trace is not instrumented when the sampler keeps polls out of traces. (A hop
    that is itself a server passes a context on instead: `current_trace_context`, or
    `trace_context_of` when it records nothing.)"""
    if tracer_provider is None and not tracing_enabled():
        return []
    provider = tracer_provider or trace.get_tracer_provider()
    chosen = instrumented_client_call if _keeps_polls_out(provider) else None
    interceptors: Sequence[grpc.aio.ClientInterceptor] = aio_client_interceptors(  # type: ignore[no-untyped-call]
        tracer_provider=tracer_provider, filter_=chosen
    )
    return list(interceptors)


def current_trace_context() -> tuple[tuple[str, str], ...]:
    """The W3C trace context of this process's current span (a server span: the call
    being answered), as gRPC metadata for a call made on its behalf. Always W3C, whatever
    OTEL_PROPAGATORS says: the receiving service must keep `tracecontext` among its
    propagators (the default) to continue the trace."""
    carrier: dict[str, str] = {}
    # W3C trace context only, as `trace_context_of` passes on: baggage a caller sent does
    # not travel further whichever way ingress is configured.
    _TRACE_CONTEXT.inject(carrier)
    return tuple(carrier.items())


# W3C Trace Context (level 1), the only version a hop passes on: "00-" trace id (32 hex)
# "-" parent id (16 hex) "-" flags (2 hex), lowercase; all-zero ids are invalid.
_TRACEPARENT: Final = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
# One tracestate list member: a key (simple, or tenant@system) "=" a value of printable
# ASCII without "," and "=" that does not end in a space.
_TRACESTATE_MEMBER: Final = re.compile(
    r"(?:[a-z][_0-9a-z*/-]{0,255}|[a-z0-9][_0-9a-z*/-]{0,240}@[a-z][_0-9a-z*/-]{0,13})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
)
#: The most a hop passes on of a caller's tracestate: W3C's 32 list members, and 512
#: characters, what the spec asks every vendor to propagate at least.
TRACESTATE_MAX_MEMBERS: Final = 32
TRACESTATE_MAX_CHARS: Final = 512


def trace_context_of(
    metadata: Iterable[tuple[str, str | bytes]] | None,
) -> tuple[tuple[str, str], ...]:
    """The caller's trace context headers, to pass on from a hop that records nothing —
    only if well-formed: a caller's metadata is untrusted, and a hop that passes it on
    unread would carry anything a caller wrote (any length, any bytes) into the next
    service's spans and logs. A `traceparent` that is not W3C's is dropped with its
    `tracestate` (the trace then starts at the next hop that records), and a `tracestate`
    that is malformed or over W3C's bounds is dropped alone (it is optional). Nothing is
    logged: a caller must not be able to write into this process's log."""
    parent: str | None = None
    states: list[str] = []
    for key, raw in metadata or ():
        if key not in TRACE_CONTEXT_KEYS:
            continue
        value = raw if isinstance(raw, str) else raw.decode("ascii", "replace")
        if key == "tracestate":
            states.append(value)
        elif parent is None:
            parent = value
        else:  # two traceparents: which one the caller meant is unknown
            return ()
    if parent is None or _TRACEPARENT.fullmatch(parent) is None:
        return ()
    state = _tracestate(states)
    passed = (("traceparent", parent),)
    return passed if state is None else (*passed, ("tracestate", state))


def _tracestate(headers: Sequence[str]) -> str | None:
    """The headers as one W3C tracestate (RFC 9110 joins repeated fields with ","), or
    None when there is none or it is not one this hop passes on."""
    joined = ",".join(headers)
    if not joined or len(joined) > TRACESTATE_MAX_CHARS:
        return None
    members = [member.strip(" \t") for member in joined.split(",")]
    members = [member for member in members if member]
    keys = [member.partition("=")[0] for member in members]
    if (
        not members
        or len(members) > TRACESTATE_MAX_MEMBERS
        or len(set(keys)) != len(keys)
        or any(_TRACESTATE_MEMBER.fullmatch(member) is None for member in members)
    ):
        return None
    return ",".join(members)
