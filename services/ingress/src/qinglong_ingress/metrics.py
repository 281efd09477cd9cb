"""Ingress's Prometheus metrics (SPEC R-OPS-3; the endpoint: qinglong_protocol.metrics).

Labels: ``method`` (a public method name), ``outcome`` (``ok`` or the gRPC code name the
caller was answered with). Never an id, a peer or a principal.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from typing import Final, ParamSpec, TypeVar

from prometheus_client import Counter, Histogram
from qinglong_protocol.metrics import COUNT_BUCKETS, LATENCY_BUCKETS

CALL_DURATION: Final = Histogram(
    "qinglong_ingress_call_duration_seconds",
    "Public call latency at ingress (admission, audit commit and forwarding), by method and"
    " outcome",
    ["method", "outcome"],
    buckets=LATENCY_BUCKETS,
)
AUDIT_WRITE_DURATION: Final = Histogram(
    "qinglong_ingress_audit_write_duration_seconds",
    "Latency of one audit statement and its commit (a group commit's batch, or a row written"
    " alone), by outcome (ok or error)",
    ["outcome"],
    buckets=LATENCY_BUCKETS,
)
REFUSALS_NOT_AUDITED: Final = Counter(
    "qinglong_ingress_refusals_not_audited",
    "Refusals answered without an audit row of their own, by reason: a peer's repeated"
    " rate-limited enrollment attempts (the first each minute, per host and of the shared"
    " total, is audited), and calls with a certificate refused as unauthenticated too often"
    " (the first each minute, per certificate, is audited)",
    ["reason"],
)
AUDIT_BATCH_ROWS: Final = Histogram(
    "qinglong_ingress_audit_batch_rows",
    "Audit rows committed by one statement (group commit)",
    buckets=COUNT_BUCKETS,
)

P = ParamSpec("P")
R = TypeVar("R")


def timed_audit_write(write: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """``write`` (an audit statement and its commit), its latency recorded by outcome."""

    @functools.wraps(write)
    async def timed(*args: P.args, **kwargs: P.kwargs) -> R:
        started = time.perf_counter()
        outcome = "error"
        try:
            result = await write(*args, **kwargs)
            outcome = "ok"
            return result
        finally:
            AUDIT_WRITE_DURATION.labels(outcome).observe(time.perf_counter() - started)

    return timed
