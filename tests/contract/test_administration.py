"""Administration's transactions (R-ADM-1..3, docs/decisions/0002) as the admin role, on
PostgreSQL 16 and 18: creates and their replays (the secret shown once), taken names,
disabling and revoking, token rotation with overlap, binding versions (and a revoked
binding fencing a cancel, R-CAN-3), the fleet view, a disabled Worker's fenced sessions,
the audit listing, the bootstrap of the first cluster admin — and no secret anywhere but
the one answer that created it."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from qinglong_control.db import admin, cancellation, enrollment, lease_control, placement, sessions
from qinglong_control.db.audit_retention import prune_audit
from qinglong_control.db.events import Actor
from qinglong_control.db.identities import (
    bind_role,
    enroll_operator_token,
    ensure_project,
    revoke_role,
)
from qinglong_control.db.sql import SQL
from qinglong_control.domain.administration import AuditFilter
from qinglong_control.domain.cancellation import BindingSnapshot, CancelOutcome
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_ingress.audit import AuditOutcome
from qinglong_ingress.directory import AuditEntry, AuditRecord, Directory, OperatorRow, WorkerClaim
from qinglong_ingress.pool import open_ingress_pool
from qinglong_protocol.identities import worker_uri
from qinglong_protocol.pooling import PoolSizing

from tests.support.locks import until_waiting
from tests.support.plans import scans_of
from tests.support.postgres import MigratedDatabase
from tests.support.world import PROJECT, World

Conn = psycopg.AsyncConnection[Any]
HOUR_MS = 3_600_000

#: The URI a Worker named worker-x is enrolled under, in trust domain "t".
X_URI = worker_uri("t", "worker-x")


@pytest.fixture
async def conn(database: MigratedDatabase) -> AsyncIterator[Conn]:
    """A connection as the admin role, the only one administration uses."""
    connection = await psycopg.AsyncConnection.connect(database.urls.admin, autocommit=True)
    try:
        yield connection
    finally:
        await connection.close()


async def db_now(conn: Conn) -> int:
    row = await (await conn.execute("SELECT qinglong.db_now_ms()")).fetchone()
    assert row is not None
    return int(row[0])


async def refused(command: Any) -> Refused:
    with pytest.raises(Refused) as caught:
        await command
    return caught.value


async def user(conn: Conn, name: str, *, cluster_admin: bool = False) -> uuid.UUID:
    row = await admin.create_principal(
        conn, f"user-{name}", "user", name, cluster_admin=cluster_admin
    )
    return row.principal_id


# --- projects ----------------------------------------------------------------------------


async def test_create_project_replays_and_refuses_a_taken_id(conn: Conn) -> None:
    created = await admin.create_project(conn, "req-1", "proj-x", "Project X")
    assert (created.project_id, created.status, created.version) == ("proj-x", "active", 1)
    assert await admin.create_project(conn, "req-1", "proj-x", "Project X") == created
    # A retry answers with what the first call made, whatever else it says.
    assert await admin.create_project(conn, "req-1", "proj-y", "Y") == created
    taken = await refused(admin.create_project(conn, "req-2", "proj-x", "Again"))
    assert taken.reason is Reason.ALREADY_EXISTS
    cursor = await conn.execute("SELECT count(*) FROM qinglong.projects")
    assert await cursor.fetchone() == (1,)


async def test_projects_page_oldest_first(conn: Conn) -> None:
    for index in range(5):
        await admin.create_project(conn, f"req-{index}", f"proj-{index}", f"P{index}")
    seen: list[str] = []
    after = None
    while True:
        page = await admin.list_projects(conn, limit=2, after=after)
        seen += [row.project_id for row in page.rows]
        if not page.more:
            break
        last = page.rows[-1]
        after = (last.created_at_ms, last.project_id)
    assert seen == [f"proj-{index}" for index in range(5)]
    whole = await admin.list_projects(conn, limit=5, after=None)
    assert not whole.more  # an exactly full last page has no next page


async def test_disable_project_archives_it_and_advances_its_version(conn: Conn) -> None:
    await admin.create_project(conn, "req-1", "proj-x", "Project X")
    disabled = await admin.disable_project(conn, "proj-x")
    assert (disabled.status, disabled.version) == ("archived", 2)
    assert await admin.disable_project(conn, "proj-x") == disabled  # nothing more changes
    missing = await refused(admin.disable_project(conn, "proj-none"))
    assert missing.reason is Reason.PROJECT_NOT_FOUND


async def test_get_project_reads_it_active_or_disabled(conn: Conn) -> None:
    created = await admin.create_project(conn, "req-1", "proj-x", "Project X")
    assert await admin.get_project(conn, "proj-x") == created
    disabled = await admin.disable_project(conn, "proj-x")
    assert await admin.get_project(conn, "proj-x") == disabled
    missing = await refused(admin.get_project(conn, "proj-none"))
    assert (missing.reason, missing.field) == (Reason.PROJECT_NOT_FOUND, "project_id")


async def test_concurrent_creates_make_one_row_and_show_one_secret(
    conn: Conn, database: MigratedDatabase
) -> None:
    """Retries racing each other (a lost answer, a client retrying at once) create once."""
    others = [
        await psycopg.AsyncConnection.connect(database.urls.admin, autocommit=True)
        for _ in range(6)
    ]
    try:
        same = await asyncio.gather(
            *(admin.create_project(other, "req-1", "proj-r", "R") for other in others)
        )
        assert len(set(same)) == 1
        racing = await asyncio.gather(
            *(
                admin.create_project(other, f"req-{index}-b", "proj-s", "S")
                for index, other in enumerate(others)
            ),
            return_exceptions=True,
        )
        lost = [r for r in racing if isinstance(r, Refused)]
        assert len(lost) == len(others) - 1
        assert {r.reason for r in lost} == {Reason.ALREADY_EXISTS}
        alice = await user(conn, "alice")
        issued = await asyncio.gather(
            *(admin.issue_token(other, alice, "issue-1", None) for other in others)
        )
        assert len({i.token for i in issued}) == 1
        assert len([i.secret for i in issued if i.secret]) == 1
    finally:
        for other in others:
            await other.close()


# --- principals --------------------------------------------------------------------------


async def test_create_principal_replays_and_names_are_unique_per_kind(conn: Conn) -> None:
    root = await admin.create_principal(conn, "req-1", "user", "root", cluster_admin=True)
    assert (root.kind, root.name, root.status, root.cluster_admin) == (
        "user",
        "root",
        "active",
        True,
    )
    assert await admin.create_principal(conn, "req-1", "user", "root", cluster_admin=True) == root
    taken = await refused(
        admin.create_principal(conn, "req-2", "user", "root", cluster_admin=False)
    )
    assert taken.reason is Reason.ALREADY_EXISTS
    agent = await admin.create_principal(conn, "req-3", "agent", "root", cluster_admin=False)
    assert (agent.kind, agent.cluster_admin) == ("agent", False)
    # An agent as cluster admin could approve its own held requests through a user it made.
    admin_agent = await refused(
        admin.create_principal(conn, "req-4", "agent", "bot", cluster_admin=True)
    )
    assert (admin_agent.reason, admin_agent.field) == (Reason.FIELD_INVALID, "cluster_admin")
    cursor = await conn.execute("SELECT principal_id FROM qinglong.cluster_admins")
    assert await cursor.fetchall() == [(root.principal_id,)]
    cursor = await conn.execute("SELECT count(*) FROM qinglong.principals WHERE name = 'bot'")
    assert await cursor.fetchone() == (0,)


async def test_principals_page_by_kind(conn: Conn) -> None:
    for index in range(3):
        await admin.create_principal(
            conn, f"u-{index}", "user", f"user-{index}", cluster_admin=False
        )
        await admin.create_principal(
            conn, f"a-{index}", "agent", f"bot-{index}", cluster_admin=False
        )
    users: list[str] = []
    after = None
    while True:
        page = await admin.list_principals(conn, kinds=("user",), limit=2, after=after)
        users += [row.name for row in page.rows]
        if not page.more:
            break
        after = (page.rows[-1].created_at_ms, page.rows[-1].principal_id)
    assert sorted(users) == ["user-0", "user-1", "user-2"]
    everyone = await admin.list_principals(
        conn, kinds=("user", "agent", "worker"), limit=50, after=None
    )
    assert len(everyone.rows) == 6
    assert not everyone.more


async def test_disable_principal(conn: Conn) -> None:
    alice = await user(conn, "alice")
    disabled = await admin.disable_principal(conn, alice)
    assert disabled.status == "disabled"
    assert await admin.disable_principal(conn, alice) == disabled
    unknown = await refused(admin.disable_principal(conn, uuid.uuid4()))
    assert (unknown.reason, unknown.field) == (Reason.PRINCIPAL_NOT_FOUND, "principal_id")
    enrolled = await admin.create_worker(conn, "w-1", "worker-x", X_URI, None)
    worker = await refused(admin.disable_principal(conn, enrolled.worker.principal_id))
    assert (worker.reason, worker.field) == (Reason.FIELD_INVALID, "principal_id")


async def test_get_principal_reads_users_agents_and_workers(
    conn: Conn, database: MigratedDatabase
) -> None:
    """As ListPrincipals shows them (the cluster-admin grant included); a principal that
    does not exist, or has no kind on the wire (a service), is PRINCIPAL_NOT_FOUND."""
    shown = ("user", "agent", "worker")
    root = await user(conn, "root", cluster_admin=True)
    found = await admin.get_principal(conn, root, shown)
    assert (found.kind, found.name, found.status, found.cluster_admin) == (
        "user",
        "root",
        "active",
        True,
    )
    bot = await admin.create_principal(conn, "a-1", "agent", "bot", cluster_admin=False)
    assert await admin.get_principal(conn, bot.principal_id, shown) == bot
    await admin.disable_principal(conn, bot.principal_id)
    assert (await admin.get_principal(conn, bot.principal_id, shown)).status == "disabled"
    enrolled = await admin.create_worker(conn, "w-1", "worker-x", X_URI, None)
    worker = await admin.get_principal(conn, enrolled.worker.principal_id, shown)
    assert (worker.kind, worker.name, worker.cluster_admin) == ("worker", "worker-x", False)
    listed = await admin.list_principals(conn, kinds=shown, limit=50, after=None)
    assert [await admin.get_principal(conn, row.principal_id, shown) for row in listed.rows] == (
        listed.rows
    )
    service = uuid.uuid4()
    async with await psycopg.AsyncConnection.connect(
        database.urls.migration, autocommit=True
    ) as owner:
        await owner.execute(
            "INSERT INTO qinglong.principals (principal_id, kind, name)"
            " VALUES (%s, 'service', 'ingress')",
            (service,),
        )
    for missing_id in (uuid.uuid4(), service):
        missing = await refused(admin.get_principal(conn, missing_id, shown))
        assert (missing.reason, missing.field) == (Reason.PRINCIPAL_NOT_FOUND, "principal_id")


async def active_cluster_admins(conn: Conn) -> list[str]:
    cursor = await conn.execute(
        "SELECT p.name FROM qinglong.cluster_admins c"
        "  JOIN qinglong.principals p USING (principal_id)"
        " WHERE p.status = 'active' AND p.kind = 'user' ORDER BY p.name"
    )
    return [row[0] for row in await cursor.fetchall()]


async def test_the_last_active_cluster_admin_cannot_be_disabled(conn: Conn) -> None:
    """Nobody could administer the cluster any more, and bootstrap-admin would refuse the
    name that is taken: FAILED_PRECONDITION, whoever asks (the admin itself too)."""
    root = await user(conn, "root", cluster_admin=True)
    last = await refused(admin.disable_principal(conn, root))
    assert (last.reason, last.field) == (Reason.LAST_CLUSTER_ADMIN, None)
    assert await active_cluster_admins(conn) == ["root"]
    # Another cluster admin first: then either may go, and the other is the last.
    chief = await user(conn, "chief", cluster_admin=True)
    assert (await admin.disable_principal(conn, root)).status == "disabled"
    again = await refused(admin.disable_principal(conn, chief))
    assert again.reason is Reason.LAST_CLUSTER_ADMIN
    assert await active_cluster_admins(conn) == ["chief"]
    # A disabled admin stays disabled (a replay changes nothing); people who are not
    # cluster admins are disabled as before.
    assert (await admin.disable_principal(conn, root)).status == "disabled"
    assert (await admin.disable_principal(conn, await user(conn, "dora"))).status == "disabled"


async def test_two_admins_disabling_each_other_at_once_leave_one(
    conn: Conn, database: MigratedDatabase
) -> None:
    """Both disables wait on the two principals' rows, then run together: one wins, the
    other finds itself the last and is refused (the count is read under the principal
    lock, so it cannot count on an admin a concurrent disable is removing)."""
    first = await user(conn, "first", cluster_admin=True)
    second = await user(conn, "second", cluster_admin=True)
    hold = "SELECT 1 FROM qinglong.principals WHERE principal_id = ANY(%s) FOR UPDATE"
    async with (
        await psycopg.AsyncConnection.connect(database.urls.admin, autocommit=True) as one,
        await psycopg.AsyncConnection.connect(database.urls.admin, autocommit=True) as two,
        await psycopg.AsyncConnection.connect(database.urls.admin, autocommit=True) as gate,
        await psycopg.AsyncConnection.connect(database.admin_url, autocommit=True) as observer,
    ):
        async with gate.transaction():  # both disables are in flight before either runs
            await gate.execute(hold, ([first, second],))
            racing = asyncio.gather(
                admin.disable_principal(one, second),
                admin.disable_principal(two, first),
                return_exceptions=True,
            )
            await until_waiting(observer, 2)
        outcomes = await racing
    lost = [o for o in outcomes if isinstance(o, Refused)]
    assert len(lost) == 1, outcomes
    assert lost[0].reason is Reason.LAST_CLUSTER_ADMIN
    assert len(await active_cluster_admins(conn)) == 1


# --- operator tokens ---------------------------------------------------------------------


async def stored_digest(conn: Conn, token_id: uuid.UUID) -> str:
    cursor = await conn.execute(
        "SELECT token_digest FROM qinglong.operator_credentials WHERE credential_id = %s",
        (token_id,),
    )
    row = await cursor.fetchone()
    assert row is not None
    return str(row[0])


async def test_issue_token_shows_the_secret_once(conn: Conn) -> None:
    alice = await user(conn, "alice")
    before = await db_now(conn)
    issued = await admin.issue_token(conn, alice, "issue-1", 3600)
    secret, token = issued.secret, issued.token
    assert secret.startswith("qlo1_")
    assert len(secret) == 48
    assert token.prefix == secret[:11]
    assert await stored_digest(conn, token.token_id) == hashlib.sha256(secret.encode()).hexdigest()
    assert token.expires_at_ms == token.created_at_ms + HOUR_MS
    assert token.created_at_ms >= before
    assert secret not in repr(issued)
    replay = await admin.issue_token(conn, alice, "issue-1", 3600)
    assert (replay.token, replay.secret) == (token, "")
    forever = await admin.issue_token(conn, alice, "issue-2", None)
    assert forever.token.expires_at_ms is None
    assert forever.secret not in (secret, "")
    listed = await admin.list_tokens(conn, alice)
    assert [row.token_id for row in listed] == [forever.token.token_id, token.token_id]


async def test_tokens_are_for_active_users_and_agents_only(conn: Conn) -> None:
    enrolled = await admin.create_worker(conn, "w-1", "worker-x", X_URI, None)
    worker = await refused(admin.issue_token(conn, enrolled.worker.principal_id, "i-1", None))
    assert (worker.reason, worker.field) == (Reason.FIELD_INVALID, "principal_id")
    unknown = await refused(admin.issue_token(conn, uuid.uuid4(), "i-1", None))
    assert (unknown.reason, unknown.field) == (Reason.PRINCIPAL_NOT_FOUND, "principal_id")
    alice = await user(conn, "alice")
    await admin.disable_principal(conn, alice)
    disabled = await refused(admin.issue_token(conn, alice, "i-1", None))
    assert disabled.reason is Reason.STATE_CONFLICT
    missing = await refused(admin.list_tokens(conn, uuid.uuid4()))
    assert missing.field == "principal_id"


async def test_revoke_token(conn: Conn) -> None:
    alice = await user(conn, "alice")
    issued = await admin.issue_token(conn, alice, "issue-1", None)
    revoked = await admin.revoke_token(conn, issued.token.token_id)
    assert revoked.status == "revoked"
    assert await admin.revoke_token(conn, issued.token.token_id) == revoked
    unknown = await refused(admin.revoke_token(conn, uuid.uuid4()))
    assert (unknown.reason, unknown.field) == (Reason.TOKEN_NOT_FOUND, "token_id")
    again = await refused(admin.rotate_token(conn, issued.token.token_id, "rot-1", 60))
    assert again.reason is Reason.STATE_CONFLICT


async def test_rotate_token_keeps_the_old_one_for_the_overlap_only(conn: Conn) -> None:
    alice = await user(conn, "alice")
    old = (await admin.issue_token(conn, alice, "issue-1", 86_400)).token
    rotated = await admin.rotate_token(conn, old.token_id, "rot-1", 60)
    successor, replaced = rotated.issued.token, rotated.replaced
    assert rotated.issued.secret.startswith("qlo1_")
    assert successor.token_id != old.token_id
    # The successor lives as long as its predecessor was issued for; the old one stops
    # after the overlap, in the same transaction (both measured from one DB time).
    assert successor.expires_at_ms == successor.created_at_ms + 86_400_000
    assert replaced.expires_at_ms == successor.created_at_ms + 60_000
    assert replaced.status == "active"
    replay = await admin.rotate_token(conn, old.token_id, "rot-1", 60)
    assert (replay.issued.token, replay.issued.secret, replay.replaced) == (successor, "", replaced)
    twice = await refused(admin.rotate_token(conn, old.token_id, "rot-2", 60))
    assert twice.reason is Reason.STATE_CONFLICT
    # Overlap 0: the successor's own rotation stops it at once.
    final = await admin.rotate_token(conn, successor.token_id, "rot-3", 0)
    assert final.replaced.expires_at_ms == final.issued.token.created_at_ms
    assert final.replaced.expires_at_ms is not None
    assert final.replaced.expires_at_ms <= await db_now(conn)


async def test_rotation_never_extends_a_token(conn: Conn) -> None:
    alice = await user(conn, "alice")
    short = (await admin.issue_token(conn, alice, "issue-1", 60)).token
    rotated = await admin.rotate_token(conn, short.token_id, "rot-1", 604_800)
    assert rotated.replaced.expires_at_ms == short.expires_at_ms


# --- a token's last use (migration 0022) -------------------------------------------------


async def audit_call(
    directory: Directory,
    principal: OperatorRow | None,
    operation: str,
    claim: WorkerClaim | None = None,
    credential_id: uuid.UUID | None = None,
) -> uuid.UUID:
    """A call's audit row as ingress writes it (the ingress role, the batch statement)."""
    record = AuditRecord(
        "worker" if principal is None else principal.kind,
        None if principal is None else str(principal.principal_id),
        operation,
        AuditOutcome.ADMITTED,
        None,
        credential_id=credential_id,
    )
    return (await directory.write_audit(AuditEntry(record, claim))).audit_id


async def audited(database: MigratedDatabase, audit_id: uuid.UUID) -> tuple[Any, ...]:
    async with await psycopg.AsyncConnection.connect(database.urls.migration) as owner:
        cursor = await owner.execute(
            "SELECT credential_id, occurred_at_ms FROM qinglong.security_audit WHERE audit_id = %s",
            (audit_id,),
        )
        row = await cursor.fetchone()
    assert row is not None
    return tuple(row)


async def test_a_tokens_last_use_is_the_newest_call_ingress_audited_for_it(
    conn: Conn, database: MigratedDatabase
) -> None:
    """Ingress's operator lookup names the token it matched, the call's audit row records
    it, and ListTokens reads its newest row; a token never used has none. A Worker's call
    (its certificate) records no credential, even if one were handed to the statement."""
    alice = await user(conn, "alice")
    used = await admin.issue_token(conn, alice, "issue-1", None)
    idle = await admin.issue_token(conn, alice, "issue-2", None)
    enrolled = await admin.create_worker(conn, "w-1", "worker-x", X_URI, None)
    pool = await open_ingress_pool(database.urls.ingress, sizing=PoolSizing(1, 1))
    try:
        directory = Directory(pool)
        digest = hashlib.sha256(used.secret.encode()).hexdigest()
        caller = await directory.operator_by_token_digest(digest)
        assert caller is not None
        assert (caller.principal_id, caller.credential_id) == (alice, used.token.token_id)
        token_id = caller.credential_id
        first = await audit_call(directory, caller, "RunService/ListRuns", None, token_id)
        second = await audit_call(directory, caller, "RunService/GetRun", None, token_id)
        worker_call = await audit_call(
            directory,
            None,
            "WorkerService/OpenSession",
            WorkerClaim(X_URI),
            token_id,  # were ingress to hand a Worker's call one, it is not written
        )
    finally:
        await pool.close()
    assert (await audited(database, worker_call))[0] is None
    first_row, second_row = await audited(database, first), await audited(database, second)
    assert first_row[0] == second_row[0] == used.token.token_id
    listed = {row.token_id: row for row in await admin.list_tokens(conn, alice)}
    assert listed[used.token.token_id].last_used_at_ms == max(first_row[1], second_row[1])
    assert listed[idle.token.token_id].last_used_at_ms is None
    # Every answer describing the token says so, not ListTokens alone.
    revoked = await admin.revoke_token(conn, used.token.token_id)
    assert revoked.last_used_at_ms == listed[used.token.token_id].last_used_at_ms
    assert enrolled.worker.worker_id == "worker-x"


async def test_a_last_use_past_the_audits_retention_is_unset(
    conn: Conn, database: MigratedDatabase
) -> None:
    """The last use is read from the audit: once retention removed the token's rows it is
    unset again; a younger row stays its last use. The audit's CHECK keeps credentials to
    operators' calls."""
    alice = await user(conn, "alice")
    old = (await admin.issue_token(conn, alice, "issue-1", None)).token
    recent = (await admin.issue_token(conn, alice, "issue-2", None)).token
    day_ms = 86_400_000
    async with await psycopg.AsyncConnection.connect(
        database.urls.migration, autocommit=True
    ) as owner:
        for token_id, age_ms in ((old.token_id, 100 * day_ms), (recent.token_id, day_ms)):
            await owner.execute(
                "INSERT INTO qinglong.security_audit (audit_id, occurred_at_ms, principal_kind,"
                " principal_id, operation, outcome, credential_id)"
                " VALUES (%s, qinglong.db_now_ms() - %s, 'user', %s, 'RunService/ListRuns',"
                " 'admitted', %s)",
                (uuid.uuid4(), age_ms, str(alice), token_id),
            )
        with pytest.raises(psycopg.errors.CheckViolation):
            await owner.execute(
                "INSERT INTO qinglong.security_audit (audit_id, principal_kind, principal_id,"
                " operation, outcome, credential_id) VALUES (%s, 'worker', 'worker-x',"
                " 'WorkerService/OpenSession', 'admitted', %s)",
                (uuid.uuid4(), recent.token_id),
            )
    before = {row.token_id: row.last_used_at_ms for row in await admin.list_tokens(conn, alice)}
    assert before[old.token_id] is not None
    assert before[recent.token_id] is not None
    async with await psycopg.AsyncConnection.connect(
        database.urls.runtime, autocommit=True
    ) as runtime:
        assert await prune_audit(runtime, 90 * day_ms, 100) == 1
    after = {row.token_id: row.last_used_at_ms for row in await admin.list_tokens(conn, alice)}
    assert after == {old.token_id: None, recent.token_id: before[recent.token_id]}


async def test_listing_tokens_reads_only_their_own_audit_rows(
    conn: Conn, database: MigratedDatabase
) -> None:
    """A LATERAL per token reads the partial index backwards: none of the (many) rows of
    Workers' calls, which have no credential and are not in the index."""
    alice = await user(conn, "alice")
    token = (await admin.issue_token(conn, alice, "issue-1", None)).token
    async with await psycopg.AsyncConnection.connect(
        database.urls.migration, autocommit=True
    ) as owner:
        await owner.execute(
            "INSERT INTO qinglong.security_audit (audit_id, principal_kind, principal_id,"
            " operation, outcome)"
            " SELECT gen_random_uuid(), 'worker', 'worker-x', 'WorkerService/ControlLease',"
            " 'admitted' FROM generate_series(1, 5000)"
        )
        await owner.execute(
            "INSERT INTO qinglong.security_audit (audit_id, principal_kind, principal_id,"
            " operation, outcome, credential_id)"
            " SELECT gen_random_uuid(), 'user', %s, 'RunService/ListRuns', 'admitted', %s"
            " FROM generate_series(1, 50)",
            (str(alice), token.token_id),
        )
        await owner.execute("ANALYZE qinglong.security_audit")
    explain = "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + SQL["admin.list_tokens"]
    cursor = await conn.execute(explain.encode(), (alice, 1000))
    row = await cursor.fetchone()
    assert row is not None
    scans = scans_of(row[0][0]["Plan"], "security_audit")
    assert [node["Index Name"] for node in scans] == ["security_audit_by_credential"], scans
    assert [node["Actual Rows"] for node in scans] == [1]  # max() reads the newest entry


# --- role bindings -----------------------------------------------------------------------


async def test_role_versions_advance_on_every_change(conn: Conn) -> None:
    await admin.create_project(conn, "p-1", "proj-x", "X")
    alice = await user(conn, "alice")
    first = await admin.grant_role(conn, "proj-x", alice, "operator")
    assert (first.role, first.status, first.version) == ("operator", "active", 1)
    same = await admin.grant_role(conn, "proj-x", alice, "operator")
    assert same.version == 1  # it already said exactly this
    changed = await admin.grant_role(conn, "proj-x", alice, "viewer")
    assert (changed.role, changed.version) == ("viewer", 2)
    revoked = await admin.revoke_role(conn, "proj-x", alice)
    assert (revoked.status, revoked.version) == ("revoked", 3)
    assert (await admin.revoke_role(conn, "proj-x", alice)).version == 3
    again = await admin.grant_role(conn, "proj-x", alice, "owner")
    assert (again.status, again.version) == ("active", 4)
    listed = await admin.list_role_bindings(conn, "proj-x")
    assert listed == [again]


async def test_role_bindings_need_a_project_and_an_operator(conn: Conn) -> None:
    await admin.create_project(conn, "p-1", "proj-x", "X")
    alice = await user(conn, "alice")
    project = await refused(admin.grant_role(conn, "proj-none", alice, "owner"))
    assert project.reason is Reason.PROJECT_NOT_FOUND
    principal = await refused(admin.grant_role(conn, "proj-x", uuid.uuid4(), "owner"))
    assert (principal.reason, principal.field) == (Reason.PRINCIPAL_NOT_FOUND, "principal_id")
    enrolled = await admin.create_worker(conn, "w-1", "worker-x", X_URI, None)
    worker = await refused(admin.grant_role(conn, "proj-x", enrolled.worker.principal_id, "owner"))
    assert worker.field == "principal_id"
    unbound = await refused(admin.revoke_role(conn, "proj-x", alice))
    assert (unbound.reason, unbound.field) == (Reason.ROLE_BINDING_NOT_FOUND, "principal_id")
    listing = await refused(admin.list_role_bindings(conn, "proj-none"))
    assert listing.reason is Reason.PROJECT_NOT_FOUND


async def test_a_binding_revoked_through_administration_fences_a_cancel(
    conn: Conn, world: World
) -> None:
    """R-CAN-3 through the new API: a cancel admitted under a binding that was revoked
    (or re-granted, at a newer version) before it commits is ROLE_BINDING_FENCED, and the
    Run is untouched; a project disabled meanwhile fences it too."""
    alice = await user(conn, "alice")
    granted = await admin.grant_role(conn, PROJECT, alice, "operator")
    project = (await admin.list_projects(conn, limit=1, after=None)).rows[0]
    admitted = BindingSnapshot(project.version, granted.version, "operator")
    run_id = await world.queued_run()

    def cancel(mutation: str) -> cancellation.CancelRequest:
        return cancellation.CancelRequest(
            PROJECT, run_id, mutation, Actor("user", str(alice)), alice, admitted
        )

    async def run_row() -> tuple[Any, ...] | None:
        cursor = await world.conn.execute(
            "SELECT state, version, event_sequence FROM qinglong.runs WHERE run_id = %s",
            (run_id,),
        )
        return await cursor.fetchone()

    before = await run_row()
    await admin.revoke_role(conn, PROJECT, alice)
    fenced = await refused(cancellation.cancel_run(world.conn, cancel("m-1")))
    assert fenced.reason is Reason.ROLE_BINDING_FENCED
    regranted = await admin.grant_role(conn, PROJECT, alice, "operator")
    assert regranted.version == granted.version + 2
    drifted = await refused(cancellation.cancel_run(world.conn, cancel("m-2")))
    assert drifted.reason is Reason.ROLE_BINDING_FENCED
    assert await run_row() == before
    # Admitted under the present binding it is accepted, until the project is disabled.
    admitted = BindingSnapshot(project.version, regranted.version, "operator")
    assert await cancellation.cancel_run(world.conn, cancel("m-3")) is CancelOutcome.ACCEPTED
    await admin.disable_project(conn, PROJECT)
    archived = await refused(cancellation.cancel_run(world.conn, cancel("m-4")))
    assert archived.reason is Reason.ROLE_BINDING_FENCED


# --- Workers -----------------------------------------------------------------------------


async def test_create_worker_enrolls_it_with_a_one_time_join_token(conn: Conn) -> None:
    uri = worker_uri("example.org", "worker-x")
    before = await db_now(conn)
    enrolled = await admin.create_worker(conn, "w-1", "worker-x", uri, None)
    worker = enrolled.worker
    assert (worker.worker_id, worker.status, worker.session) == ("worker-x", "active", None)
    assert (worker.live_attempts, worker.session_count) == (0, 0)
    assert enrolled.join_token.startswith("qlj1_")
    assert len(enrolled.join_token) == 48
    assert before + HOUR_MS <= enrolled.join_expires_at_ms <= await db_now(conn) + HOUR_MS
    cursor = await conn.execute(
        "SELECT w.certificate_uri, p.kind, p.name, j.token_digest, j.expires_at_ms, j.used_at_ms"
        "  FROM qinglong.worker_identities w"
        "  JOIN qinglong.principals p ON p.principal_id = w.principal_id"
        "  JOIN qinglong.worker_join_tokens j ON j.worker_id = w.worker_id"
        " WHERE w.worker_id = 'worker-x'"
    )
    assert await cursor.fetchall() == [
        (
            uri,
            "worker",
            "worker-x",
            hashlib.sha256(enrolled.join_token.encode()).hexdigest(),
            enrolled.join_expires_at_ms,
            None,
        )
    ]
    replay = await admin.create_worker(conn, "w-1", "worker-x", uri, None)
    assert (replay.worker, replay.join_token) == (worker, "")
    assert replay.join_expires_at_ms == enrolled.join_expires_at_ms
    taken = await refused(admin.create_worker(conn, "w-2", "worker-x", uri, None))
    assert taken.reason is Reason.ALREADY_EXISTS
    short = await admin.create_worker(conn, "w-3", "worker-y", worker_uri("t", "worker-y"), 60)
    assert short.join_expires_at_ms == short.worker.created_at_ms + 60_000


async def test_a_worker_enrolled_by_tooling_is_taken_too(conn: Conn, world: World) -> None:
    taken = await refused(
        admin.create_worker(conn, "w-1", "worker-a", worker_uri("t", "worker-a"), None)
    )
    assert taken.reason is Reason.ALREADY_EXISTS


async def test_fleet_view_shows_the_newest_session_and_live_attempts(
    conn: Conn, world: World
) -> None:
    await admin.create_worker(conn, "w-1", "worker-c", worker_uri("t", "worker-c"), None)
    await world.session("worker-c")
    session = await world.session("worker-c")  # a second generation fences the first
    for _ in range(2):
        await world.claim(await world.queued_run(), session)
    page = await admin.list_workers(conn, limit=50, after=None)
    assert [row.worker_id for row in page.rows] == ["worker-a", "worker-b", "worker-c"]
    worker = page.rows[2]
    assert (worker.live_attempts, worker.session_count) == (2, 2)
    assert worker.session is not None
    assert worker.session.session_id == session.session_id
    assert (worker.session.state, worker.session.generation) == ("online", 2)
    assert 0 < worker.session.remaining_ms <= world.timings.session_ttl_ms
    assert (worker.session.agent_version, worker.session.executor_types) == (
        "test",
        ("remote_worker",),
    )
    assert worker.session.max_concurrency == 8
    assert page.rows[0].session is None
    first = await admin.list_workers(conn, limit=2, after=None)
    assert first.more
    rest = await admin.list_workers(conn, limit=2, after=first.rows[-1].worker_id)
    assert [row.worker_id for row in rest.rows] == ["worker-c"]
    assert not rest.more


async def test_disable_worker_fences_its_sessions(conn: Conn, world: World) -> None:
    """The admin role disables the identity, then the runtime role fences the session:
    the Worker's next lease command fails SESSION_FENCED (its execution stops), and it
    cannot open another session."""
    work = await world.claimed("worker-a")
    await admin.disable_worker(conn, "worker-a")
    await sessions.fence_sessions(world.conn, "worker-a")
    worker = await admin.get_worker(conn, "worker-a")
    assert worker.status == "disabled"
    assert worker.session is not None
    assert (worker.session.state, worker.session.remaining_ms) == ("fenced", 0)
    assert worker.live_attempts == 1  # until its lease expires and convergence runs
    principals = await admin.list_principals(conn, kinds=("worker",), limit=50, after=None)
    assert {row.name: row.status for row in principals.rows}["worker-a"] == "disabled"
    lease = await refused(lease_control.control_lease(world.conn, work.fence, world.timings))
    assert lease.reason is Reason.SESSION_FENCED
    pull = await refused(placement.pull_offers(world.conn, work.session, 1, world.timings))
    assert pull.reason is Reason.SESSION_FENCED
    reopen = await refused(world.session("worker-a"))
    assert reopen.reason is Reason.SESSION_FENCED
    # A retry (say, after a failure between the two transactions) changes nothing more.
    await admin.disable_worker(conn, "worker-a")
    await sessions.fence_sessions(world.conn, "worker-a")
    assert await admin.get_worker(conn, "worker-a") == worker
    unknown = await refused(admin.disable_worker(conn, "worker-none"))
    assert (unknown.reason, unknown.field) == (Reason.WORKER_NOT_FOUND, "worker_id")


async def join(conn: Conn, token: str, key_digest: str | None = None) -> str | None:
    """The Worker a join token enrolls now (consuming it) for a key (by default one never
    seen before), or None when it is refused."""
    enrolled = await enrollment.consume_join_token(
        conn, hashlib.sha256(token.encode()).hexdigest(), key_digest or secrets.token_hex(32)
    )
    return None if enrolled is None else enrolled.worker_id


async def test_a_spent_join_token_answers_again_for_its_key_only(conn: Conn) -> None:
    """A join whose answer was lost is tried again with the same token and key: answered
    again (its certificate is for that key); another key, a newer token or a disabled
    Worker ends that."""
    uri = worker_uri("example.org", "worker-r")
    created = await admin.create_worker(conn, "w-r", "worker-r", uri, None)
    key = secrets.token_hex(32)
    assert await join(conn, created.join_token, key) == "worker-r"
    assert await join(conn, created.join_token, key) == "worker-r"
    assert await join(conn, created.join_token) is None
    assert await live_join_tokens(conn, "worker-r") == 0
    newer = await admin.issue_join_token(conn, "worker-r", "j-r", None)
    assert await join(conn, created.join_token, key) is None
    other = secrets.token_hex(32)
    assert await join(conn, newer.join_token, other) == "worker-r"
    await admin.disable_worker(conn, "worker-r")
    assert await join(conn, newer.join_token, other) is None


async def live_join_tokens(conn: Conn, worker_id: str) -> int:
    cursor = await conn.execute(
        "SELECT count(*) FROM qinglong.worker_join_tokens"
        " WHERE worker_id = %s AND used_at_ms IS NULL AND expires_at_ms > qinglong.db_now_ms()",
        (worker_id,),
    )
    row = await cursor.fetchone()
    assert row is not None
    return int(row[0])


async def test_issue_join_token_replaces_the_workers_join_token(conn: Conn) -> None:
    """A lost CreateWorker answer: a new token, shown once; the first one stops working."""
    uri = worker_uri("example.org", "worker-x")
    created = await admin.create_worker(conn, "w-1", "worker-x", uri, None)
    issued = await admin.issue_join_token(conn, "worker-x", "j-1", None)
    assert issued.join_token.startswith("qlj1_")
    assert len(issued.join_token) == 48
    assert issued.join_token != created.join_token
    assert issued.worker == created.worker
    assert issued.join_expires_at_ms - HOUR_MS > created.worker.created_at_ms
    assert issued.join_expires_at_ms <= await db_now(conn) + HOUR_MS
    cursor = await conn.execute(
        "SELECT count(*) FROM qinglong.worker_join_tokens WHERE token_digest = %s",
        (hashlib.sha256(issued.join_token.encode()).hexdigest(),),
    )
    assert await cursor.fetchone() == (1,)
    assert await live_join_tokens(conn, "worker-x") == 1
    # A retry answers with the same expiry and no token, and issues nothing.
    replay = await admin.issue_join_token(conn, "worker-x", "j-1", 600)
    assert (replay.worker, replay.join_token) == (issued.worker, "")
    assert replay.join_expires_at_ms == issued.join_expires_at_ms
    # The first token is refused, the new one joins, once.
    assert await join(conn, created.join_token) is None
    assert await join(conn, issued.join_token) == "worker-x"
    assert await join(conn, issued.join_token) is None
    # A retried CreateWorker still answers with the first token's expiry.
    recreated = await admin.create_worker(conn, "w-1", "worker-x", uri, None)
    assert (recreated.join_token, recreated.join_expires_at_ms) == (
        "",
        created.join_expires_at_ms,
    )
    # The join's answer was lost after the token was spent: another one, for a minute.
    before = await db_now(conn)
    again = await admin.issue_join_token(conn, "worker-x", "j-2", 60)
    assert before + 60_000 <= again.join_expires_at_ms <= await db_now(conn) + 60_000
    assert await join(conn, again.join_token) == "worker-x"
    # The request id is the Worker's: another Worker's j-1 is a new request.
    other = await admin.create_worker(conn, "w-2", "worker-y", worker_uri("t", "worker-y"), None)
    fresh = await admin.issue_join_token(conn, "worker-y", "j-1", None)
    assert fresh.join_token not in ("", other.join_token)
    assert await join(conn, other.join_token) is None
    assert await join(conn, fresh.join_token) == "worker-y"


async def test_issue_join_token_needs_an_enrolled_active_worker(conn: Conn) -> None:
    created = await admin.create_worker(conn, "w-1", "worker-x", X_URI, None)
    issued = await admin.issue_join_token(conn, "worker-x", "j-1", None)
    unknown = await refused(admin.issue_join_token(conn, "worker-none", "j-1", None))
    assert (unknown.reason, unknown.field) == (Reason.WORKER_NOT_FOUND, "worker_id")
    await admin.disable_worker(conn, "worker-x")
    disabled = await refused(admin.issue_join_token(conn, "worker-x", "j-2", None))
    assert (disabled.reason, disabled.field) == (Reason.WORKER_DISABLED, None)
    # A retry of what was issued before is still answered (without the token), as
    # IssueToken's is; no token of a disabled Worker joins.
    replay = await admin.issue_join_token(conn, "worker-x", "j-1", None)
    assert (replay.join_token, replay.join_expires_at_ms) == ("", issued.join_expires_at_ms)
    assert replay.worker.status == "disabled"
    for token in (created.join_token, issued.join_token):
        assert await join(conn, token) is None


async def test_concurrent_join_token_issues_leave_one_live_token(
    conn: Conn, database: MigratedDatabase
) -> None:
    """Issues racing each other queue on the Worker's row: each ends the one before it, so
    one token is left that joins, whichever came last; retries of one request issue once."""
    await admin.create_worker(conn, "w-1", "worker-x", X_URI, None)
    others = [
        await psycopg.AsyncConnection.connect(database.urls.admin, autocommit=True)
        for _ in range(6)
    ]
    try:
        racing = await asyncio.gather(
            *(
                admin.issue_join_token(other, "worker-x", f"j-{index}", None)
                for index, other in enumerate(others)
            )
        )
        same = await asyncio.gather(
            *(admin.issue_join_token(other, "worker-x", "j-same", None) for other in others)
        )
    finally:
        for other in others:
            await other.close()
    assert len({issued.join_token for issued in racing}) == len(others)
    assert len([issued for issued in same if issued.join_token]) == 1
    assert len({issued.join_expires_at_ms for issued in same}) == 1
    assert await live_join_tokens(conn, "worker-x") == 1
    (last,) = [issued.join_token for issued in same if issued.join_token]
    assert [await join(conn, issued.join_token) for issued in racing] == [None] * len(others)
    assert await join(conn, last) == "worker-x"


# --- the security audit ------------------------------------------------------------------


async def test_audit_listing_filters_and_pages_newest_first(
    conn: Conn, database: MigratedDatabase
) -> None:
    base = 1_800_000_000_000
    rows = [
        (base + index * 1000, "u-1" if index % 2 else "u-2", f"Op/{index % 3}", outcome)
        for index, outcome in enumerate(["admitted", "permission_denied"] * 5)
    ]
    # Rows at chosen times: as the schema's owner (ingress's rows take DB time, 0015).
    async with await psycopg.AsyncConnection.connect(
        database.urls.migration, autocommit=True
    ) as owner:
        for at, principal, operation, outcome in rows:
            await owner.execute(
                "INSERT INTO qinglong.security_audit (audit_id, occurred_at_ms, principal_kind,"
                " principal_id, operation, outcome) VALUES (%s, %s, 'user', %s, %s, %s)",
                (uuid.uuid4(), at, principal, operation, outcome),
            )
    every = await admin.list_audit(conn, AuditFilter(), limit=50, before=None)
    assert [row.occurred_at_ms for row in every.rows] == sorted(
        (at for at, *_ in rows), reverse=True
    )
    paged: list[int] = []
    before = None
    while True:
        page = await admin.list_audit(conn, AuditFilter(), limit=3, before=before)
        paged += [row.occurred_at_ms for row in page.rows]
        if not page.more:
            break
        before = (page.rows[-1].occurred_at_ms, page.rows[-1].audit_id)
    assert paged == [row.occurred_at_ms for row in every.rows]

    def expected(**match: Any) -> list[int]:
        keys = ("occurred_at_ms", "principal_id", "operation", "outcome")
        chosen = [dict(zip(keys, row, strict=True)) for row in rows]
        return sorted(
            (r["occurred_at_ms"] for r in chosen if all(r[k] == v for k, v in match.items())),
            reverse=True,
        )

    for where, match in (
        (AuditFilter(principal_id="u-1"), {"principal_id": "u-1"}),
        (AuditFilter(operation="Op/2"), {"operation": "Op/2"}),
        (AuditFilter(outcome="permission_denied"), {"outcome": "permission_denied"}),
        (
            AuditFilter(principal_id="u-2", outcome="admitted"),
            {"principal_id": "u-2", "outcome": "admitted"},
        ),
    ):
        listed = await admin.list_audit(conn, where, limit=50, before=None)
        assert [row.occurred_at_ms for row in listed.rows] == expected(**match), where
    window = AuditFilter(start_ms=base + 2000, end_ms=base + 5000)
    listed = await admin.list_audit(conn, window, limit=50, before=None)
    assert [row.occurred_at_ms for row in listed.rows] == [base + 4000, base + 3000, base + 2000]


# --- the first cluster admin -------------------------------------------------------------


async def test_bootstrap_admin_issues_only_when_no_active_cluster_admin_exists(
    conn: Conn,
) -> None:
    first = await admin.bootstrap_admin(conn, "admin")
    assert first is not None
    assert first.secret.startswith("qlo1_")
    assert await admin.bootstrap_admin(conn, "admin") is None
    assert await admin.bootstrap_admin(conn, "other") is None
    holder = await admin.list_principals(conn, kinds=("user",), limit=50, after=None)
    assert [(row.name, row.cluster_admin) for row in holder.rows] == [("admin", True)]
    # Administration never disables the last cluster admin (LAST_CLUSTER_ADMIN) ...
    last = await refused(admin.disable_principal(conn, first.token.principal_id))
    assert last.reason is Reason.LAST_CLUSTER_ADMIN
    # ... but with its only admin disabled out of band, the cluster can be bootstrapped
    # again, by a new name.
    await conn.execute(
        "UPDATE qinglong.principals SET status = 'disabled' WHERE principal_id = %s",
        (first.token.principal_id,),
    )
    taken = await refused(admin.bootstrap_admin(conn, "admin"))
    assert taken.reason is Reason.ALREADY_EXISTS
    assert await admin.bootstrap_admin(conn, "admin-2") is not None


# --- secrets are shown once, and nowhere else -------------------------------------------


async def test_no_secret_in_any_row_log_event_or_error(
    conn: Conn, world: World, database: MigratedDatabase, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    secrets: list[str] = []
    seen: list[object] = []
    alice = await user(conn, "alice")
    issued = await admin.issue_token(conn, alice, "issue-1", 600)
    rotated = await admin.rotate_token(conn, issued.token.token_id, "rot-1", 60)
    bootstrapped = await admin.bootstrap_admin(conn, "admin")
    enrolled = await admin.create_worker(conn, "w-1", "worker-x", X_URI, None)
    rejoin = await admin.issue_join_token(conn, "worker-x", "j-1", None)
    assert bootstrapped is not None
    secrets += [issued.secret, rotated.issued.secret, bootstrapped.secret, enrolled.join_token]
    secrets.append(rejoin.join_token)
    seen += [issued, rotated, bootstrapped, enrolled, rejoin, await admin.list_tokens(conn, alice)]
    for command in (
        admin.issue_token(conn, alice, "issue-1", 600),
        admin.rotate_token(conn, issued.token.token_id, "rot-1", 60),
        admin.create_worker(conn, "w-1", "worker-x", X_URI, None),
        admin.issue_join_token(conn, "worker-x", "j-1", None),
    ):
        seen.append(await command)  # replays
    for failing in (
        admin.rotate_token(conn, issued.token.token_id, "rot-2", 60),
        admin.create_worker(conn, "w-2", "worker-x", X_URI, None),
    ):
        seen.append(await refused(failing))
    await world.claimed("worker-a")  # Events exist to be scanned
    assert len(set(secrets)) == 5
    assert all(len(secret) == 48 for secret in secrets)
    needles = [*secrets, *(secret[5:] for secret in secrets)]

    for thing in seen:
        for text in (repr(thing), str(thing)):
            assert not [n for n in needles if n in text], text
    assert not [n for n in needles if n in caplog.text]
    async with await psycopg.AsyncConnection.connect(database.urls.migration) as owner:
        tables = await owner.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'qinglong' ORDER BY 1"
        )
        scanned = 0
        for (table,) in await tables.fetchall():
            rows = await owner.execute(
                sql.SQL("SELECT t::text FROM qinglong.{} AS t").format(sql.Identifier(table))
            )
            for (row,) in await rows.fetchall():
                scanned += 1
                assert not [n for n in needles if n in row], f"a row of qinglong.{table}"
        assert scanned > 20
        digests = await owner.execute(
            "SELECT token_digest FROM qinglong.operator_credentials"
            " UNION ALL SELECT token_digest FROM qinglong.worker_join_tokens"
        )
        stored = {row[0] for row in await digests.fetchall()}
    assert {hashlib.sha256(s.encode()).hexdigest() for s in secrets} <= stored


def test_enrollment_tooling_and_administration_share_binding_versions(
    database: MigratedDatabase,
) -> None:
    """identities.bind_role (the dev stack's) runs administration's own statements."""
    with psycopg.connect(database.urls.migration, autocommit=True) as owner:
        ensure_project(owner, "proj-x", "X")
        alice = enroll_operator_token(owner, "alice", "user", "a" * 64)
        bind_role(owner, "proj-x", alice, "operator")
        bind_role(owner, "proj-x", alice, "operator")
        revoke_role(owner, "proj-x", alice)
        row = owner.execute(
            "SELECT status, version FROM qinglong.role_bindings WHERE principal_id = %s", (alice,)
        ).fetchone()
    assert row == ("revoked", 2)
