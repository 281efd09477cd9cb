"""Reading an executed plan (`EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)`): what a statement
really read, for tests that hold a statement to reading only its own rows."""

from __future__ import annotations

from typing import Any


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
