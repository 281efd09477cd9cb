"""Ordered SQL migrations, each applied in one transaction and recorded with its checksum.

Migrations are the files `migrations/NNNN_name.sql`, applied in numeric order by the
migration role. Concurrent migrators (several pods starting a Job at once) serialise on a
transaction-level advisory lock, and a changed file that was already applied is refused:
history is never rewritten.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

import psycopg

_FILE_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")

# An arbitrary constant that only QingLong migrators take (pg_advisory_xact_lock(bigint)).
_MIGRATION_LOCK_KEY = 0x51_4C_4D_49_47  # "QLMIG"

_CREATE_HISTORY = """
CREATE TABLE IF NOT EXISTS public.qinglong_schema_migrations (
    version        integer PRIMARY KEY,
    name           text NOT NULL,
    checksum       text NOT NULL CHECK (checksum ~ '^[0-9a-f]{64}$'),
    applied_at_ms  bigint NOT NULL
)
"""


class MigrationError(RuntimeError):
    """The database's migration history disagrees with the migration files."""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


def load_migrations() -> list[Migration]:
    """Every migration shipped with this package, in version order."""
    found = []
    for entry in resources.files("qinglong_control.db.migrations").iterdir():
        match = _FILE_NAME.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if versions != list(range(1, len(found) + 1)):
        raise MigrationError(f"migration versions must be 1..n without gaps, found {versions}")
    return found


def migrate(migration_url: str, migrations: Sequence[Migration] | None = None) -> list[str]:
    """Apply every pending migration; return the names applied (empty when up to date).

    `migrations` defaults to the shipped files; tests pass their own to prove rollback.
    """
    applied_now: list[str] = []
    with psycopg.connect(migration_url, autocommit=True) as conn:
        for migration in load_migrations() if migrations is None else migrations:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK_KEY,))
                conn.execute(_CREATE_HISTORY)
                row = conn.execute(
                    "SELECT checksum FROM public.qinglong_schema_migrations WHERE version = %s",
                    (migration.version,),
                ).fetchone()
                if row is not None:
                    if row[0] != migration.checksum:
                        raise MigrationError(
                            f"migration {migration.version:04d}_{migration.name} was changed "
                            "after it was applied"
                        )
                    continue
                conn.execute(migration.sql.encode())
                conn.execute(
                    "INSERT INTO public.qinglong_schema_migrations"
                    " (version, name, checksum, applied_at_ms)"
                    " VALUES (%s, %s, %s, (extract(epoch FROM clock_timestamp()) * 1000)::bigint)",
                    (migration.version, migration.name, migration.checksum),
                )
                applied_now.append(f"{migration.version:04d}_{migration.name}")
    return applied_now
