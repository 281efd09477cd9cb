"""A task revision's retry policy columns (migration 0002) as the domain's RetryPolicy.

Statements that need the policy select the five `retry_*` columns of `task_revisions`
under their own names; this is the one place that reads them back.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from qinglong_control.domain.retry import Ending, RetryPolicy

POLICY_COLUMNS = (
    "retry_max_attempts",
    "retry_initial_backoff_ms",
    "retry_max_backoff_ms",
    "retry_multiplier_percent",
    "retry_on",
)


def retry_policy_of(columns: MutableMapping[str, Any]) -> RetryPolicy:
    """Pop the policy columns out of a row's columns and build the policy from them."""
    values = [columns.pop(name) for name in POLICY_COLUMNS]
    max_attempts, initial_ms, max_ms, multiplier, retry_on = values
    return RetryPolicy(
        max_attempts=max_attempts,
        initial_backoff_ms=initial_ms,
        max_backoff_ms=max_ms,
        multiplier_percent=multiplier,
        retry_on=frozenset(Ending(name) for name in retry_on),
    )


def retry_on_names(policy: RetryPolicy) -> list[str]:
    """The policy's optional endings as stored (sorted, so equal policies store equally)."""
    return sorted(ending.value for ending in policy.retry_on)
