"""Enroll the dev stack's identities: a project, its Worker and its operator.

Done by the administrator (the migration role), never by a service. The operator gets
both a client certificate identity and a bearer token; the token is generated here,
written once to a 0600 file, and only its digest reaches the database.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psycopg
from qinglong_control.db.identities import (
    enroll_operator_certificate,
    enroll_operator_token,
    enroll_worker,
    ensure_project,
    ensure_role,
)
from qinglong_control.domain.administration import NewSecret, new_operator_token
from qinglong_protocol.files import atomic_write

DEV_PROJECT_ID = "default"


@dataclass(frozen=True)
class DevIdentities:
    project_id: str
    worker_id: str
    worker_uri: str
    operator_name: str
    operator_uri: str
    operator_token_file: Path


def ensure_operator_token(path: Path) -> str:
    """The dev operator's bearer token: reused if present, else 32 random bytes, once."""
    if path.exists():
        return path.read_text(encoding="ascii").strip()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    token = new_operator_token().plaintext
    atomic_write(path, token.encode("ascii") + b"\n", 0o600)
    return token


def enroll_development_identities(migration_url: str, identities: DevIdentities) -> None:
    digest = NewSecret(ensure_operator_token(identities.operator_token_file)).digest
    with psycopg.connect(migration_url, autocommit=True) as conn, conn.transaction():
        ensure_project(conn, identities.project_id, "Default project")
        enroll_worker(conn, identities.worker_id, identities.worker_uri)
        operator = enroll_operator_certificate(
            conn, identities.operator_name, "user", identities.operator_uri
        )
        enroll_operator_token(conn, identities.operator_name, "user", digest)
        # Once: a binding an administrator revoked or changed since stays so.
        ensure_role(conn, identities.project_id, operator, "owner")
