"""How long durable promises last. All are measured on DB time."""

from __future__ import annotations

from dataclasses import dataclass

APPROVAL_TTL_MAX_MS = 30 * 86_400_000


@dataclass(frozen=True)
class Timings:
    session_ttl_ms: int = 30_000
    lease_ttl_ms: int = 30_000
    offer_ttl_ms: int = 15_000
    #: How long a held mutation waits for a decision (R-OPS-2): a day, so a request made
    #: at night is still there in the morning; then it expires and nothing runs.
    approval_ttl_ms: int = 86_400_000

    def __post_init__(self) -> None:
        for name in ("session_ttl_ms", "lease_ttl_ms", "offer_ttl_ms"):
            if not 1_000 <= getattr(self, name) <= 3_600_000:
                raise ValueError(f"{name} must be between 1 s and 1 h")
        if not 1_000 <= self.approval_ttl_ms <= APPROVAL_TTL_MAX_MS:
            raise ValueError("approval_ttl_ms must be between 1 s and 30 days")
