"""`qinglong-control migrate`: apply pending migrations as the migration role.

Run once per release (the Kubernetes migration Job) before new control pods start; safe
to run concurrently and repeatedly. Prints one JSON line with what it applied.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence

from qinglong_control.db.migrate import migrate

ENV_MIGRATION_DATABASE_URL = "QINGLONG_MIGRATION_DATABASE_URL"


def migrate_main(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> None:
    env = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(prog="qinglong-control migrate")
    parser.add_argument(
        "--database-url",
        default=env.get(ENV_MIGRATION_DATABASE_URL),
        help=f"migration role libpq URL; prefer the environment [{ENV_MIGRATION_DATABASE_URL}]",
    )
    args = parser.parse_args(argv)
    if not args.database_url:
        parser.error(f"the migration role's URL is required ({ENV_MIGRATION_DATABASE_URL})")
    applied = migrate(args.database_url)
    print(json.dumps({"event": "migrated", "applied": applied}), flush=True)
