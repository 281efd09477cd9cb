"""The retry authority (SPEC R-RETRY-1, R-RETRY-2): when an ended Attempt gets a successor.

A task revision pins a retry policy; without one a Run has exactly one Attempt. The
decisions here are pure: the repository locks the Run, hands over the policy, the
Attempt's ending and DB time, and writes what comes back in the same transaction.

* A `lost` Attempt (its lease expired) is always eligible. Its successor is never due
  earlier than one lease lifetime, nor than the Workers' stop bound (`worker_stop_ms`),
  after that lease expired: by then a partitioned Worker has stopped its process on its
  own clock (R-W-2 step 3; its local lease ends before the database's, and stopping takes
  its tick and stop grace), so two executors never run.
* `failed` and `start_failed` endings retry only when the policy opts in.
* The budget counts Attempts that reached `starting` (an executor may have run); a
  `claimed` Attempt whose lease expired never started one and costs nothing (R-RETRY-1).
* An exhausted budget ends the Run `failed` / ATTEMPTS_EXHAUSTED; the last Attempt keeps
  its own error code. A Run with one Attempt allowed and a retryable ending that is not
  `lost` keeps the Attempt's code instead: there was no policy to exhaust.
* A cancel intent always wins: the caller never asks while one exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from qinglong_control.domain.ending_codes import ATTEMPTS_EXHAUSTED


class Ending(StrEnum):
    """How an Attempt ended, as far as retrying is concerned."""

    LOST = "lost"
    FAILED = "failed"
    START_FAILED = "start_failed"


#: Endings a policy may opt into (LOST needs no opting in).
OPTIONAL_ENDINGS = frozenset({Ending.FAILED, Ending.START_FAILED})


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 1
    initial_backoff_ms: int = 1_000
    max_backoff_ms: int = 1_000
    multiplier_percent: int = 200
    retry_on: frozenset[Ending] = frozenset()

    def __post_init__(self) -> None:
        if self.max_backoff_ms < self.initial_backoff_ms:
            raise ValueError("max_backoff_ms must be at least initial_backoff_ms")
        if not self.retry_on <= OPTIONAL_ENDINGS:
            raise ValueError("retry_on names only failed and start_failed")

    def retries(self, ending: Ending) -> bool:
        return ending is Ending.LOST or ending in self.retry_on

    def backoff_ms(self, started_attempts: int) -> int:
        """The delay after the `started_attempts`-th Attempt: initial, then grown by the
        multiplier per Attempt, never above the maximum (integers only, no overflow)."""
        delay = self.initial_backoff_ms
        for _ in range(max(0, started_attempts - 1)):
            if delay >= self.max_backoff_ms:
                break
            delay = delay * self.multiplier_percent // 100
        return min(delay, self.max_backoff_ms)


#: The policy of a revision that has none: one Attempt.
NO_RETRY = RetryPolicy()


@dataclass(frozen=True)
class RetryDecision:
    """`retry_at_ms` set: wait, then queue again. Otherwise the Run ends with `error_code`
    (None: the Attempt's ending is not retried at all and the caller keeps its mapping)."""

    retry_at_ms: int | None
    error_code: str | None

    @property
    def retries(self) -> bool:
        return self.retry_at_ms is not None


NOT_RETRIED = RetryDecision(None, None)


def decide_retry(
    policy: RetryPolicy,
    ending: Ending,
    started_attempts: int,
    now_ms: int,
    *,
    lease_expired_at_ms: int | None = None,
    lost_executor_stop_ms: int = 0,
) -> RetryDecision:
    """What follows an Attempt's `ending`, given how many Attempts have started so far."""
    if not policy.retries(ending):
        return NOT_RETRIED
    if started_attempts >= policy.max_attempts:
        if ending is not Ending.LOST and policy.max_attempts == 1:
            return NOT_RETRIED
        return RetryDecision(None, ATTEMPTS_EXHAUSTED)
    retry_at = now_ms + policy.backoff_ms(started_attempts)
    if ending is Ending.LOST and lease_expired_at_ms is not None:
        retry_at = max(retry_at, lease_expired_at_ms + lost_executor_stop_ms)
    return RetryDecision(retry_at, None)
