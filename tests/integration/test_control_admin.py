"""Control's AdminService methods end to end: real mTLS gRPC, real PostgreSQL, the admin
role's own pool (docs/decisions/0002).

Ingress is played by a client holding ingress's certificate, which is what control
trusts, with a cluster admin's caller envelope. Answers, typed errors (gRPC code +
ErrorInfo reason + the field) and the rows behind them are checked; a replica without
an admin database answers UNAVAILABLE; `qinglong-control bootstrap-admin` runs as a real
process. No secret reaches a log line. Last, the whole chain through ingress
(tests/support/stack.py).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import stat
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import psycopg
import pytest
from qinglong.admin.v1 import admin_pb2, admin_service_pb2, admin_service_pb2_grpc
from qinglong.control.v1 import run_service_pb2, run_service_pb2_grpc
from qinglong.rpc.v1 import execution_pb2
from qinglong.runtime.v1 import caller_pb2, runtime_service_pb2, runtime_service_pb2_grpc
from qinglong.worker.v1 import worker_service_pb2, worker_service_pb2_grpc
from qinglong_cli.pki import ensure_dev_pki, service_uri
from qinglong_control.db.identities import grant_cluster_admin
from qinglong_control.db.pool import open_admin_pool, open_runtime_pool
from qinglong_control.domain.timings import Timings
from qinglong_control.server import create_server
from qinglong_control.servicer import RuntimeServicer
from qinglong_control.settings import ControlSettings
from qinglong_protocol.errors import error_reason_of, field_violations_of
from qinglong_protocol.identities import worker_uri
from qinglong_protocol.pooling import PoolSizing
from qinglong_protocol.tls import mutual_tls_channel_credentials

from tests.support.calls import failure, opened_session
from tests.support.postgres import MigratedDatabase
from tests.support.stack import Stack
from tests.support.world import PROJECT, enroll

rt = runtime_service_pb2
api = admin_service_pb2
TRUST_DOMAIN = "example.org"
ROOT = caller_pb2.Caller(
    principal_kind=caller_pb2.PRINCIPAL_KIND_USER, principal_id=str(uuid.uuid4())
)
WORKER = "worker-a"


@dataclass(frozen=True)
class Control:
    stub: runtime_service_pb2_grpc.RuntimeServiceStub
    unconfigured: runtime_service_pb2_grpc.RuntimeServiceStub
    database: MigratedDatabase


@pytest.fixture
async def control(
    database_pg18: MigratedDatabase, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Control]:
    """Two replicas on one database: one with the admin pool, one without; ROOT is an
    active cluster admin there (control checks the caller ingress vouched for)."""
    enroll(database_pg18, WORKER)
    with psycopg.connect(database_pg18.urls.migration, autocommit=True) as conn:
        enroll_user(conn, ROOT.principal_id, "root")
    pki = ensure_dev_pki(tmp_path_factory.mktemp("pki"))
    runtime = await open_runtime_pool(database_pg18.urls.runtime, sizing=PoolSizing(1, 4))
    admin_pool = await open_admin_pool(database_pg18.urls.admin)
    settings = ControlSettings(
        listen_address="127.0.0.1:0",
        tls=pki.control_server,
        allowed_caller_uris=frozenset({service_uri(pki.trust_domain, "ingress")}),
    )
    servers = []
    channels = []
    for admin in (admin_pool, None):
        servicer = RuntimeServicer(runtime, Timings(), admin_pool=admin, trust_domain=TRUST_DOMAIN)
        server, port = await create_server(settings, runtime_servicer=servicer)
        await server.start()
        servers.append(server)
        channels.append(
            grpc.aio.secure_channel(
                f"127.0.0.1:{port}", mutual_tls_channel_credentials(pki.ingress_client)
            )
        )
    try:
        stubs = [runtime_service_pb2_grpc.RuntimeServiceStub(channel) for channel in channels]
        yield Control(stubs[0], stubs[1], database_pg18)
    finally:
        for channel in channels:
            await channel.close()
        for server in servers:
            await server.stop(None)
        await admin_pool.close()
        await runtime.close()


async def test_projects_principals_tokens_and_roles_over_mtls(
    control: Control, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    stub = control.stub
    created = await stub.CreateProject(
        rt.CreateProjectRequest(
            caller=ROOT,
            request=api.CreateProjectRequest(
                request_id="p-1", project_id="proj-x", display_name="Project X"
            ),
        )
    )
    project = created.response.project
    assert (project.project_id, project.state, project.version) == (
        "proj-x",
        admin_pb2.RESOURCE_STATE_ACTIVE,
        1,
    )
    taken = await failure(
        stub.CreateProject(
            rt.CreateProjectRequest(
                caller=ROOT,
                request=api.CreateProjectRequest(
                    request_id="p-2", project_id="proj-x", display_name="Again"
                ),
            )
        )
    )
    assert (taken.code(), error_reason_of(taken)) == (
        grpc.StatusCode.ALREADY_EXISTS,
        "ALREADY_EXISTS",
    )
    first = await stub.ListProjects(
        rt.ListProjectsRequest(caller=ROOT, request=api.ListProjectsRequest(page_size=1))
    )
    assert first.response.next_page_token
    second = await stub.ListProjects(
        rt.ListProjectsRequest(
            caller=ROOT,
            request=api.ListProjectsRequest(page_size=1, page_token=first.response.next_page_token),
        )
    )
    listed = [p.project_id for p in (*first.response.projects, *second.response.projects)]
    assert sorted(listed) == sorted([PROJECT, "proj-x"])
    assert second.response.next_page_token == ""
    forged = await failure(
        stub.ListProjects(
            rt.ListProjectsRequest(
                caller=ROOT, request=api.ListProjectsRequest(page_token="bm90LW91cnM")
            )
        )
    )
    assert error_reason_of(forged) == "FIELD_INVALID"
    assert [field for field, _ in field_violations_of(forged)] == ["page_token"]

    alice = (
        await stub.CreatePrincipal(
            rt.CreatePrincipalRequest(
                caller=ROOT,
                request=api.CreatePrincipalRequest(
                    request_id="u-1", kind=admin_pb2.PRINCIPAL_KIND_USER, name="alice"
                ),
            )
        )
    ).response.principal
    assert (alice.kind, alice.cluster_admin) == (admin_pb2.PRINCIPAL_KIND_USER, False)

    issue = rt.IssueTokenRequest(
        caller=ROOT,
        request=api.IssueTokenRequest(
            request_id="t-1", principal_id=alice.principal_id, ttl_seconds=3600
        ),
    )
    issued = (await stub.IssueToken(issue)).response
    secret = issued.token
    assert (len(secret), issued.issued.prefix) == (48, secret[:11])
    assert issued.issued.HasField("expire_time")
    replay = (await stub.IssueToken(issue)).response
    assert (replay.token, replay.issued) == ("", issued.issued)

    rotated = (
        await stub.RotateToken(
            rt.RotateTokenRequest(
                caller=ROOT,
                request=api.RotateTokenRequest(
                    request_id="r-1", token_id=issued.issued.token_id, overlap_seconds=60
                ),
            )
        )
    ).response
    assert len(rotated.token) == 48
    assert rotated.token != secret
    assert rotated.replaced.expire_time.ToMilliseconds() == (
        rotated.issued.created_at.ToMilliseconds() + 60_000
    )
    revoked = (
        await stub.RevokeToken(
            rt.RevokeTokenRequest(
                caller=ROOT, request=api.RevokeTokenRequest(token_id=rotated.issued.token_id)
            )
        )
    ).response.revoked
    assert revoked.state == admin_pb2.RESOURCE_STATE_DISABLED
    tokens = (
        await stub.ListTokens(
            rt.ListTokensRequest(
                caller=ROOT, request=api.ListTokensRequest(principal_id=alice.principal_id)
            )
        )
    ).response.tokens
    assert [t.token_id for t in tokens] == [rotated.issued.token_id, issued.issued.token_id]
    unknown = await failure(
        stub.RevokeToken(
            rt.RevokeTokenRequest(
                caller=ROOT, request=api.RevokeTokenRequest(token_id=str(uuid.uuid4()))
            )
        )
    )
    assert [field for field, _ in field_violations_of(unknown)] == ["token_id"]

    grant = rt.GrantRoleRequest(
        caller=ROOT,
        request=api.GrantRoleRequest(
            project_id="proj-x",
            principal_id=alice.principal_id,
            role=admin_pb2.PROJECT_ROLE_OPERATOR,
        ),
    )
    binding = (await stub.GrantRole(grant)).response.binding
    assert (binding.role, binding.version) == (admin_pb2.PROJECT_ROLE_OPERATOR, 1)
    revoked_binding = (
        await stub.RevokeRole(
            rt.RevokeRoleRequest(
                caller=ROOT,
                request=api.RevokeRoleRequest(project_id="proj-x", principal_id=alice.principal_id),
            )
        )
    ).response.binding
    assert (revoked_binding.state, revoked_binding.version) == (
        admin_pb2.RESOURCE_STATE_DISABLED,
        2,
    )
    bindings = (
        await stub.ListRoleBindings(
            rt.ListRoleBindingsRequest(
                caller=ROOT, request=api.ListRoleBindingsRequest(project_id="proj-x")
            )
        )
    ).response.bindings
    assert list(bindings) == [revoked_binding]
    missing = await failure(
        stub.ListRoleBindings(
            rt.ListRoleBindingsRequest(
                caller=ROOT, request=api.ListRoleBindingsRequest(project_id="proj-none")
            )
        )
    )
    assert (missing.code(), error_reason_of(missing)) == (
        grpc.StatusCode.NOT_FOUND,
        "PROJECT_NOT_FOUND",
    )

    principal = (
        await stub.DisablePrincipal(
            rt.DisablePrincipalRequest(
                caller=ROOT,
                request=api.DisablePrincipalRequest(principal_id=alice.principal_id),
            )
        )
    ).response.principal
    assert principal.state == admin_pb2.RESOURCE_STATE_DISABLED
    everyone = (
        await stub.ListPrincipals(
            rt.ListPrincipalsRequest(
                caller=ROOT,
                request=api.ListPrincipalsRequest(kind=admin_pb2.PRINCIPAL_KIND_USER),
            )
        )
    ).response.principals
    assert [p.name for p in everyone] == ["root", "alice"]  # root: the fixture's admin
    archived = (
        await stub.DisableProject(
            rt.DisableProjectRequest(
                caller=ROOT, request=api.DisableProjectRequest(project_id="proj-x")
            )
        )
    ).response.project
    assert (archived.state, archived.version) == (admin_pb2.RESOURCE_STATE_DISABLED, 2)
    assert not [s for s in (secret, rotated.token) if s in caplog.text]


async def test_workers_join_tokens_fleet_and_disable_over_mtls(
    control: Control, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    stub = control.stub
    created = (
        await stub.CreateWorker(
            rt.CreateWorkerRequest(
                caller=ROOT,
                request=api.CreateWorkerRequest(request_id="w-1", worker_id="worker-x"),
            )
        )
    ).response
    assert created.join_token.startswith("qlj1_")
    assert len(created.join_token) == 48
    assert created.worker.state == admin_pb2.RESOURCE_STATE_ACTIVE
    assert created.join_token_expire_time.ToMilliseconds() == (
        created.worker.created_at.ToMilliseconds() + 3_600_000
    )
    with psycopg.connect(control.database.urls.migration) as owner:
        row = owner.execute(
            "SELECT certificate_uri FROM qinglong.worker_identities WHERE worker_id = 'worker-x'"
        ).fetchone()
    assert row == (worker_uri(TRUST_DOMAIN, "worker-x"),)

    worker_caller = caller_pb2.Caller(
        principal_kind=caller_pb2.PRINCIPAL_KIND_WORKER, principal_id=WORKER, worker_id=WORKER
    )
    opened = (
        await stub.OpenSession(
            rt.OpenSessionRequest(
                caller=worker_caller,
                request=worker_service_pb2.OpenSessionRequest(
                    request_id="open-1",
                    worker_id=WORKER,
                    executor_types=[execution_pb2.EXECUTOR_TYPE_REMOTE_WORKER],
                    max_concurrent_attempts=3,
                    agent_version="v1.2.3",
                    passes_run_parameters=True,
                    labels={"gpu": "a100", "zone": "eu-1"},
                ),
            )
        )
    ).response
    fleet = (
        await stub.ListWorkers(
            rt.ListWorkersRequest(caller=ROOT, request=api.ListWorkersRequest(page_size=1))
        )
    ).response
    (worker,) = fleet.workers
    assert worker.worker_id == WORKER
    assert fleet.next_page_token
    assert (worker.session.session_id, worker.session.state) == (opened.session_id, "online")
    assert (worker.session.agent_version, worker.session.max_concurrent_attempts) == ("v1.2.3", 3)
    assert list(worker.session.executor_types) == [execution_pb2.EXECUTOR_TYPE_REMOTE_WORKER]
    assert worker.session.remaining.ToMilliseconds() > 0
    assert worker.session_count == 1
    assert worker.session.passes_run_parameters
    assert dict(worker.session.labels) == {"gpu": "a100", "zone": "eu-1"}
    # A Worker of an earlier version resuming the session renews it saying nothing of
    # parameters or labels: the fleet shows that it is no longer offered Runs that need
    # either.
    await stub.RenewSession(
        rt.RenewSessionRequest(
            caller=worker_caller,
            request=worker_service_pb2.RenewSessionRequest(
                worker_id=WORKER,
                session_id=opened.session_id,
                worker_generation=opened.worker_generation,
            ),
        )
    )
    renewed = (
        await stub.ListWorkers(
            rt.ListWorkersRequest(caller=ROOT, request=api.ListWorkersRequest(page_size=1))
        )
    ).response.workers[0]
    assert not renewed.session.passes_run_parameters
    assert dict(renewed.session.labels) == {}

    disabled = (
        await stub.DisableWorker(
            rt.DisableWorkerRequest(caller=ROOT, request=api.DisableWorkerRequest(worker_id=WORKER))
        )
    ).response.worker
    assert disabled.state == admin_pb2.RESOURCE_STATE_DISABLED
    assert (disabled.session.state, disabled.session.remaining.ToMilliseconds()) == ("fenced", 0)
    renew = await failure(
        stub.RenewSession(
            rt.RenewSessionRequest(
                caller=worker_caller,
                request=worker_service_pb2.RenewSessionRequest(
                    worker_id=WORKER,
                    session_id=opened.session_id,
                    worker_generation=opened.worker_generation,
                ),
            )
        )
    )
    assert (renew.code(), error_reason_of(renew)) == (grpc.StatusCode.ABORTED, "SESSION_FENCED")
    unknown = await failure(
        stub.DisableWorker(
            rt.DisableWorkerRequest(
                caller=ROOT, request=api.DisableWorkerRequest(worker_id="worker-none")
            )
        )
    )
    assert [field for field, _ in field_violations_of(unknown)] == ["worker_id"]
    assert created.join_token not in caplog.text


async def test_a_new_join_token_for_an_enrolled_worker_over_mtls(
    control: Control, caplog: pytest.LogCaptureFixture
) -> None:
    """IssueJoinToken: the token once, the first one ended, a retry without a token; a
    disabled Worker is FAILED_PRECONDITION / WORKER_DISABLED, an unknown one NOT_FOUND."""
    caplog.set_level(logging.DEBUG)
    stub = control.stub
    created = (
        await stub.CreateWorker(
            rt.CreateWorkerRequest(
                caller=ROOT,
                request=api.CreateWorkerRequest(request_id="w-1", worker_id="worker-x"),
            )
        )
    ).response

    def issue(request_id: str, worker_id: str = "worker-x") -> rt.IssueJoinTokenRequest:
        return rt.IssueJoinTokenRequest(
            caller=ROOT,
            request=api.IssueJoinTokenRequest(
                request_id=request_id, worker_id=worker_id, ttl_seconds=600
            ),
        )

    issued = (await stub.IssueJoinToken(issue("j-1"))).response
    assert issued.join_token.startswith("qlj1_")
    assert len(issued.join_token) == 48
    assert (issued.worker.worker_id, issued.worker.state) == (
        "worker-x",
        admin_pb2.RESOURCE_STATE_ACTIVE,
    )
    # Ten minutes (ttl_seconds) from its issue, which is after the Worker was made.
    issued_at = issued.join_token_expire_time.ToMilliseconds() - 600_000
    assert issued_at > created.worker.created_at.ToMilliseconds()
    replay = (await stub.IssueJoinToken(issue("j-1"))).response
    assert (replay.join_token, replay.join_token_expire_time) == (
        "",
        issued.join_token_expire_time,
    )
    first, second = (
        hashlib.sha256(token.encode()).hexdigest()
        for token in (created.join_token, issued.join_token)
    )
    with psycopg.connect(control.database.urls.migration) as owner:
        usable = owner.execute(
            "SELECT token_digest, used_at_ms IS NULL FROM qinglong.worker_join_tokens"
            " WHERE token_digest = ANY(%s)",
            ([first, second],),
        ).fetchall()
    assert dict(usable) == {first: False, second: True}  # the first one is ended
    unknown = await failure(stub.IssueJoinToken(issue("j-2", "worker-none")))
    assert (unknown.code(), error_reason_of(unknown)) == (
        grpc.StatusCode.NOT_FOUND,
        "WORKER_NOT_FOUND",
    )
    assert [field for field, _ in field_violations_of(unknown)] == ["worker_id"]
    await stub.DisableWorker(
        rt.DisableWorkerRequest(caller=ROOT, request=api.DisableWorkerRequest(worker_id="worker-x"))
    )
    disabled = await failure(stub.IssueJoinToken(issue("j-3")))
    assert (disabled.code(), error_reason_of(disabled)) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "WORKER_DISABLED",
    )
    assert not [s for s in (created.join_token, issued.join_token) if s in caplog.text]


async def test_the_last_cluster_admin_is_not_disabled_over_mtls(control: Control) -> None:
    """ROOT is the only cluster admin: disabling it (itself) is FAILED_PRECONDITION /
    LAST_CLUSTER_ADMIN; once there is another, it may go."""

    def disable(principal_id: str) -> rt.DisablePrincipalRequest:
        return rt.DisablePrincipalRequest(
            caller=ROOT, request=api.DisablePrincipalRequest(principal_id=principal_id)
        )

    last = await failure(control.stub.DisablePrincipal(disable(ROOT.principal_id)))
    assert (last.code(), error_reason_of(last)) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "LAST_CLUSTER_ADMIN",
    )
    chief = (
        await control.stub.CreatePrincipal(
            rt.CreatePrincipalRequest(
                caller=ROOT,
                request=api.CreatePrincipalRequest(
                    request_id="u-chief",
                    kind=admin_pb2.PRINCIPAL_KIND_USER,
                    name="chief",
                    cluster_admin=True,
                ),
            )
        )
    ).response.principal
    assert chief.cluster_admin
    gone = (await control.stub.DisablePrincipal(disable(ROOT.principal_id))).response.principal
    assert (gone.principal_id, gone.state) == (ROOT.principal_id, admin_pb2.RESOURCE_STATE_DISABLED)


async def test_audit_records_over_mtls(control: Control) -> None:
    # Rows at chosen times: as the schema's owner (ingress's rows take DB time, 0015).
    with psycopg.connect(control.database.urls.migration, autocommit=True) as owner:
        for index in range(3):
            owner.execute(
                "INSERT INTO qinglong.security_audit (audit_id, occurred_at_ms, principal_kind,"
                " principal_id, operation, outcome, reason, run_id)"
                " VALUES (%s, %s, 'user', 'u-1', 'AdminService/CreateProject', %s, %s, %s)",
                (
                    uuid.uuid4(),
                    1_800_000_000_000 + index,
                    "admitted" if index else "permission_denied",
                    None if index else "PERMISSION_DENIED",
                    uuid.uuid4() if index == 2 else None,
                ),
            )
    request = api.ListAuditRecordsRequest(page_size=2, principal_id="u-1")
    first = (
        await control.stub.ListAuditRecords(
            rt.ListAuditRecordsRequest(caller=ROOT, request=request)
        )
    ).response
    assert [r.occur_time.ToMilliseconds() for r in first.records] == [
        1_800_000_000_002,
        1_800_000_000_001,
    ]
    assert first.records[0].run_id
    request.page_token = first.next_page_token
    rest = (
        await control.stub.ListAuditRecords(
            rt.ListAuditRecordsRequest(caller=ROOT, request=request)
        )
    ).response
    ((oldest),) = rest.records
    assert (oldest.outcome, oldest.reason, oldest.run_id) == (
        admin_pb2.AUDIT_OUTCOME_PERMISSION_DENIED,
        "PERMISSION_DENIED",
        "",
    )
    assert rest.next_page_token == ""
    windowed = api.ListAuditRecordsRequest(outcome=admin_pb2.AUDIT_OUTCOME_ADMITTED)
    windowed.end_time.FromMilliseconds(1_800_000_000_002)
    only = (
        await control.stub.ListAuditRecords(
            rt.ListAuditRecordsRequest(caller=ROOT, request=windowed)
        )
    ).response.records
    assert [r.occur_time.ToMilliseconds() for r in only] == [1_800_000_000_001]


async def test_a_replica_without_the_admin_database_answers_unavailable(
    control: Control,
) -> None:
    refused = await failure(
        control.unconfigured.ListProjects(
            rt.ListProjectsRequest(caller=ROOT, request=api.ListProjectsRequest())
        )
    )
    assert (refused.code(), error_reason_of(refused)) == (
        grpc.StatusCode.UNAVAILABLE,
        "STORAGE_UNAVAILABLE",
    )
    assert "--admin-database-url" in (refused.details() or "")


async def test_only_an_operator_envelope_is_administered(control: Control) -> None:
    worker = caller_pb2.Caller(
        principal_kind=caller_pb2.PRINCIPAL_KIND_WORKER, principal_id=WORKER, worker_id=WORKER
    )
    not_uuid = caller_pb2.Caller(principal_kind=caller_pb2.PRINCIPAL_KIND_USER, principal_id="x")
    for caller in (worker, not_uuid):
        refused = await failure(
            control.stub.ListWorkers(
                rt.ListWorkersRequest(caller=caller, request=api.ListWorkersRequest())
            )
        )
        assert error_reason_of(refused) == "FIELD_INVALID"


async def test_control_checks_the_cluster_admin_ingress_vouched_for(control: Control) -> None:
    # Disabled after ingress admitted the call, an agent an earlier version made an
    # admin, a principal that is no admin at all: control refuses each, nothing is read.
    with psycopg.connect(control.database.urls.migration, autocommit=True) as conn:
        disabled = enroll_user(conn, str(uuid.uuid4()), "gone")
        conn.execute(
            "UPDATE qinglong.principals SET status = 'disabled' WHERE principal_id = %s",
            (disabled,),
        )
        agent = enroll_user(conn, str(uuid.uuid4()), "bot-admin", kind="agent")
        plain = str(uuid.uuid4())
        conn.execute(
            "INSERT INTO qinglong.principals (principal_id, kind, name) VALUES (%s, 'user', 'p')",
            (plain,),
        )
    for principal_id, kind in (
        (disabled, caller_pb2.PRINCIPAL_KIND_USER),
        (agent, caller_pb2.PRINCIPAL_KIND_AGENT),
        (plain, caller_pb2.PRINCIPAL_KIND_USER),
    ):
        caller = caller_pb2.Caller(principal_kind=kind, principal_id=principal_id)
        refused = await failure(
            control.stub.ListProjects(
                rt.ListProjectsRequest(caller=caller, request=api.ListProjectsRequest())
            )
        )
        assert (refused.code(), error_reason_of(refused)) == (
            grpc.StatusCode.PERMISSION_DENIED,
            "PERMISSION_DENIED",
        ), principal_id
    allowed = await control.stub.ListProjects(
        rt.ListProjectsRequest(caller=ROOT, request=api.ListProjectsRequest())
    )
    assert PROJECT in [p.project_id for p in allowed.response.projects]


def enroll_user(
    conn: psycopg.Connection[tuple[object, ...]], principal_id: str, name: str, kind: str = "user"
) -> str:
    """A cluster admin of ``kind`` with a fixed id (an agent only as an earlier version
    could write one)."""
    conn.execute(
        "INSERT INTO qinglong.principals (principal_id, kind, name) VALUES (%s, %s, %s)",
        (principal_id, kind, name),
    )
    grant_cluster_admin(conn, uuid.UUID(principal_id))
    return principal_id


# --- bootstrap-admin, as a process ------------------------------------------------------


def bootstrap(url: str, *arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).with_name("qinglong-control")), "bootstrap-admin", *arguments],
        env={"QINGLONG_MIGRATION_DATABASE_URL": url, "PATH": "/usr/bin"},
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


def test_bootstrap_admin_prints_the_token_once(database_pg18: MigratedDatabase) -> None:
    first = bootstrap(database_pg18.urls.migration)
    assert first.returncode == 0, first.stderr
    token = first.stdout.strip()
    assert token.startswith("qlo1_")
    assert len(token) == 48
    assert first.stdout == token + "\n"
    assert token not in first.stderr
    with psycopg.connect(database_pg18.urls.migration) as owner:
        row = owner.execute(
            "SELECT p.name, p.kind, c.token_digest FROM qinglong.principals p"
            " JOIN qinglong.cluster_admins a ON a.principal_id = p.principal_id"
            " JOIN qinglong.operator_credentials c ON c.principal_id = p.principal_id"
        ).fetchall()
    assert row == [("admin", "user", hashlib.sha256(token.encode()).hexdigest())]
    again = bootstrap(database_pg18.urls.admin, "--name", "other")  # the admin role works too
    assert (again.returncode, again.stdout) == (0, "")
    assert "exists already" in again.stderr
    with psycopg.connect(database_pg18.urls.migration) as owner:
        counts = owner.execute(
            "SELECT (SELECT count(*) FROM qinglong.principals),"
            " (SELECT count(*) FROM qinglong.operator_credentials)"
        ).fetchone()
    assert counts == (1, 1)


def test_bootstrap_admin_writes_a_private_token_file(
    database_pg18: MigratedDatabase, tmp_path: Path
) -> None:
    target = tmp_path / "admin.token"
    first = bootstrap(database_pg18.urls.migration, "--token-file", str(target))
    assert first.returncode == 0, first.stderr
    assert first.stdout == f"{target}\n"
    token = target.read_text().strip()
    assert (token.startswith("qlo1_"), len(token)) == (True, 48)
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600
    assert token not in first.stdout + first.stderr
    second = bootstrap(database_pg18.urls.migration, "--token-file", str(target))
    assert second.returncode == 0
    assert second.stdout == ""
    assert target.read_text().strip() == token  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["admin.token"]  # no leftovers


def test_bootstrap_admin_enrolls_a_token_from_a_mounted_secret(
    database_pg18: MigratedDatabase, tmp_path: Path
) -> None:
    """Kubernetes: the Job mounts a Secret holding a token made out of band; bootstrap
    enrolls its digest and shows nothing secret; a malformed file is refused unread."""
    token = "qlo1_" + base64.urlsafe_b64encode(os.urandom(32)).decode().rstrip("=")
    mounted = tmp_path / "token"
    mounted.write_text(token + "\n")
    bad = tmp_path / "bad"
    bad.write_text("not-a-token-but-a-secret")
    refused = bootstrap(database_pg18.urls.migration, "--token-from-file", str(bad))
    assert refused.returncode == 2
    assert "not-a-token-but-a-secret" not in refused.stdout + refused.stderr
    enrolled = bootstrap(database_pg18.urls.migration, "--token-from-file", str(mounted))
    assert enrolled.returncode == 0, enrolled.stderr
    assert token not in enrolled.stdout + enrolled.stderr
    with psycopg.connect(database_pg18.urls.migration) as owner:
        digests = owner.execute(
            "SELECT c.token_digest FROM qinglong.operator_credentials c"
            " JOIN qinglong.cluster_admins a USING (principal_id)"
        ).fetchall()
    assert digests == [(hashlib.sha256(token.encode()).hexdigest(),)]
    again = bootstrap(database_pg18.urls.migration, "--token-from-file", str(mounted))
    assert (again.returncode, again.stdout) == (0, "")


# --- through ingress ---------------------------------------------------------------------


async def test_a_token_issued_through_ingress_works_until_revoked(stack: Stack) -> None:
    """The whole chain: a cluster admin (root) enrolls a user, issues its token and grants
    it a role through ingress; the token lists Runs, then stops at once when revoked. The
    token is in no audit row; a caller who is no cluster admin is refused by ingress."""
    root = (("authorization", f"Bearer {stack.tokens['root']}"),)
    async with stack.channel(stack.operator_identity("root")) as channel:
        admin_stub = admin_service_pb2_grpc.AdminServiceStub(channel)
        dora = (
            await admin_stub.CreatePrincipal(
                api.CreatePrincipalRequest(
                    request_id="u-dora", kind=admin_pb2.PRINCIPAL_KIND_USER, name="dora"
                ),
                metadata=root,
            )
        ).principal
        issued = await admin_stub.IssueToken(
            api.IssueTokenRequest(request_id="t-dora", principal_id=dora.principal_id),
            metadata=root,
        )
        await admin_stub.GrantRole(
            api.GrantRoleRequest(
                project_id=PROJECT,
                principal_id=dora.principal_id,
                role=admin_pb2.PROJECT_ROLE_VIEWER,
            ),
            metadata=root,
        )
        runs = run_service_pb2_grpc.RunServiceStub(channel)
        as_dora = (("authorization", f"Bearer {issued.token}"),)
        listed = await runs.ListRuns(
            run_service_pb2.ListRunsRequest(project_id=PROJECT), metadata=as_dora
        )
        assert list(listed.runs) == []
        await admin_stub.RevokeToken(
            api.RevokeTokenRequest(token_id=issued.issued.token_id), metadata=root
        )
        revoked = await failure(
            runs.ListRuns(run_service_pb2.ListRunsRequest(project_id=PROJECT), metadata=as_dora)
        )
        assert revoked.code() == grpc.StatusCode.UNAUTHENTICATED
        alice = (("authorization", f"Bearer {stack.tokens['alice']}"),)
        denied = await failure(admin_stub.ListWorkers(api.ListWorkersRequest(), metadata=alice))
        assert denied.code() == grpc.StatusCode.PERMISSION_DENIED
    audit = stack.audit_rows()
    assert {row["operation"] for row in audit} >= {
        "AdminService/CreatePrincipal",
        "AdminService/IssueToken",
        "AdminService/RevokeToken",
    }
    assert issued.token not in repr(audit)
    assert issued.token[5:] not in repr(audit)


async def test_get_project_and_principal_over_mtls(control: Control) -> None:
    """GetProject and GetPrincipal answer what the listings show; a missing one is
    NOT_FOUND with its typed reason, naming the request field."""
    stub = control.stub
    project = (
        await stub.GetProject(
            rt.GetProjectRequest(caller=ROOT, request=api.GetProjectRequest(project_id=PROJECT))
        )
    ).response.project
    every = rt.ListProjectsRequest(caller=ROOT, request=api.ListProjectsRequest())
    listed = (await stub.ListProjects(every)).response.projects
    assert project == next(p for p in listed if p.project_id == PROJECT)
    root = (
        await stub.GetPrincipal(
            rt.GetPrincipalRequest(
                caller=ROOT, request=api.GetPrincipalRequest(principal_id=ROOT.principal_id)
            )
        )
    ).response.principal
    assert (root.name, root.kind, root.cluster_admin, root.state) == (
        "root",
        admin_pb2.PRINCIPAL_KIND_USER,
        True,
        admin_pb2.RESOURCE_STATE_ACTIVE,
    )
    missing_project = await failure(
        stub.GetProject(
            rt.GetProjectRequest(caller=ROOT, request=api.GetProjectRequest(project_id="proj-none"))
        )
    )
    assert (missing_project.code(), error_reason_of(missing_project)) == (
        grpc.StatusCode.NOT_FOUND,
        "PROJECT_NOT_FOUND",
    )
    assert [field for field, _ in field_violations_of(missing_project)] == ["project_id"]
    missing_principal = await failure(
        stub.GetPrincipal(
            rt.GetPrincipalRequest(
                caller=ROOT, request=api.GetPrincipalRequest(principal_id=str(uuid.uuid4()))
            )
        )
    )
    assert (missing_principal.code(), error_reason_of(missing_principal)) == (
        grpc.StatusCode.NOT_FOUND,
        "PRINCIPAL_NOT_FOUND",
    )
    assert [field for field, _ in field_violations_of(missing_principal)] == ["principal_id"]
    unconfigured = await failure(
        control.unconfigured.GetProject(
            rt.GetProjectRequest(caller=ROOT, request=api.GetProjectRequest(project_id=PROJECT))
        )
    )
    assert unconfigured.code() == grpc.StatusCode.UNAVAILABLE


async def test_get_project_and_principal_through_ingress(stack: Stack) -> None:
    """Both reads through ingress for a cluster admin (audited like every call); NOT_FOUND
    reaches the caller typed; a caller who is no cluster admin is refused by ingress."""
    root = (("authorization", f"Bearer {stack.tokens['root']}"),)
    alice = (("authorization", f"Bearer {stack.tokens['alice']}"),)
    async with stack.channel(stack.operator_identity("root")) as channel:
        admin_stub = admin_service_pb2_grpc.AdminServiceStub(channel)
        project = (
            await admin_stub.GetProject(api.GetProjectRequest(project_id=PROJECT), metadata=root)
        ).project
        assert (project.project_id, project.state) == (PROJECT, admin_pb2.RESOURCE_STATE_ACTIVE)
        users = (
            await admin_stub.ListPrincipals(
                api.ListPrincipalsRequest(kind=admin_pb2.PRINCIPAL_KIND_USER), metadata=root
            )
        ).principals
        for listed in users:
            got = await admin_stub.GetPrincipal(
                api.GetPrincipalRequest(principal_id=listed.principal_id), metadata=root
            )
            assert got.principal == listed
        assert [p.name for p in users if p.cluster_admin] == ["root"]
        missing = await failure(
            admin_stub.GetProject(api.GetProjectRequest(project_id="proj-none"), metadata=root)
        )
        assert (missing.code(), error_reason_of(missing)) == (
            grpc.StatusCode.NOT_FOUND,
            "PROJECT_NOT_FOUND",
        )
        nobody = await failure(
            admin_stub.GetPrincipal(
                api.GetPrincipalRequest(principal_id=str(uuid.uuid4())), metadata=root
            )
        )
        assert (nobody.code(), error_reason_of(nobody)) == (
            grpc.StatusCode.NOT_FOUND,
            "PRINCIPAL_NOT_FOUND",
        )
        denied = await failure(
            admin_stub.GetProject(api.GetProjectRequest(project_id=PROJECT), metadata=alice)
        )
        assert denied.code() == grpc.StatusCode.PERMISSION_DENIED
    audit = [row for row in stack.audit_rows() if row["operation"].startswith("AdminService/Get")]
    assert {(row["operation"], row["outcome"]) for row in audit} == {
        ("AdminService/GetProject", "admitted"),
        ("AdminService/GetPrincipal", "admitted"),
        ("AdminService/GetProject", "permission_denied"),
    }


async def test_a_tokens_last_use_through_ingress(stack: Stack) -> None:
    """Each call a bearer token authenticates records the token in its audit row, and
    ListTokens shows the newest as its last use; a token never used shows none. Calls by
    certificate — a Worker's, an operator's — record no credential."""
    root = (("authorization", f"Bearer {stack.tokens['root']}"),)
    async with stack.channel(stack.operator_identity("root")) as channel:
        admin_stub = admin_service_pb2_grpc.AdminServiceStub(channel)
        dora = (
            await admin_stub.CreatePrincipal(
                api.CreatePrincipalRequest(
                    request_id="u-dora", kind=admin_pb2.PRINCIPAL_KIND_USER, name="dora"
                ),
                metadata=root,
            )
        ).principal
        used, idle = [
            await admin_stub.IssueToken(
                api.IssueTokenRequest(request_id=request_id, principal_id=dora.principal_id),
                metadata=root,
            )
            for request_id in ("t-used", "t-idle")
        ]
        await admin_stub.GrantRole(
            api.GrantRoleRequest(
                project_id=PROJECT,
                principal_id=dora.principal_id,
                role=admin_pb2.PROJECT_ROLE_VIEWER,
            ),
            metadata=root,
        )
        runs = run_service_pb2_grpc.RunServiceStub(channel)
        as_dora = (("authorization", f"Bearer {used.token}"),)
        listing = run_service_pb2.ListRunsRequest(project_id=PROJECT)
        for _ in range(2):
            await runs.ListRuns(listing, metadata=as_dora)
        tokens = {
            t.token_id: t
            for t in (
                await admin_stub.ListTokens(
                    api.ListTokensRequest(principal_id=dora.principal_id), metadata=root
                )
            ).tokens
        }
    async with stack.channel(stack.operator_identity("carol")) as channel:
        await run_service_pb2_grpc.RunServiceStub(channel).ListRuns(
            run_service_pb2.ListRunsRequest(project_id=PROJECT)
        )
    async with stack.channel(stack.worker_identity("worker-a")) as channel:
        await opened_session(worker_service_pb2_grpc.WorkerServiceStub(channel), "worker-a")
    audit = stack.audit_rows()
    by_dora = [row for row in audit if row["credential_id"] == uuid.UUID(used.issued.token_id)]
    assert [row["operation"] for row in by_dora] == ["RunService/ListRuns"] * 2
    assert {row["principal_id"] for row in by_dora} == {dora.principal_id}
    last = tokens[used.issued.token_id]
    assert last.HasField("last_used_time")
    assert last.last_used_time.ToMilliseconds() == max(row["occurred_at_ms"] for row in by_dora)
    assert not tokens[idle.issued.token_id].HasField("last_used_time")
    admin_rows = [row for row in audit if row["operation"].startswith("AdminService/")]
    assert len({row["credential_id"] for row in admin_rows}) == 1  # root's own token
    assert None not in {row["credential_id"] for row in admin_rows}
    worker_rows = [row for row in audit if row["principal_kind"] == "worker"]
    assert worker_rows
    assert {row["credential_id"] for row in worker_rows} == {None}
    carol_rows = [
        row
        for row in audit
        if row["operation"] == "RunService/ListRuns" and row["principal_id"] != dora.principal_id
    ]
    assert len(carol_rows) == 1
    assert carol_rows[0]["credential_id"] is None
    assert used.token not in repr(audit)
