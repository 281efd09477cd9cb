"""The database roles (SPEC R-ROLE-1, docs/decisions/0002) and the URLs that connect as them."""

from __future__ import annotations

from dataclasses import dataclass

from psycopg.conninfo import conninfo_to_dict, make_conninfo

MIGRATION_ROLE = "qinglong_migration"
"""Owns the schema; used only by the migration job."""

RUNTIME_ROLE = "qinglong_runtime"
"""The only role that may change Runs, Attempts, Leases, Events, Sessions and Offers."""

INGRESS_ROLE = "qinglong_ingress"
"""Writes the security audit and reads what authentication and admission need."""

ADMIN_ROLE = "qinglong_admin"
"""Writes the identity tables (projects, principals, credentials, role bindings, Workers,
join tokens, cluster admins) and reads the fleet and the audit; control's admin handlers
only, through their own small pool."""

ALL_ROLES = (MIGRATION_ROLE, RUNTIME_ROLE, INGRESS_ROLE, ADMIN_ROLE)


@dataclass(frozen=True)
class RoleUrls:
    """One connection URL per role for one database."""

    migration: str
    runtime: str
    ingress: str
    # Defaulted so that a caller written before the admin role still builds one; such a
    # RoleUrls has no admin URL ("") and control then answers admin calls UNAVAILABLE.
    admin: str = ""


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
        admin=url_for_role(base_url, ADMIN_ROLE, database),
    )
