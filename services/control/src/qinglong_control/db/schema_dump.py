"""The documented schema: `pg_dump --schema-only` of a migrated database, made comparable.

`docs/schema.sql` is this dump of a database built from the migrations; a test rebuilds it
on every supported PostgreSQL version and fails on any difference, so the document can
never drift from what the migrations create.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

# Lines that change from run to run or version to version without changing the schema:
# pg_dump's header comments, session SETs, and PostgreSQL 17+'s random `\restrict` keys.
_VOLATILE_PREFIXES = ("--", "SET ", "SELECT pg_catalog.set_config", "\\restrict", "\\unrestrict")


def normalize_dump(dump: str) -> str:
    kept: list[str] = []
    for line in dump.splitlines():
        if line.startswith(_VOLATILE_PREFIXES):
            continue
        if not line.strip() and (not kept or not kept[-1].strip()):
            continue
        kept.append(line.rstrip())
    while kept and not kept[-1].strip():
        kept.pop()
    return "\n".join(kept) + "\n"


def dump_schema(pg_dump: Path, database_url: str) -> str:
    """The normalized schema of `database_url` (every schema, privileges included)."""
    completed = subprocess.run(
        [str(pg_dump), "--schema-only", "--no-owner", "--dbname", database_url],
        capture_output=True,
        text=True,
        check=True,
    )
    return normalize_dump(completed.stdout)
