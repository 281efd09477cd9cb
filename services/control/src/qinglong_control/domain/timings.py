"""How long durable promises last. All are measured on DB time."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Final

_HOUR_MS: Final = 3_600_000
_DAY_MS: Final = 24 * _HOUR_MS

#: The allowed range of each timing, in ms (flags' help and validation both read it).
TIMING_RANGES_MS: Final[Mapping[str, tuple[int, int]]] = {
    "session_ttl_ms": (1_000, _HOUR_MS),
    "lease_ttl_ms": (1_000, _HOUR_MS),
    "offer_ttl_ms": (1_000, _HOUR_MS),
    "approval_ttl_ms": (1_000, 30 * _DAY_MS),
    "worker_stop_ms": (0, _HOUR_MS),
}


@dataclass(frozen=True)
class Timings:
    session_ttl_ms: int = 30_000
    lease_ttl_ms: int = 30_000
    offer_ttl_ms: int = 15_000
    #: How long a held mutation waits for a decision (R-OPS-2): a day, so a request made
    #: at night is still there in the morning; then it expires and nothing runs.
    approval_ttl_ms: int = _DAY_MS
    #: How long a Worker may take, once its local lease ran out, to have stopped its
    #: executor: the rest of the tick it is in (its waits for the session, supervision,
    #: shipping and a pull: at most about 8 s), the tick interval, its stop grace (SIGTERM,
    #: then SIGKILL) and the kill itself — about 14 s with the Worker's defaults. A lost
    #: Attempt's successor is due no earlier than this, nor than a lease lifetime, after
    #: the lease expired (R-RETRY-2), so the two never run at once however short the
    #: lease. A Worker caps the SIGTERM grace of an executor whose lease is gone at 5 s
    #: (qinglong_worker.supervisor.LEASE_GONE_STOP_GRACE_SECONDS), whatever its
    #: `--stop-grace-seconds`: raise this only for a slower tick or kill. A Worker that
    #: is gone is covered too: the executor's supervisor stops it when the lease runs out
    #: (at most 10 s late after a suspend) with the same grace.
    worker_stop_ms: int = 20_000

    @property
    def lost_executor_stop_ms(self) -> int:
        """How long after an Attempt's lease ran out its executor may still run, on a
        Worker cut off from the control plane: a lost Attempt's successor, and another Run
        of a task with a concurrency limit, start no earlier than this after it."""
        return max(self.lease_ttl_ms, self.worker_stop_ms)

    def __post_init__(self) -> None:
        for field in fields(self):
            low, high = TIMING_RANGES_MS[field.name]
            if not low <= getattr(self, field.name) <= high:
                raise ValueError(f"{field.name} must be {low}..{high} ms")
