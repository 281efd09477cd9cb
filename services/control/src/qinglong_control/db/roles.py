"""The three database roles of SPEC R-ROLE-1 and the libpq URLs that connect as them."""

from __future__ import annotations

from dataclasses import dataclass

from psycopg.conninfo import conninfo_to_dict, make_conninfo

MIGRATION_ROLE = "qinglong_migration"
"""Owns the schema; used only by the migration job."""

RUNTIME_ROLE = "qinglong_runtime"
"""The only role that may change Runs, Attempts, Leases, Events, Sessions and Offers."""

INGRESS_ROLE = "qinglong_ingress"
"""Writes the security audit and reads what authentication and admission need."""

ALL_ROLES = (MIGRATION_ROLE, RUNTIME_ROLE, INGRESS_ROLE)


@dataclass(frozen=True)
class RoleUrls:
    """One connection URL per role for one database."""

    migration: str
    runtime: str
    ingress: str


def url_for_role(base_url: str, role: str, database: str, password: str | None = None) -> str:
    """Return `base_url` re-pointed at `database` as `role` (same host, port and options)."""
    params = conninfo_to_dict(base_url)
    params.pop("password", None)
    params.update(user=role, dbname=database)
    if password is not None:
        params["password"] = password
    return make_conninfo("", **params)


def role_urls(base_url: str, database: str) -> RoleUrls:
    return RoleUrls(
        migration=url_for_role(base_url, MIGRATION_ROLE, database),
        runtime=url_for_role(base_url, RUNTIME_ROLE, database),
        ingress=url_for_role(base_url, INGRESS_ROLE, database),
    )
