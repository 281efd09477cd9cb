"""Raw rows for schema-level tests, written as the runtime role.

These bypass the application on purpose: the point is to show what PostgreSQL itself
refuses, whoever writes.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass

import psycopg

# A fixed past instant: seeded leases and sessions are long expired by the database's clock
# unless a test passes a later expiry.
NOW_MS = 1_700_000_000_000
FAR_FUTURE_MS = 4_000_000_000_000


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class SeededAttempt:
    project_id: str
    run_id: uuid.UUID
    session_id: uuid.UUID
    offer_id: uuid.UUID
    attempt_id: uuid.UUID


def seed_identity(
    admin: psycopg.Connection[tuple[object, ...]], project_id: str, worker_id: str
) -> None:
    """Projects and worker identities are administered, not runtime data."""
    admin.execute(
        "INSERT INTO qinglong.projects (project_id, display_name) VALUES (%s, %s)",
        (project_id, project_id),
    )
    principal_id = uuid.uuid4()
    admin.execute(
        "INSERT INTO qinglong.principals (principal_id, kind, name) VALUES (%s, 'worker', %s)",
        (principal_id, worker_id),
    )
    admin.execute(
        "INSERT INTO qinglong.worker_identities (worker_id, principal_id, certificate_uri)"
        " VALUES (%s, %s, %s)",
        (worker_id, principal_id, f"spiffe://qinglong.local/worker/{worker_id}"),
    )


def seed_claimed_attempt(
    runtime: psycopg.Connection[tuple[object, ...]],
    project_id: str,
    worker_id: str,
    *,
    run_state: str = "dispatching",
    lease_expires_at_ms: int = NOW_MS + 30_000,
) -> SeededAttempt:
    """A queued Run placed, offered and claimed: Attempt `claimed`, Lease `leased` v1.

    `run_state="queued"` leaves the Run queued beside its claimed Attempt (the shape an
    older claim protocol leaves behind), for convergence tests."""
    task_id, revision_id, run_id = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    session_id, offer_id, attempt_id = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    token_digest = digest(f"token-{attempt_id}")
    runtime.execute(
        "INSERT INTO qinglong.tasks (task_id, project_id, display_name, create_request_id,"
        " created_by) VALUES (%s, %s, 'seeded task', %s, 'test')",
        (task_id, project_id, f"req-{task_id.hex}"),
    )
    runtime.execute(
        "INSERT INTO qinglong.task_revisions (revision_id, project_id, task_id, revision_number,"
        " executor_type, command, timeout_ms, create_request_id, created_by)"
        " VALUES (%s, %s, %s, 1, 'remote_worker', '[\"true\"]', 60000, 'seed', 'test')",
        (revision_id, project_id, task_id),
    )
    runtime.execute(
        "INSERT INTO qinglong.runs (run_id, project_id, task_id, revision_id, state, executor_type,"
        " trigger_request_id, triggered_by, created_at_ms, updated_at_ms)"
        " VALUES (%s, %s, %s, %s, 'queued', 'remote_worker', %s, 'test', %s, %s)",
        (run_id, project_id, task_id, revision_id, f"req-{run_id.hex}", NOW_MS, NOW_MS),
    )
    runtime.execute(
        "INSERT INTO qinglong.worker_sessions (session_id, worker_id, generation, status,"
        " executor_types, max_concurrency, open_request_id, opened_at_ms, renewed_at_ms,"
        " expires_at_ms)"
        " VALUES (%s, %s, 1, 'online', ARRAY['remote_worker'], 4, 'seed', %s, %s, %s)",
        (session_id, worker_id, NOW_MS, NOW_MS, NOW_MS + 30_000),
    )
    runtime.execute(
        "INSERT INTO qinglong.offers (offer_id, run_id, session_id, worker_id, worker_generation,"
        " state, created_at_ms, expires_at_ms, claimed_at_ms)"
        " VALUES (%s, %s, %s, %s, 1, 'claimed', %s, %s, %s)",
        (offer_id, run_id, session_id, worker_id, NOW_MS, NOW_MS + 10_000, NOW_MS),
    )
    runtime.execute(
        "UPDATE qinglong.runs SET state = %s, attempt_count = 1 WHERE run_id = %s",
        (run_state, run_id),
    )
    runtime.execute(
        "INSERT INTO qinglong.attempts (attempt_id, run_id, attempt_number, state, executor_type,"
        " worker_id, session_id, worker_generation, offer_id, lease_generation, lease_version,"
        " lease_token_digest, claimed_at_ms)"
        " VALUES (%s, %s, 1, 'claimed', 'remote_worker', %s, %s, 1, %s, 1, 1, %s, %s)",
        (attempt_id, run_id, worker_id, session_id, offer_id, token_digest, NOW_MS),
    )
    runtime.execute(
        "INSERT INTO qinglong.run_leases (attempt_id, run_id, worker_id, session_id,"
        " worker_generation, offer_id, lease_generation, token_digest, version, status,"
        " acquired_at_ms, renewed_at_ms, expires_at_ms)"
        " VALUES (%s, %s, %s, %s, 1, %s, 1, %s, 1, 'leased', %s, %s, %s)",
        (
            attempt_id,
            run_id,
            worker_id,
            session_id,
            offer_id,
            token_digest,
            NOW_MS,
            NOW_MS,
            lease_expires_at_ms,
        ),
    )
    return SeededAttempt(project_id, run_id, session_id, offer_id, attempt_id)
