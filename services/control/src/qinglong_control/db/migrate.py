"""Ordered SQL migrations, each applied once and recorded with its checksum.

Migrations are the files `migrations/NNNN_name.sql`, applied in numeric order by the
migration role, while the services serve. Concurrent migrators (several pods starting a
Job at once) take turns on an advisory lock, and a changed file that was already applied
is refused: history is never rewritten.

A migration runs in one transaction, unless its first line is `-- qinglong:
outside-transaction`: then each of its statements runs on its own, for what PostgreSQL
refuses inside a transaction — `CREATE INDEX CONCURRENTLY`, which builds an index on a
table with rows without stopping the writes of every command meanwhile. Such a file holds
only `DROP INDEX CONCURRENTLY IF EXISTS` and `CREATE [UNIQUE] INDEX CONCURRENTLY`
statements, each index dropped before it is built, so a migrator that stopped half-way
(leaving an invalid index) is simply run again.

A statement of a migration in a transaction waits for a lock at most LOCK_TIMEOUT_MS: a
DDL statement queued behind a long transaction makes every write to its table queue
behind it, so the migration rolls back, lets them through and tries again. It tries
again too when PostgreSQL ended it to break a deadlock with the traffic.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

import psycopg

_FILE_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")

# An arbitrary constant that only QingLong migrators take (an advisory lock on a bigint).
MIGRATION_LOCK_KEY = 0x51_4C_4D_49_47  # "QLMIG"
#: How often a migrator waiting for another one tries the lock again. It waits between
#: tries, not inside a statement: CREATE INDEX CONCURRENTLY waits for every statement
#: that holds a snapshot, and a migrator blocked inside one would deadlock with it.
_LOCK_RETRY_SECONDS = 0.2

#: How long a migration's statement waits for a lock before the migration is rolled back
#: and tried again, and how often. A DDL statement queued for its lock makes every command
#: behind it queue too (an ALTER TABLE waiting on a long read of the audit would stop every
#: call's audit row): a stall is cut short at this bound, however the database is used.
LOCK_TIMEOUT_MS = 2_000
LOCK_TRIES = 30
_LOCK_RETRY_PAUSE_SECONDS = 1.0

OUTSIDE_TRANSACTION = "-- qinglong: outside-transaction"
_STATEMENT_END = re.compile(r";[ \t]*(?:\n|$)")
_COMMENT_LINE = re.compile(r"^\s*--.*$", re.MULTILINE)
_OUTSIDE_TRANSACTION_STATEMENT = re.compile(
    r"^(DROP INDEX CONCURRENTLY IF EXISTS|CREATE (UNIQUE )?INDEX CONCURRENTLY)\s",
    re.IGNORECASE,
)

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

    @property
    def in_transaction(self) -> bool:
        return not self.sql.startswith(OUTSIDE_TRANSACTION)

    def statements(self) -> list[str]:
        """An outside-transaction migration's statements, in order (comments dropped)."""
        text = _COMMENT_LINE.sub("", self.sql)
        found = [part.strip() for part in _STATEMENT_END.split(text) if part.strip()]
        wrong = [s for s in found if not _OUTSIDE_TRANSACTION_STATEMENT.match(s)]
        if wrong:
            raise MigrationError(
                f"migration {self.version:04d}_{self.name} runs outside a transaction and may "
                f"only drop and build indexes concurrently: {wrong[0][:60]!r}"
            )
        return found


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
        _take_turn(conn)
        try:
            conn.execute(_CREATE_HISTORY)
            for migration in load_migrations() if migrations is None else migrations:
                if _applied(conn, migration):
                    continue
                if migration.in_transaction:
                    _apply_in_transaction(conn, migration)
                else:
                    for statement in migration.statements():
                        conn.execute(statement.encode())
                    _record(conn, migration)
                applied_now.append(f"{migration.version:04d}_{migration.name}")
        finally:
            if not conn.closed and not conn.broken:
                conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK_KEY,))
    return applied_now


def _apply_in_transaction(conn: psycopg.Connection, migration: Migration) -> None:
    """The migration and its history row in one transaction whose statements wait at most
    LOCK_TIMEOUT_MS for a lock; rolled back and tried again when one did not come, or
    when PostgreSQL ended it to break a deadlock with the traffic (it takes its locks in
    its own order, which need not be the runtime's)."""
    for attempt in range(1, LOCK_TRIES + 1):
        try:
            with conn.transaction():
                conn.execute("SELECT set_config('lock_timeout', %s, true)", (str(LOCK_TIMEOUT_MS),))
                conn.execute(migration.sql.encode())
                _record(conn, migration)
            return
        except (psycopg.errors.LockNotAvailable, psycopg.errors.DeadlockDetected):
            if attempt == LOCK_TRIES:
                raise
            time.sleep(_LOCK_RETRY_PAUSE_SECONDS)


def _take_turn(conn: psycopg.Connection) -> None:
    """The migrators' lock, for this session: tried, and waited for between tries."""
    while True:
        row = conn.execute("SELECT pg_try_advisory_lock(%s)", (MIGRATION_LOCK_KEY,)).fetchone()
        if row is not None and row[0]:
            return
        time.sleep(_LOCK_RETRY_SECONDS)


def _applied(conn: psycopg.Connection, migration: Migration) -> bool:
    row = conn.execute(
        "SELECT checksum FROM public.qinglong_schema_migrations WHERE version = %s",
        (migration.version,),
    ).fetchone()
    if row is None:
        return False
    if row[0] != migration.checksum:
        raise MigrationError(
            f"migration {migration.version:04d}_{migration.name} was changed after it was applied"
        )
    return True


def _record(conn: psycopg.Connection, migration: Migration) -> None:
    conn.execute(
        "INSERT INTO public.qinglong_schema_migrations (version, name, checksum, applied_at_ms)"
        " VALUES (%s, %s, %s, (extract(epoch FROM clock_timestamp()) * 1000)::bigint)",
        (migration.version, migration.name, migration.checksum),
    )
