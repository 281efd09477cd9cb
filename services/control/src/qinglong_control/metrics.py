"""Control's Prometheus metrics (SPEC R-OPS-3; the endpoint: qinglong_protocol.metrics).

Labels: ``method`` (a RuntimeService method name), ``outcome`` (``ok``, an ErrorReason
name, ``aborted`` or ``cancelled``), ``reason`` (an ErrorReason name), ``kind`` (what a
reconcile cycle did), ``state`` (an Attempt's end state), ``part`` (of the queue). Never
an id.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import Counter, Gauge, Histogram
from qinglong_protocol.metrics import COUNT_BUCKETS, LATENCY_BUCKETS

CALL_DURATION: Final = Histogram(
    "qinglong_control_call_duration_seconds",
    "RuntimeService call latency at control (one short transaction each), by method and outcome",
    ["method", "outcome"],
    buckets=LATENCY_BUCKETS,
)
FENCE_REJECTIONS: Final = Counter(
    "qinglong_control_fence_rejections",
    "Commands refused because the caller's fence or the state it assumed is not the present"
    " one (every refusal answered ABORTED), by method and reason",
    ["method", "reason"],
)
RECONCILE_CYCLE_DURATION: Final = Histogram(
    "qinglong_control_reconcile_cycle_seconds",
    "Duration of one lease-expiry, convergence and retry cycle, by outcome (ok or error)",
    ["outcome"],
    buckets=LATENCY_BUCKETS,
)
RECONCILE_STEP_FAILURES: Final = Counter(
    "qinglong_control_reconcile_step_failures",
    "Reconcile steps that failed for a reason of their own (not an unreachable database),"
    " by step; the cycle's other steps still ran",
    ["step"],
)
RECONCILE_WORK: Final = Histogram(
    "qinglong_control_reconcile_work",
    "Items one reconcile cycle handled, by kind (expired leases, converged or blocked runs,"
    " retries scheduled or exhausted, requeued runs, pages read)",
    ["kind"],
    buckets=COUNT_BUCKETS,
)
ATTEMPTS_COMPLETED: Final = Counter(
    "qinglong_control_attempts_completed",
    "Attempts their Worker reported ended (CompleteAttempt; a replayed report is not"
    " counted again), by the Attempt's state",
    ["state"],
)
OUTPUT_BYTES_STORED: Final = Counter(
    "qinglong_control_output_bytes_stored",
    "Bytes of Run output stored (AppendOutput; replayed bytes are not counted again)",
)
QUEUED_RUNS: Final = Gauge(
    "qinglong_control_queued_runs",
    "Runs waiting for a Worker, by part of the queue: any_worker (no worker selector),"
    " with_selector (only Workers with those labels may take them), or waiting_for_slot"
    " (created, waiting for a slot of their task's concurrency limit); sampled",
    ["part"],
)
OLDEST_QUEUED_RUN_AGE: Final = Gauge(
    "qinglong_control_oldest_queued_run_age_seconds",
    "How long the oldest queued Run of each part of the queue has waited (0: none waits); sampled",
    ["part"],
)
#: The kinds of RECONCILE_WORK: CycleReport's fields.
RECONCILE_KINDS: Final = (
    "expired",
    "converged",
    "blocked",
    "pages",
    "retries_scheduled",
    "retries_exhausted",
    "requeued",
    "approvals_expired",
    "outputs_expired",
    "audit_rows_removed",
    "disabled_projects_runs_stopped",
    "queue_timeouts",
    "runs_admitted",
)

# Present (at zero) from the start, so a dashboard sees every kind before the first cycle.
for _kind in RECONCILE_KINDS:
    RECONCILE_WORK.labels(_kind)
