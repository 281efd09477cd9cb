"""SPEC R-OPS-3 on the in-process stack (control and ingress in this process, real mTLS
on loopback): the scrape endpoint serves what the calls recorded, parsed with
`prometheus_client.parser` — a fence refusal is counted by method and reason, each call's
latency by method and outcome, and the pools' usage by pool name."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from qinglong.worker.v1 import worker_pb2, worker_service_pb2, worker_service_pb2_grpc
from qinglong_protocol.metrics import LABELS, MetricsEndpoint, MetricsServer, serve_metrics

from tests.support.calls import opened_session
from tests.support.stack import Stack
from tests.support.worker_steps import running_attempt


@pytest.fixture
def endpoint() -> Iterator[MetricsServer]:
    server = serve_metrics(MetricsEndpoint(0, "127.0.0.1"), "test")
    try:
        yield server
    finally:
        server.close()


def samples(server: MetricsServer) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    url = f"http://127.0.0.1:{server.port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _value(
    scraped: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return scraped.get((name, frozenset(labels.items())), 0.0)


async def test_a_fence_refusal_is_counted_by_method_and_reason(
    stack: Stack, endpoint: MetricsServer
) -> None:
    before = samples(endpoint)
    async with stack.channel(stack.worker_identity("worker-a")) as channel:
        worker = worker_service_pb2_grpc.WorkerServiceStub(channel)
        session = await opened_session(worker, "worker-a")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await worker.RenewSession(
                worker_service_pb2.RenewSessionRequest(
                    worker_id="worker-a",
                    session_id=session.session_id,
                    worker_generation=session.worker_generation + 1,
                )
            )
    assert refused.value.code() is grpc.StatusCode.ABORTED
    after = samples(endpoint)

    def grew(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    fence = "qinglong_control_fence_rejections_total"
    assert grew(fence, method="RenewSession", reason="SESSION_FENCED") == 1
    control = "qinglong_control_call_duration_seconds_count"
    assert grew(control, method="OpenSession", outcome="ok") == 1
    assert grew(control, method="RenewSession", outcome="SESSION_FENCED") == 1
    ingress = "qinglong_ingress_call_duration_seconds_count"
    assert grew(ingress, method="OpenSession", outcome="ok") == 1
    assert grew(ingress, method="RenewSession", outcome="ABORTED") == 1
    assert grew("qinglong_ingress_audit_write_duration_seconds_count", outcome="ok") >= 1
    assert grew("qinglong_ingress_audit_batch_rows_sum") >= 2
    for pool in ("qinglong-ingress", "qinglong-runtime"):
        assert _value(after, "qinglong_pool_connections_max", pool=pool) >= 1, pool
        assert grew("qinglong_pool_requests_total", pool=pool) >= 1, pool
    # Only the allowed, low-cardinality labels, and no id among their values.
    session_id = session.session_id
    for name, labels in after:
        if name.startswith("qinglong_"):
            assert {key for key, _ in labels} <= LABELS
            assert all(session_id not in value for _, value in labels)


async def test_a_completion_is_counted_once_though_its_report_is_replayed(
    stack: Stack, endpoint: MetricsServer
) -> None:
    # The dashboard's "attempts completed": a Worker that lost the first answer sends the
    # same report again, and the Attempt ended once.
    before = samples(endpoint)
    async with stack.channel(stack.worker_identity("worker-a")) as channel:
        worker = worker_service_pb2_grpc.WorkerServiceStub(channel)
        fence = await running_attempt(stack, worker)
        report = worker_service_pb2.CompleteAttemptRequest(
            fence=fence,
            callback_sequence=1,
            outcome=worker_pb2.ATTEMPT_OUTCOME_SUCCEEDED,
            exit_code=0,
        )
        first = await worker.CompleteAttempt(report)
        again = await worker.CompleteAttempt(report)
    assert (first.outcome, again.outcome) == (
        worker_pb2.COMPLETION_OUTCOME_COMPLETED,
        worker_pb2.COMPLETION_OUTCOME_ALREADY_COMPLETED,
    )
    after = samples(endpoint)
    name = "qinglong_control_attempts_completed_total"
    grew = _value(after, name, state="succeeded") - _value(before, name, state="succeeded")
    assert grew == 1
