"""The two latency figures every benchmark here prints, computed one way."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def p50(samples: Sequence[float]) -> float:
    return statistics.median(samples)


def p99(samples: Sequence[float]) -> float:
    """The nearest-rank 99th percentile (the largest sample below 100 of them)."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
