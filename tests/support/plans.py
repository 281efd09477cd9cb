"""Reading an executed plan (`EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)`): what a statement
really read, for tests that hold a statement to reading only its own rows."""

from __future__ import annotations

from typing import Any

import psycopg
from qinglong_control.db.sql import SQL
from qinglong_control.domain.sessions import SessionClaim


def scans_of(node: dict[str, Any], table: str) -> list[dict[str, Any]]:
    """Every node of the plan rooted at ``node`` that reads ``table`` (unqualified)."""
    found = [node] if node.get("Relation Name") == table else []
    for child in node.get("Plans", []):
        found += scans_of(child, table)
    return found


def rows_examined(node: dict[str, Any], table: str) -> int:
    """How many rows of ``table`` the executed plan looked at (returned or filtered out),
    over all its scans of that table."""
    return sum(
        round((scan["Actual Rows"] + scan.get("Rows Removed by Filter", 0)) * scan["Actual Loops"])
        for scan in scans_of(node, table)
    )


def pages_read(scan: dict[str, Any]) -> int:
    """Shared buffers one node hit or read (its own and its children's)."""
    return int(scan["Shared Hit Blocks"] + scan["Shared Read Blocks"])


def rows_a_pull_examines(runtime_url: str, session: SessionClaim, max_offers: int) -> int:
    """How many rows of ``runs`` the pull's candidate statement (placement.lock_candidates)
    reads for ``session``, executed for real and rolled back (it locks what it picks)."""
    explain = "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + SQL["placement.lock_candidates"]
    values = {
        "session_id": session.session_id,
        "worker_id": session.worker_id,
        "generation": session.worker_generation,
        "max_offers": max_offers,
    }
    with psycopg.connect(runtime_url) as conn:
        row = conn.execute(explain, values).fetchone()
        conn.rollback()
    assert row is not None
    return rows_examined(row[0][0]["Plan"], "runs")
