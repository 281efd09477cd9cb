"""SPEC R-OPS-3 without servers: the metrics flags, the Grafana dashboard's queries, the
Worker's start-phase clock, and the sampler that keeps polling out of traces."""

from __future__ import annotations

import json
import re
from collections import namedtuple
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import Decision
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from prometheus_client import REGISTRY
from qinglong_control.metrics import RECONCILE_KINDS
from qinglong_control.reconciler import CycleReport
from qinglong_control.settings import parse_control_settings
from qinglong_ingress.settings import parse_ingress_settings
from qinglong_protocol.metrics import MetricsEndpoint
from qinglong_protocol.telemetry import (
    client_interceptors,
    instrumented_client_call,
    instrumented_server_call,
    trace_sampler,
)
from qinglong_worker.metrics import START_PHASE_DURATION, StartPhases
from qinglong_worker.settings import parse_worker_settings

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "qinglong.json"
_METRIC = re.compile(r"\bqinglong_[a-z_]+")
_SUFFIXES = ("_bucket", "_count", "_sum", "_total")

TLS = ["--tls-ca", "ca.pem", "--tls-cert", "c.pem", "--tls-key", "k.pem"]
INGRESS = [*TLS, "--control-address", "c:1", "--control-tls-cert", "c", "--control-tls-key", "k"]
WORKER = ["run", "--worker-id", "w", "--ingress-address", "i:1", *TLS, "--inbox", "/tmp/i.db"]


def _registered() -> set[str]:
    """Every metric family this process's modules define (control, ingress, Worker, pools)."""
    import qinglong_ingress.metrics  # noqa: F401 - registers ingress's metrics

    return {family.name for family in REGISTRY.collect()}


def _families_in(expression: str) -> set[str]:
    names = set()
    for name in _METRIC.findall(expression):
        for suffix in _SUFFIXES:
            if name.endswith(suffix):
                name = name.removesuffix(suffix)
                break
        names.add(name)
    return names


def test_every_dashboard_query_names_metrics_that_exist() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    registered = _registered()
    titles = [panel["title"] for panel in dashboard["panels"]]
    for wanted in ("ACK latency", "Fence rejections", "Throughput", "pool saturation"):
        assert any(wanted.lower() in title.lower() for title in titles), wanted
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            named = _families_in(target["expr"])
            assert named, (panel["title"], target["expr"])
            assert named <= registered, (panel["title"], named - registered)


def test_every_listed_metric_family_is_registered() -> None:
    assert _registered() >= {
        "qinglong_control_call_duration_seconds",
        "qinglong_control_fence_rejections",
        "qinglong_control_reconcile_cycle_seconds",
        "qinglong_control_reconcile_work",
        "qinglong_ingress_call_duration_seconds",
        "qinglong_ingress_audit_write_duration_seconds",
        "qinglong_ingress_audit_batch_rows",
        "qinglong_worker_call_duration_seconds",
        "qinglong_worker_fence_rejections",
        "qinglong_worker_start_phase_seconds",
        "qinglong_pool_connections",
        "qinglong_pool_connections_idle",
        "qinglong_pool_connections_max",
        "qinglong_pool_requests_waiting",
    }


def test_reconcile_kinds_are_the_cycle_report_fields() -> None:
    assert tuple(field.name for field in fields(CycleReport)) == RECONCILE_KINDS


def test_metrics_are_off_unless_a_port_is_given() -> None:
    assert parse_control_settings(TLS, {}).metrics is None
    assert parse_ingress_settings(INGRESS, {}).metrics is None
    daemon = parse_worker_settings(WORKER, {})[1].daemon
    assert daemon is not None
    assert daemon.metrics is None


def test_the_flag_wins_over_the_variable() -> None:
    env = {"QINGLONG_CONTROL_METRICS_PORT": "9090", "QINGLONG_CONTROL_METRICS_ADDRESS": "::"}
    assert parse_control_settings(TLS, env).metrics == MetricsEndpoint(9090, "::")
    flagged = parse_control_settings([*TLS, "--metrics-port", "9191"], env).metrics
    assert flagged == MetricsEndpoint(9191, "::")
    ingress = parse_ingress_settings(INGRESS, {"QINGLONG_INGRESS_METRICS_PORT": "0"}).metrics
    assert ingress == MetricsEndpoint(0)
    daemon = parse_worker_settings(WORKER, {"QINGLONG_WORKER_METRICS_PORT": "9092"})[1].daemon
    assert daemon is not None
    assert daemon.metrics == MetricsEndpoint(9092)


def test_a_port_out_of_range_is_a_usage_error() -> None:
    with pytest.raises(SystemExit):
        parse_control_settings([*TLS, "--metrics-port", "70000"], {})


def _observed(phase: str) -> float:
    value = REGISTRY.get_sample_value("qinglong_worker_start_phase_seconds_count", {"phase": phase})
    return value or 0.0


def test_start_phases_measure_claim_to_starting_to_running() -> None:
    assert START_PHASE_DURATION is not None
    now = [100.0]
    phases = StartPhases(clock=lambda: now[0], limit=2)
    before = (_observed("claim_to_starting"), _observed("starting_to_running"))
    phases.claimed("offer-1")
    now[0] += 0.25
    phases.starting("offer-1")
    now[0] += 0.5
    phases.running("offer-1")
    phases.running("offer-1")  # a replay is not measured twice
    phases.starting("never-claimed-here")  # claimed by an earlier process: not measured
    for offer in ("a", "b", "c"):  # the oldest is forgotten beyond the limit
        phases.claimed(offer)
    phases.starting("a")
    after = (_observed("claim_to_starting"), _observed("starting_to_running"))
    assert (after[0] - before[0], after[1] - before[1]) == (1.0, 1.0)


def _decision(environ: dict[str, str], name: str, parent_sampled: bool | None) -> Decision:
    context = None
    if parent_sampled is not None:
        flags = TraceFlags(TraceFlags.SAMPLED if parent_sampled else TraceFlags.DEFAULT)
        span = NonRecordingSpan(SpanContext(1, 2, is_remote=True, trace_flags=flags))
        context = trace.set_span_in_context(span)
    return trace_sampler(environ).should_sample(context, 3, name).decision


POLL = "/qinglong.worker.v1.WorkerService/PullOffers"
CLAIM = "/qinglong.worker.v1.WorkerService/ClaimOffer"


def test_polls_start_no_trace_and_join_a_sampled_one() -> None:
    assert _decision({}, POLL, None) is Decision.DROP
    assert _decision({}, "/qinglong.runtime.v1.RuntimeService/RenewSession", None) is Decision.DROP
    assert _decision({}, "/qinglong.worker.v1.WorkerService/ControlLease", False) is Decision.DROP
    assert _decision({}, POLL, True) is Decision.RECORD_AND_SAMPLE
    assert _decision({}, CLAIM, None) is Decision.RECORD_AND_SAMPLE
    assert _decision({"OTEL_TRACES_SAMPLER": "always_on"}, POLL, None) is Decision.DROP
    assert _decision({"QINGLONG_TRACE_POLLING": "true"}, POLL, None) is Decision.RECORD_AND_SAMPLE


def test_the_standard_sampler_variables_are_honoured() -> None:
    ratio = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"}
    assert "0.25" in trace_sampler(ratio).get_description()
    assert _decision({"OTEL_TRACES_SAMPLER": "always_off"}, CLAIM, None) is Decision.DROP
    assert _decision({"OTEL_TRACES_SAMPLER": "parentbased_always_on"}, CLAIM, False) is (
        Decision.DROP
    )
    bad = {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "often"}
    assert "1.0" in trace_sampler(bad).get_description()
    assert "ParentBased" in trace_sampler({"OTEL_TRACES_SAMPLER": "nonsense"}).get_description()


_ServerCall = namedtuple("_ServerCall", ["method", "invocation_metadata"])
_ClientCall = namedtuple("_ClientCall", ["method", "timeout", "metadata", "credentials"])


def _traceparent(sampled: bool) -> tuple[str, str]:
    return ("traceparent", f"00-{'ab' * 16}-{'cd' * 8}-{'01' if sampled else '00'}")


def test_polls_outside_a_sampled_trace_skip_the_instrumentation() -> None:
    """The gRPC instrumentation's own work is most of what a traced call costs; a poll the
    sampler would drop (above) does not get it at all — at a server, by the caller's
    traceparent; at a client, by the current span."""
    auth = ("authorization", "Bearer x")
    assert instrumented_server_call(_ServerCall(CLAIM, ()))
    assert not instrumented_server_call(_ServerCall(POLL, (auth,)))
    assert not instrumented_server_call(_ServerCall(POLL, (auth, _traceparent(False))))
    assert instrumented_server_call(_ServerCall(POLL, (auth, _traceparent(True))))
    assert not instrumented_server_call(
        _ServerCall("/qinglong.runtime.v1.RuntimeService/ControlLease", None)
    )

    assert instrumented_client_call(_ClientCall(CLAIM.encode(), None, None, None))
    assert not instrumented_client_call(_ClientCall(POLL.encode(), None, None, None))
    assert not instrumented_client_call(_ClientCall(POLL, None, None, None))
    for sampled in (False, True):
        flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
        parent = NonRecordingSpan(SpanContext(1, 2, is_remote=False, trace_flags=flags))
        with trace.use_span(parent):
            assert instrumented_client_call(_ClientCall(POLL, None, None, None)) is sampled


def test_whether_polls_skip_the_instrumentation_follows_the_sampler() -> None:
    """Decided once, where the sampler is made: polls traced (QINGLONG_TRACE_POLLING) means
    no filter; kept out of traces means the filter."""
    kept_out = TracerProvider(sampler=trace_sampler({}))
    traced = TracerProvider(sampler=trace_sampler({"QINGLONG_TRACE_POLLING": "true"}))
    assert [_filter_of(client_interceptors(tracer_provider=kept_out))] == [True]
    assert [_filter_of(client_interceptors(tracer_provider=traced))] == [False]


def _filter_of(interceptors: Sequence[object]) -> bool:
    filters = {getattr(interceptor, "_filter", None) for interceptor in interceptors}
    assert len(filters) == 1
    return filters.pop() is instrumented_client_call
