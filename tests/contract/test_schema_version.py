"""Control refuses a database that lacks a migration it ships (migration 0014), on
PostgreSQL 16 and 18: the check itself, and the real `qinglong-control` exiting with the
command to run instead of failing call by call."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from psycopg import errors, sql
from qinglong_control.db.bootstrap import create_database
from qinglong_control.db.migrate import load_migrations, migrate
from qinglong_control.db.roles import role_urls
from qinglong_control.db.schema_version import require_control_schema
from qinglong_ingress.schema import REQUIRED_SCHEMA, require_ingress_schema
from qinglong_ingress.sql import SQL as INGRESS_SQL
from qinglong_protocol.schema_version import SchemaBehind
from qinglong_protocol.sql import SQL as SHARED_SQL

from tests.support.postgres import MigratedDatabase

NEWEST = load_migrations()[-1].version


def forget_migrations_from(database: MigratedDatabase, version: int) -> None:
    """As if migrations from ``version`` on had not run yet (their objects stay; only the
    records go)."""
    with psycopg.connect(database.urls.migration, autocommit=True) as conn:
        conn.execute(
            "DELETE FROM public.qinglong_schema_migrations WHERE version >= %s", (version,)
        )


def forget_newest_migration(database: MigratedDatabase) -> None:
    forget_migrations_from(database, NEWEST)


def refused_start_up(service: str, *arguments: str) -> str:
    """Start the real ``qinglong-<service>``, which must exit 1 at start-up, without a
    traceback; its standard error."""
    program = Path(sys.executable).with_name(f"qinglong-{service}")
    finished = subprocess.run(
        [str(program), *arguments], capture_output=True, text=True, timeout=60, check=False
    )
    assert finished.returncode == 1, finished.stderr
    assert "Traceback" not in finished.stderr
    return finished.stderr


async def required(database: MigratedDatabase, url: str) -> int:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        return await require_control_schema(conn)


async def test_control_reads_the_version_and_a_migrated_database_passes(
    database: MigratedDatabase,
) -> None:
    assert await required(database, database.urls.runtime) == NEWEST
    # Control and ingress ask; the admin role sees nothing of the migration history, and
    # a control given its URL by mistake says so instead of failing on a privilege.
    with (
        psycopg.connect(database.urls.admin, autocommit=True) as conn,
        pytest.raises(errors.InsufficientPrivilege),
    ):
        conn.execute("SELECT qinglong.schema_version()")
    with pytest.raises(SchemaBehind) as behind:
        await required(database, database.urls.admin)
    assert behind.value.applied is None
    assert "or the connection is not control's role" in str(behind.value)


async def test_a_database_behind_the_build_is_refused_with_what_to_run(
    database: MigratedDatabase,
) -> None:
    forget_newest_migration(database)
    with pytest.raises(SchemaBehind) as behind:
        await required(database, database.urls.runtime)
    assert (behind.value.applied, behind.value.required) == (NEWEST - 1, NEWEST)
    assert "qinglong-control migrate" in str(behind.value)


async def test_a_database_from_before_the_version_was_readable_is_refused(
    database: MigratedDatabase,
) -> None:
    with psycopg.connect(database.urls.migration, autocommit=True) as conn:
        conn.execute("DROP FUNCTION qinglong.schema_version()")
    with pytest.raises(SchemaBehind) as behind:
        await required(database, database.urls.runtime)
    assert behind.value.applied is None
    assert "predates migration 0014" in str(behind.value)
    assert "qinglong-control migrate" in str(behind.value)


async def test_a_database_never_migrated_is_refused(database: MigratedDatabase) -> None:
    """Control started before the migration Job ever ran: no schema at all."""
    name = f"{database.name}_bare"
    create_database(database.admin_url, name)
    try:
        urls = role_urls(database.admin_url, name)
        async with await psycopg.AsyncConnection.connect(urls.runtime, autocommit=True) as conn:
            with pytest.raises(SchemaBehind) as behind:
                await require_control_schema(conn)
        assert behind.value.applied is None
    finally:
        with psycopg.connect(database.admin_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE {}").format(sql.Identifier(name)))


def test_control_exits_at_start_up_on_a_database_behind_it(
    database: MigratedDatabase, tmp_path: Path
) -> None:
    forget_newest_migration(database)
    tls = [f"--tls-{part}={tmp_path / part}" for part in ("ca", "cert", "key")]
    stderr = refused_start_up("control", f"--database-url={database.urls.runtime}", *tls)
    assert f"has migrations up to {NEWEST - 1:04d}" in stderr
    assert f"this control needs {NEWEST:04d}" in stderr


async def test_ingress_reads_the_version_it_needs(database: MigratedDatabase) -> None:
    """Ingress writes columns migrations added (the audit's credential_id): it refuses, at
    start-up, a database without them, and serves a newer one (a rolling upgrade's old
    replica)."""
    assert REQUIRED_SCHEMA <= NEWEST, "ingress needs a migration control does not ship"
    async with await psycopg.AsyncConnection.connect(
        database.urls.ingress, autocommit=True
    ) as conn:
        assert await require_ingress_schema(conn) == NEWEST
    forget_migrations_from(database, REQUIRED_SCHEMA)
    async with await psycopg.AsyncConnection.connect(
        database.urls.ingress, autocommit=True
    ) as conn:
        with pytest.raises(SchemaBehind) as behind:
            await require_ingress_schema(conn)
    assert behind.value.applied == REQUIRED_SCHEMA - 1


def test_ingress_exits_at_start_up_on_a_database_behind_it(
    database: MigratedDatabase, tmp_path: Path
) -> None:
    forget_migrations_from(database, REQUIRED_SCHEMA)
    tls = [f"--tls-{part}={tmp_path / part}" for part in ("ca", "cert", "key")]
    control = ["--control-address=127.0.0.1:9"]
    control += [f"--control-tls-{part}={tmp_path / part}" for part in ("cert", "key")]
    stderr = refused_start_up("ingress", f"--database-url={database.urls.ingress}", *tls, *control)
    assert f"has migrations up to {REQUIRED_SCHEMA - 1:04d}" in stderr
    assert f"this ingress needs {REQUIRED_SCHEMA:04d}" in stderr


async def test_ingress_cannot_read_the_version_without_its_grant(
    database: MigratedDatabase,
) -> None:
    """A database from before 0024 (or a connection of another role) cannot say its
    version to ingress: refused, saying both."""
    with psycopg.connect(database.urls.migration, autocommit=True) as conn:
        conn.execute("REVOKE EXECUTE ON FUNCTION qinglong.schema_version() FROM qinglong_ingress")
    async with await psycopg.AsyncConnection.connect(
        database.urls.ingress, autocommit=True
    ) as conn:
        with pytest.raises(SchemaBehind) as behind:
            await require_ingress_schema(conn)
    assert behind.value.applied is None
    assert f"predates migration {REQUIRED_SCHEMA:04d}" in str(behind.value)
    assert "or the connection is not ingress's role" in str(behind.value)


_NAMED = re.compile(r"%\((\w+)\)s")


def test_every_ingress_statement_plans_on_the_schema_it_requires(
    database: MigratedDatabase,
) -> None:
    """REQUIRED_SCHEMA is ingress's own promise: every statement it runs must plan, as its
    role, on a database migrated only that far (a statement using a later migration's
    column fails here until the constant is raised). Planned, not run: EXPLAIN, with NULL
    for every parameter."""
    name = f"{database.name}_at_required"
    create_database(database.admin_url, name)
    try:
        urls = role_urls(database.admin_url, name)
        migrate(urls.migration, load_migrations()[:REQUIRED_SCHEMA])
        statements = [*INGRESS_SQL.values(), *SHARED_SQL.values()]
        with psycopg.connect(urls.ingress) as conn:
            for text in statements:
                named = set(_NAMED.findall(text))
                params: dict[str, None] | tuple[None, ...] = (
                    dict.fromkeys(named) if named else (None,) * text.count("%s")
                )
                conn.execute("EXPLAIN " + text, params)  # type: ignore[arg-type]
                conn.rollback()
    finally:
        with psycopg.connect(database.admin_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE {}").format(sql.Identifier(name)))
