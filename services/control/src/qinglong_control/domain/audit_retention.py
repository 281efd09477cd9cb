"""How long the security audit is kept (one row per public call, R-ING-1).

Pure configuration: the reconcile cadence removes older rows through the database
function `qinglong.prune_security_audit` (migration 0013), which refuses on its own to
remove anything younger than the floor — the floor is a property of the database, not of
this process; it is repeated here only to refuse a setting that could never take effect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

DAY_MS: Final = 24 * 3600 * 1000
#: Migration 0013's floor: no audit row younger than this is ever removed.
AUDIT_RETENTION_FLOOR_MS: Final = 7 * DAY_MS
DEFAULT_AUDIT_RETENTION_DAYS: Final = 90


@dataclass(frozen=True)
class AuditRetention:
    """``max_age_ms``: audit rows older than this (DB time) are removed."""

    max_age_ms: int = DEFAULT_AUDIT_RETENTION_DAYS * DAY_MS

    def __post_init__(self) -> None:
        if self.max_age_ms < AUDIT_RETENTION_FLOOR_MS:
            raise ValueError(
                f"the audit is kept at least {AUDIT_RETENTION_FLOOR_MS // DAY_MS} days"
                " (the database removes nothing younger)"
            )
