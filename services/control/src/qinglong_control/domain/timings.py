"""How long durable promises last. All are measured on DB time."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Timings:
    session_ttl_ms: int = 30_000
    lease_ttl_ms: int = 30_000
    offer_ttl_ms: int = 15_000

    def __post_init__(self) -> None:
        for name in ("session_ttl_ms", "lease_ttl_ms", "offer_ttl_ms"):
            if not 1_000 <= getattr(self, name) <= 3_600_000:
                raise ValueError(f"{name} must be between 1 s and 1 h")
