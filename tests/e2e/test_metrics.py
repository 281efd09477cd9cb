"""SPEC R-OPS-3: control, ingress and the Worker serve Prometheus metrics on an opt-in port.

A real `qinglong up` (control and ingress as processes, their metrics ports given by the
environment) and a real `qinglong-worker run --metrics-port 0`; after one Run succeeds,
each endpoint is scraped over HTTP on loopback and parsed with `prometheus_client.parser`:
every metric R-OPS-3 lists is there, with only low-cardinality labels — no run, attempt,
offer, session or worker id, no token in any label or value name.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from qinglong.rpc.v1 import lifecycle_pb2
from qinglong_protocol.metrics import LABELS

from tests.support.devstack_process import DevStack, dev_stack
from tests.support.operator_client import OperatorClient
from tests.support.worker_process import WorkerProcess

RUN_TIMEOUT_SECONDS = 60.0
_ENDPOINT = re.compile(r"metrics on http://[^ ]+:(\d+)/metrics")
#: Anything that looks like an id: a UUID, or a long run of hex/base64 characters.
_ID_LIKE = re.compile(
    r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[A-Za-z0-9_\-]{32,}"
)

CONTROL_METRICS = {
    "qinglong_control_call_duration_seconds",  # call latency by method and outcome
    "qinglong_control_fence_rejections",  # by method and reason
    "qinglong_control_reconcile_cycle_seconds",  # convergence/expiry cycle
    "qinglong_control_reconcile_work",  # work per cycle, by kind
    "qinglong_control_output_bytes_stored",  # Run output (R-OPS-1)
    "qinglong_control_attempts_completed",  # by end state, each Attempt once
    "qinglong_control_queued_runs",  # by part of the queue, sampled
    "qinglong_control_oldest_queued_run_age_seconds",
    "qinglong_pool_connections",  # pool usage
    "qinglong_pool_connections_idle",
    "qinglong_pool_connections_max",
    "qinglong_pool_requests_waiting",
    "qinglong_pool_requests",
    "qinglong_pool_requests_wait_seconds",
}
INGRESS_METRICS = {
    "qinglong_ingress_call_duration_seconds",
    "qinglong_ingress_audit_write_duration_seconds",  # audit write latency
    "qinglong_ingress_audit_batch_rows",
    "qinglong_pool_connections",
    "qinglong_pool_connections_idle",
    "qinglong_pool_connections_max",
    "qinglong_pool_requests_waiting",
}
WORKER_METRICS = {
    "qinglong_worker_call_duration_seconds",
    "qinglong_worker_start_phase_seconds",  # claim -> starting -> running
    "qinglong_worker_fence_rejections",
}


@pytest.fixture(scope="module")
def stack() -> Iterator[DevStack]:
    # Not under pytest's basetemp (another session may prune it while PostgreSQL runs).
    root = Path(tempfile.mkdtemp(prefix="qinglong-metrics-"))
    environment = {
        "QINGLONG_CONTROL_METRICS_PORT": "0",
        "QINGLONG_CONTROL_METRICS_ADDRESS": "127.0.0.1",
        "QINGLONG_INGRESS_METRICS_PORT": "0",
        "QINGLONG_INGRESS_METRICS_ADDRESS": "127.0.0.1",
        "QINGLONG_CONTROL_RECONCILE_INTERVAL_SECONDS": "0.5",
    }
    try:
        with dev_stack(root / "stack", environment=environment) as up:
            yield up
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _port_in(log: Path, timeout: float = 15.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = _ENDPOINT.search(log.read_text(errors="replace")) if log.exists() else None
        if found:
            return int(found.group(1))
        time.sleep(0.05)
    pytest.fail(f"no metrics endpoint announced in {log}")


def scrape(port: int) -> dict[str, Metric]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        assert answer.status == 200
        text = answer.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def _count(family: Metric, **labels: str) -> float:
    """The `_count` of a histogram's samples matching ``labels`` (summed)."""
    return sum(
        sample.value
        for sample in family.samples
        if sample.name.endswith("_count")
        and all(sample.labels.get(key) == value for key, value in labels.items())
    )


def _assert_low_cardinality(families: dict[str, Metric]) -> None:
    for name, family in families.items():
        if not name.startswith("qinglong_"):
            continue
        for sample in family.samples:
            assert set(sample.labels) <= LABELS, (name, sample.labels)
            for value in sample.labels.values():
                assert not _ID_LIKE.search(value), (name, sample.labels)


def test_every_listed_metric_after_a_run(stack: DevStack, tmp_path: Path) -> None:
    operator = OperatorClient(stack)
    worker = WorkerProcess(
        stack,
        tmp_path / "worker" / "inbox.sqlite",
        address=stack.ingress_address,
        extra_flags=("--metrics-port", "0", "--metrics-address", "127.0.0.1"),
    ).start()
    try:
        run_id = operator.trigger(["/bin/sh", "-c", "exit 0"], name="metrics")
        deadline = time.monotonic() + RUN_TIMEOUT_SECONDS
        while operator.get_run(run_id).state != lifecycle_pb2.RUN_STATE_SUCCEEDED:
            assert time.monotonic() < deadline, worker.log_tail()
            time.sleep(0.1)
        worker_port = _port_in(worker.log)
        control_port = _port_in(Path(stack.replicas("control")[0]["log"]))
        ingress_port = _port_in(Path(stack.replicas("ingress")[0]["log"]))

        worker_metrics = scrape(worker_port)
        assert set(worker_metrics) >= WORKER_METRICS, sorted(worker_metrics)
        calls = worker_metrics["qinglong_worker_call_duration_seconds"]
        for method in ("ClaimOffer", "AcknowledgeStarting", "AcknowledgeRunning"):
            assert _count(calls, method=method, outcome="ok") >= 1, method
        phases = worker_metrics["qinglong_worker_start_phase_seconds"]
        assert _count(phases, phase="claim_to_starting") == 1
        assert _count(phases, phase="starting_to_running") == 1
        _assert_low_cardinality(worker_metrics)

        ingress_metrics = scrape(ingress_port)
        assert set(ingress_metrics) >= INGRESS_METRICS, sorted(ingress_metrics)
        public = ingress_metrics["qinglong_ingress_call_duration_seconds"]
        assert _count(public, method="TriggerRun", outcome="ok") >= 1
        assert _count(public, method="CompleteAttempt", outcome="ok") >= 1
        audits = ingress_metrics["qinglong_ingress_audit_write_duration_seconds"]
        assert _count(audits, outcome="ok") >= 1
        assert {
            s.labels.get("pool") for s in ingress_metrics["qinglong_pool_connections"].samples
        } == {"qinglong-ingress"}
        _assert_low_cardinality(ingress_metrics)

        # Reconcile cycles run every half second; wait for one after the Run.
        deadline = time.monotonic() + 10
        control_metrics = scrape(control_port)
        while _count(control_metrics["qinglong_control_reconcile_cycle_seconds"]) < 1:
            assert time.monotonic() < deadline, "no reconcile cycle was recorded"
            time.sleep(0.2)
            control_metrics = scrape(control_port)
        assert set(control_metrics) >= CONTROL_METRICS, sorted(control_metrics)
        runtime = control_metrics["qinglong_control_call_duration_seconds"]
        assert _count(runtime, method="AcknowledgeRunning", outcome="ok") >= 1
        completed = control_metrics["qinglong_control_attempts_completed"]
        assert [s.value for s in completed.samples if s.name.endswith("_total")] == [1.0]
        # The queue sampler ran (a sample at start): every part has a value.
        queued = control_metrics["qinglong_control_queued_runs"]
        assert {s.labels["part"] for s in queued.samples} == {
            "any_worker",
            "with_selector",
            "waiting_for_slot",
        }
        work = control_metrics["qinglong_control_reconcile_work"]
        assert {s.labels["kind"] for s in work.samples} >= {"expired", "converged", "requeued"}
        pools = {s.labels["pool"] for s in control_metrics["qinglong_pool_connections"].samples}
        assert "qinglong-runtime" in pools
        _assert_low_cardinality(control_metrics)
        # No id reaches an exposition (labels are method, outcome, reason, pool, ...).
        assert run_id not in repr(worker_metrics) + repr(ingress_metrics) + repr(control_metrics)
    finally:
        stopped = worker.stop()
        operator.close()
    assert stopped == 0, worker.log_tail()
