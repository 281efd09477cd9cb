"""Create the roles and database of one QingLong deployment, then migrate it.

Used by the embedded dev stack and the tests, which own a whole PostgreSQL cluster. A
production cluster gets its roles from its administrator (or the operator's managed
roles) and runs only `migrate` as the migration role.
"""

from __future__ import annotations

from typing import Final

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from qinglong_control.db.migrate import migrate
from qinglong_control.db.roles import ALL_ROLES, MIGRATION_ROLE, RoleUrls, role_urls

#: Advisory locks for QingLong's roles only (run as superuser in the database; the same
#: statement is deploy/k8s/postgres/cluster.yaml's, a test compares them). PostgreSQL lets
#: every role take any advisory lock, and control serializes its commands with them
#: (an Attempt's, a Worker's, a pull's, a migration's): the ingress role, which faces the
#: Internet, could otherwise hold one and freeze an Attempt, a Worker or a migration
#: without changing a row.
CLOSE_ADVISORY_LOCKS: Final = """DO $$
DECLARE
    advisory regprocedure;
BEGIN
    FOR advisory IN
        SELECT p.oid::regprocedure FROM pg_catalog.pg_proc p
         WHERE p.pronamespace = 'pg_catalog'::regnamespace AND p.proname LIKE '%advisory%'
    LOOP
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', advisory);
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s'
                       ' TO qinglong_migration, qinglong_runtime, qinglong_admin', advisory);
    END LOOP;
END
$$"""


def ensure_roles(admin_url: str) -> None:
    """Create the login roles if they are missing; none has any cluster privilege."""
    with psycopg.connect(admin_url, autocommit=True) as conn:
        for role in ALL_ROLES:
            exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
            if exists is None:
                conn.execute(
                    sql.SQL(
                        "CREATE ROLE {} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE"
                        " NOREPLICATION NOBYPASSRLS"
                    ).format(sql.Identifier(role))
                )


def create_database(admin_url: str, database: str, *, template: str | None = None) -> bool:
    """Create `database` owned by the migration role; return False if it already existed.

    Only QingLong's roles may connect: CONNECT is revoked from PUBLIC. Database ACLs are not
    copied from a template, so they are set here every time.
    """
    with psycopg.connect(admin_url, autocommit=True) as conn:
        exists = conn.execute(
            "SELECT 1 FROM pg_database WHERE datname = %s", (database,)
        ).fetchone()
        if exists is None:
            statement = sql.SQL("CREATE DATABASE {} OWNER {}").format(
                sql.Identifier(database), sql.Identifier(MIGRATION_ROLE)
            )
            if template is not None:
                statement += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
            conn.execute(statement)
        conn.execute(
            sql.SQL("REVOKE ALL ON DATABASE {} FROM PUBLIC").format(sql.Identifier(database))
        )
        conn.execute(
            sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(
                sql.Identifier(database),
                sql.SQL(", ").join(sql.Identifier(role) for role in ALL_ROLES),
            )
        )
    with psycopg.connect(make_conninfo(admin_url, dbname=database), autocommit=True) as inside:
        inside.execute(CLOSE_ADVISORY_LOCKS)
    return exists is None


def bootstrap_database(admin_url: str, database: str = "qinglong") -> RoleUrls:
    """Roles, database and migrations; idempotent. Returns one URL per role."""
    ensure_roles(admin_url)
    create_database(admin_url, database)
    urls = role_urls(admin_url, database)
    migrate(urls.migration)
    return urls
