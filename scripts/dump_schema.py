"""Rewrite docs/schema.sql from a database built by the migrations.

Usage: .venv/bin/python scripts/dump_schema.py
Starts a throwaway embedded PostgreSQL 18, migrates a fresh database and writes the
normalized `pg_dump --schema-only`. tests/contract/test_schema.py fails when the file and
the migrations disagree, on every supported PostgreSQL version.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from qinglong_cli.embedded_postgres import start_embedded_postgres
from qinglong_control.db.bootstrap import bootstrap_database
from qinglong_control.db.schema_dump import dump_schema

DOCUMENTED_SCHEMA = Path(__file__).resolve().parent.parent / "docs" / "schema.sql"


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        server = start_embedded_postgres(Path(scratch) / "pg", 18, delete_on_exit=True)
        try:
            urls = bootstrap_database(server.admin_url, "qinglong_schema_dump")
            DOCUMENTED_SCHEMA.write_text(dump_schema(server.bin_dir / "pg_dump", urls.migration))
        finally:
            server.stop()
    print(f"wrote {DOCUMENTED_SCHEMA}")


if __name__ == "__main__":
    main()
