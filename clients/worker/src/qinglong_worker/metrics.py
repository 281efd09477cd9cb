"""The Worker's Prometheus metrics (SPEC R-OPS-3; the endpoint: qinglong_protocol.metrics).

Labels: ``method`` (a WorkerService method), ``outcome`` (``ok``, an ErrorReason name, or
a gRPC code name when the call carried no reason), ``reason`` and ``phase``. Never an
offer, run, attempt or session id, and never a capability or token.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Final

from prometheus_client import Counter, Histogram
from qinglong_protocol.metrics import LATENCY_BUCKETS

CALL_DURATION: Final = Histogram(
    "qinglong_worker_call_duration_seconds",
    "WorkerService call latency seen by the Worker (each try), by method and outcome",
    ["method", "outcome"],
    buckets=LATENCY_BUCKETS,
)
FENCE_REJECTIONS: Final = Counter(
    "qinglong_worker_fence_rejections",
    "Calls refused because this Worker's authority (session, lease, version, capability)"
    " is not the present one, by method and reason",
    ["method", "reason"],
)
LATE_LAST_WORDS: Final = Counter(
    "qinglong_worker_late_last_words",
    "Reports of an executor that ended by itself (its ending, or its start first) that"
    " control did not answer after the record's local lease ran out: each is sent again at"
    " the next tick, and the Worker takes no new work meanwhile",
)
START_PHASE_DURATION: Final = Histogram(
    "qinglong_worker_start_phase_seconds",
    "From a claim's answer to AcknowledgeStarting's (claim_to_starting: includes nothing"
    " but the call), and from that to AcknowledgeRunning's (starting_to_running: spawning"
    " the executor and the call)",
    ["phase"],
    buckets=LATENCY_BUCKETS,
)
CLAIM_TO_STARTING: Final = "claim_to_starting"
STARTING_TO_RUNNING: Final = "starting_to_running"
for _phase in (CLAIM_TO_STARTING, STARTING_TO_RUNNING):
    START_PHASE_DURATION.labels(_phase)


class StartPhases:
    """When each offer in flight passed its last start fact, in memory only: an offer
    whose claim an earlier process made is not measured. At most ``limit`` offers are
    remembered (the oldest is forgotten), so one that never starts leaks nothing."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, limit: int = 1024) -> None:
        self._clock = clock
        self._limit = limit
        self._since: OrderedDict[str, float] = OrderedDict()

    def claimed(self, offer_id: str) -> None:
        self._mark(offer_id)

    def starting(self, offer_id: str) -> None:
        self._observe(offer_id, CLAIM_TO_STARTING)
        self._mark(offer_id)

    def running(self, offer_id: str) -> None:
        self._observe(offer_id, STARTING_TO_RUNNING)

    def _mark(self, offer_id: str) -> None:
        self._since[offer_id] = self._clock()
        self._since.move_to_end(offer_id)
        while len(self._since) > self._limit:
            self._since.popitem(last=False)

    def _observe(self, offer_id: str, phase: str) -> None:
        since = self._since.pop(offer_id, None)
        if since is not None:
            START_PHASE_DURATION.labels(phase).observe(self._clock() - since)
