"""The cluster admin's CLI as a user meets it: the real `qinglong admin …` and `qinglong
worker list` executables against a real stack (AdminService through ingress, control's
admin role, PostgreSQL). Answers on stdout, secrets there exactly once, errors on stderr
with their code and reason and documented exit codes — never a traceback."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from qinglong_cli.ingress_client import ADMIN_TOKEN, OperatorContext
from qinglong_control.db import placement
from qinglong_control.db.identities import grant_cluster_admin

from tests.support.cli import Outcome, qinglong
from tests.support.stack import PROJECT, Stack
from tests.support.world import World


@pytest.fixture
def admin_stack_file(stack_file: Path, stack: Stack, tmp_path: Path) -> Path:
    """The operator's stack file (alice) with the admin section `qinglong up` adds: root,
    a cluster admin."""
    document = json.loads(stack_file.read_text())
    root_token = _secret_file(tmp_path / "root.token", stack.tokens["root"])
    document["admin"] = {"name": "root", "token_file": str(root_token)}
    stack_file.write_text(json.dumps(document))
    return stack_file


def _secret_file(path: Path, secret: str) -> Path:
    path.write_text(secret)
    path.chmod(0o600)
    return path


class Cli:
    """`qinglong` against one stack file; `admin` for `qinglong admin …`."""

    def __init__(self, stack_file: Path) -> None:
        self.stack_file = stack_file

    async def run(self, *args: str) -> Outcome:
        """`qinglong COMMAND ACTION …`: `--stack` goes before the rest, which may end in
        `-- CMD …`."""
        return await qinglong(*args[:2], "--stack", str(self.stack_file), *args[2:])

    async def admin(self, *args: str) -> Outcome:
        return await qinglong("admin", *args, "--stack", str(self.stack_file))

    async def ok(self, *args: str) -> Outcome:
        """`qinglong admin …`, which must succeed."""
        outcome = await self.admin(*args)
        assert outcome.code == 0, outcome.err
        return outcome

    async def item(self, *args: str) -> dict[str, Any]:
        document: dict[str, Any] = json.loads((await self.ok(*args, "--output", "json")).out)
        return document

    async def items(self, *args: str) -> list[dict[str, Any]]:
        # jsonl (the default off a terminal): one document per line, however many.
        return [json.loads(line) for line in (await self.ok(*args)).out.splitlines()]


@pytest.fixture
def cli(admin_stack_file: Path) -> Cli:
    return Cli(admin_stack_file)


async def test_projects_users_tokens_and_roles(cli: Cli, tmp_path: Path) -> None:
    project = await cli.item("project", "create", "cli-proj", "--display-name", "CLI project")
    assert (project["projectId"], project["state"]) == ("cli-proj", "RESOURCE_STATE_ACTIVE")
    assert project["version"] == 1  # an int64, printed as a number
    assert "cli-proj" in [p["projectId"] for p in await cli.items("project", "list", "--all")]

    dora = await cli.item("user", "create", "dora")
    assert (dora["kind"], dora["name"]) == ("PRINCIPAL_KIND_USER", "dora")
    assert [u["name"] for u in await cli.items("user", "list", "--all")].count("dora") == 1

    granted = await cli.item("role", "grant", "cli-proj", "dora", "operator")
    assert (granted["principalId"], granted["principalName"], granted["role"]) == (
        dora["principalId"],
        "dora",
        "PROJECT_ROLE_OPERATOR",
    )
    # A person reads names; the id stays in the answer for scripts.
    table = (await cli.ok("role", "list", "cli-proj", "--output", "table")).out.splitlines()
    assert table[0].split() == ["PROJECT", "PRINCIPAL", "ROLE", "STATE", "VERSION", "UPDATED"]
    assert table[1].split()[:4] == ["cli-proj", "dora", "operator", "active"]
    [listed] = await cli.items("role", "list", "cli-proj")
    assert (listed["principalId"], listed["principalName"]) == (dora["principalId"], "dora")

    # The token is issued to the name, printed once, and works as dora's operator token.
    issued = await cli.ok("token", "issue", "dora", "--ttl", "3600", "--output", "json")
    token = json.loads(issued.out)["token"]
    assert token.startswith("qlo1_")
    assert "shown only this once" in issued.err
    token_file = _secret_file(tmp_path / "dora.token", token)
    as_dora = await cli.run(
        "task", "create", "--project", "cli-proj", "--token-file", str(token_file),
        "--name", "by-dora", "--", "true",
    )  # fmt: skip
    assert as_dora.code == 0, as_dora.err
    (listed,) = await cli.items("token", "list", dora["principalId"])
    assert listed["prefix"] == token[:11]
    assert token not in json.dumps(listed)

    rotated = json.loads(
        (await cli.ok("token", "rotate", listed["tokenId"], "--output", "json")).out
    )
    assert rotated["token"] != token
    assert rotated["replaced"]["tokenId"] == listed["tokenId"]
    # --overlap 0 (the default): the old token stops at once.
    stale = await cli.run("run", "list", "--project", "cli-proj", "--token-file", str(token_file))
    assert (stale.code, stale.out) == (1, "")
    assert stale.err.startswith("error: UNAUTHENTICATED")
    revoked = await cli.item("token", "revoke", rotated["issued"]["tokenId"])
    assert revoked["state"] == "RESOURCE_STATE_DISABLED"

    revoked_role = await cli.item("role", "revoke", "cli-proj", "dora")
    assert revoked_role["state"] == "RESOURCE_STATE_DISABLED"
    assert revoked_role["version"] > granted["version"]
    assert (await cli.item("user", "disable", "dora"))["state"] == "RESOURCE_STATE_DISABLED"
    disabled = await cli.item("project", "disable", "cli-proj")
    assert disabled["state"] == "RESOURCE_STATE_DISABLED"


async def test_a_replayed_create_does_not_show_the_secret_again(cli: Cli) -> None:
    await cli.ok("agent", "create", "replayer")
    first = await cli.ok("token", "issue", "replayer", "--request-id", "issue-1")
    again = await cli.ok("token", "issue", "replayer", "--request-id", "issue-1")
    shown, replayed = json.loads(first.out), json.loads(again.out)
    assert replayed["issued"]["tokenId"] == shown["issued"]["tokenId"]
    assert shown["token"].startswith("qlo1_")
    assert "token" not in replayed
    assert "request issue-1 was answered before" in again.err
    assert shown["token"] not in again.out + again.err


async def test_a_token_saved_to_a_file_is_printed_nowhere(cli: Cli, tmp_path: Path) -> None:
    await cli.ok("agent", "create", "saver")
    await cli.ok("role", "grant", PROJECT, "saver", "operator")
    saved = tmp_path / "saver.token"
    issued = await cli.ok("token", "issue", "saver", "--save", str(saved))
    token = saved.read_text().strip()
    assert token.startswith("qlo1_")
    assert saved.stat().st_mode & 0o777 == 0o600
    assert token not in issued.out + issued.err
    assert "token" not in json.loads(issued.out)  # the answer, without its secret
    assert f"written to {saved}" in issued.err
    # A file that could not be written is refused before anything is issued.
    before = await cli.items("token", "list", "saver")
    unwritable = await cli.admin("token", "issue", "saver", "--save", str(tmp_path / "no" / "t"))
    assert (unwritable.code, unwritable.out) == (2, "")
    assert "not writable" in unwritable.err
    # Nor is anything issued into a directory, or over a file that may hold a token.
    for taken in (tmp_path, saved):
        refused = await cli.admin("token", "issue", "saver", "--save", str(taken))
        assert (refused.code, refused.out) == (2, ""), refused.err
    assert saved.read_text().strip() == token
    assert await cli.items("token", "list", "saver") == before
    # A rotation may replace its own token's file; one that cannot be written after the
    # rotation shows the new token instead of losing it.
    [listed] = before
    rotated = await cli.ok("token", "rotate", listed["tokenId"], "--save", str(saved))
    assert saved.read_text().strip() not in (token, "")
    assert saved.read_text().strip() not in rotated.out
    rotated_id = json.loads(rotated.out)["issued"]["tokenId"]
    full_disk = await qinglong(
        *("admin", "token", "rotate", rotated_id, "--save", str(saved)),
        *("--stack", str(cli.stack_file), "--output", "json"),
        file_size_limit=16,  # what Python's start-up writes fits; a token does not
    )
    assert full_disk.code == 2
    assert f"--save {saved}: not written" in full_disk.err
    shown = json.loads(full_disk.out)
    assert shown["token"].startswith("qlo1_"), "printed, since it could not be saved"
    assert saved.read_text().strip() != shown["token"]
    saved.write_text(shown["token"] + "\n")
    as_rotated = await cli.run("run", "list", "--token-file", str(saved))
    assert as_rotated.code == 0, as_rotated.err
    # The file is what --token-file takes, as the agent it names.
    as_saver = await cli.run("run", "list", "--token-file", str(saved))
    assert as_saver.code == 0, as_saver.err


async def test_agents_and_cluster_admins(cli: Cli) -> None:
    robot = await cli.item("agent", "create", "robot")
    assert (robot["kind"], robot.get("clusterAdmin", False)) == ("PRINCIPAL_KIND_AGENT", False)
    assert "robot" in [a["name"] for a in await cli.items("agent", "list", "--all")]
    assert "robot" not in [u["name"] for u in await cli.items("user", "list", "--all")]
    chief = await cli.item("user", "create", "chief", "--cluster-admin")
    assert chief["clusterAdmin"] is True
    table = (await cli.ok("agent", "list", "--all", "--output", "table")).out.splitlines()
    assert table[0].split() == ["PRINCIPAL", "KIND", "NAME", "STATE", "CLUSTER_ADMIN", "CREATED"]
    (robot_row,) = [row.split() for row in table[1:] if row.split()[2] == "robot"]
    assert robot_row[1:4] == ["agent", "robot", "active"]
    assert "yes" not in robot_row
    # An agent is never a cluster admin: the CLI has no such flag for one.
    no_flag = await cli.admin("agent", "create", "robot-2", "--cluster-admin")
    assert (no_flag.code, no_flag.out) == (2, "")
    assert "--cluster-admin" in no_flag.err
    # By id as well as by name.
    disabled = await cli.item("agent", "disable", robot["principalId"])
    assert disabled["state"] == "RESOURCE_STATE_DISABLED"


async def test_an_agent_listed_as_cluster_admin_is_refused(
    cli: Cli, stack: Stack, tmp_path: Path
) -> None:
    # A row an earlier version could write (`agent create --cluster-admin`): ingress
    # refuses the Agent's AdminService calls whatever cluster_admins says.
    bot = await cli.item("agent", "create", "old-bot")
    with psycopg.connect(stack.database.urls.migration, autocommit=True) as conn:
        grant_cluster_admin(conn, uuid.UUID(bot["principalId"]))
    issued = await cli.ok("token", "issue", "old-bot", "--output", "json")
    token_file = _secret_file(tmp_path / "bot.token", json.loads(issued.out)["token"])
    refused = await cli.admin("user", "create", "bot-made", "--token-file", str(token_file))
    assert (refused.code, refused.out) == (1, "")
    assert refused.err.startswith("error: PERMISSION_DENIED: ")
    assert "an agent may not call AdminService" in refused.err
    assert "bot-made" not in [u["name"] for u in await cli.items("user", "list", "--all")]


async def test_workers_join_tokens_and_the_fleet(cli: Cli) -> None:
    created = await cli.ok(
        "worker", "create", "edge-1", "--join-token-ttl", "600", "--request-id", "edge-1"
    )
    answer = json.loads(created.out)
    assert answer["worker"]["workerId"] == "edge-1"
    assert answer["joinToken"].startswith("qlj1_")
    assert "join token above is shown only this once" in created.err
    replayed = await cli.ok("worker", "create", "edge-1", "--request-id", "edge-1")
    assert "joinToken" not in json.loads(replayed.out)
    assert "was answered before" in replayed.err

    fleet = await qinglong("worker", "list", "--stack", str(cli.stack_file))
    assert fleet.code == 0, fleet.err
    workers = {w["workerId"]: w for w in map(json.loads, fleet.out.splitlines())}
    assert {"worker-a", "worker-b", "edge-1"} <= set(workers)
    assert "session" not in workers["edge-1"]  # never opened one
    table = await cli.run("worker", "list", "--output", "table")
    assert table.out.splitlines()[0].split()[:3] == ["WORKER", "STATE", "SESSION"]

    disabled = await cli.item("worker", "disable", "edge-1")
    assert disabled["state"] == "RESOURCE_STATE_DISABLED"
    one_page = await cli.ok("worker", "list", "--page-size", "1")
    assert len(one_page.out.splitlines()) == 1
    assert one_page.err.startswith("next page: --page-token ")


async def test_a_worker_is_cordoned_for_maintenance_and_uncordoned(cli: Cli, stack: Stack) -> None:
    """Through ingress and control: the offer the Worker held goes back to the pool at
    once (another Worker is offered its Run), and the call is audited."""
    async with await psycopg.AsyncConnection.connect(
        stack.database.urls.runtime, autocommit=True
    ) as conn:
        world = World(conn)
        run_id = await world.queued_run()
        held = await placement.pull_offers(conn, await world.session("worker-a"), 8, world.timings)
        assert [offer.run_id for offer in held.offers] == [run_id]
        cordoned = await cli.item("worker", "cordon", "worker-a")
        assert (cordoned["workerId"], cordoned["cordoned"]) == ("worker-a", True)
        state = await conn.execute(
            "SELECT state FROM qinglong.offers WHERE offer_id = %s", (held.offers[0].offer_id,)
        )
        assert await state.fetchone() == ("withdrawn",)
        other = await placement.pull_offers(conn, await world.session("worker-b"), 8, world.timings)
        assert [offer.run_id for offer in other.offers] == [run_id]
    again = await cli.item("worker", "cordon", "worker-a")  # idempotent
    assert again["cordoned"] is True
    table = await cli.run("worker", "list", "--output", "table")
    header, *rows = table.out.splitlines()
    at = header.index("CORDONED")  # columns are aligned; some cells are blank
    marks = {row.split()[0]: row[at:].split()[0] for row in rows}
    assert (marks["worker-a"], marks["worker-b"]) == ("yes", "-")
    uncordoned = await cli.item("worker", "uncordon", "worker-a")
    assert "cordoned" not in uncordoned  # false: protobuf JSON leaves it out
    missing = await cli.admin("worker", "cordon", "edge-none")
    assert (missing.code, missing.out) == (1, "")
    assert missing.err.startswith("error: NOT_FOUND WORKER_NOT_FOUND")
    audited = await cli.items(
        "audit", "list", "--operation", "AdminService/SetWorkerCordoned", "--since", "1h",
        "--all",
    )  # fmt: skip
    assert len(audited) == 4
    assert {record["principalName"] for record in audited} == {"root"}


async def test_a_worker_is_given_a_new_join_token(cli: Cli) -> None:
    created = json.loads((await cli.ok("worker", "create", "edge-3")).out)
    issued = await cli.ok(
        "worker", "join-token", "edge-3", "--ttl", "600", "--request-id", "rejoin-1",
        "--output", "json",
    )  # fmt: skip
    answer = json.loads(issued.out)
    assert answer["worker"]["workerId"] == "edge-3"
    assert answer["joinToken"].startswith("qlj1_")
    assert answer["joinToken"] != created["joinToken"]
    assert "join token above is shown only this once" in issued.err
    replayed = await cli.ok("worker", "join-token", "edge-3", "--request-id", "rejoin-1")
    assert "joinToken" not in json.loads(replayed.out)
    assert json.loads(replayed.out)["joinTokenExpireTime"] == answer["joinTokenExpireTime"]
    assert "request rejoin-1 was answered before" in replayed.err
    assert answer["joinToken"] not in replayed.out + replayed.err
    table = (await cli.ok("worker", "join-token", "edge-3", "--output", "table")).out
    header, row = table.splitlines()
    assert header.split() == ["WORKER", "PRINCIPAL", "JOIN_TOKEN_EXPIRES", "JOIN_TOKEN"]
    assert row.split()[0] == "edge-3"
    assert row.split()[-1].startswith("qlj1_")
    # Unknown and disabled Workers are refused on stderr, exit 1.
    missing = await cli.admin("worker", "join-token", "edge-none")
    assert (missing.code, missing.out) == (1, "")
    assert missing.err.startswith("error: NOT_FOUND WORKER_NOT_FOUND")
    await cli.ok("worker", "disable", "edge-3")
    disabled = await cli.admin("worker", "join-token", "edge-3")
    assert (disabled.code, disabled.out) == (1, "")
    assert disabled.err.startswith("error: FAILED_PRECONDITION WORKER_DISABLED")


async def test_a_join_token_saved_to_a_file_is_printed_nowhere(cli: Cli, tmp_path: Path) -> None:
    """`worker create|join-token --save FILE`: the join token goes to a 0600 file for the
    Worker's `join --token-file`; create refuses a file that exists (a token it holds would
    be lost), a new join token may replace the file (the ones before it stop working)."""
    saved = tmp_path / "edge-5.join"
    created = await cli.ok("worker", "create", "edge-5", "--save", str(saved))
    first = saved.read_text().strip()
    assert first.startswith("qlj1_")
    assert saved.stat().st_mode & 0o777 == 0o600
    assert first not in created.out + created.err
    assert "joinToken" not in json.loads(created.out)
    assert f"join token was written to {saved}" in created.err
    refused = await cli.admin("worker", "create", "edge-6", "--save", str(saved))
    assert (refused.code, refused.out) == (2, "")
    assert "the file exists" in refused.err
    assert all(w["workerId"] != "edge-6" for w in await cli.items("worker", "list"))
    renewed = await cli.ok("worker", "join-token", "edge-5", "--save", str(saved))
    second = saved.read_text().strip()
    assert second.startswith("qlj1_")
    assert second != first
    assert second not in renewed.out + renewed.err


async def test_the_last_cluster_admin_is_not_disabled(cli: Cli) -> None:
    refused = await cli.admin("user", "disable", "root")
    assert (refused.code, refused.out) == (1, "")
    assert refused.err.startswith("error: FAILED_PRECONDITION LAST_CLUSTER_ADMIN")
    assert "Traceback" not in refused.err
    root = next(u for u in await cli.items("user", "list", "--all") if u["name"] == "root")
    assert root["state"] == "RESOURCE_STATE_ACTIVE"


async def test_a_worker_serves_the_projects_it_is_given(cli: Cli) -> None:
    await cli.ok("project", "create", "edge-proj")
    created = await cli.ok(
        "worker", "create", "edge-2", "--project", PROJECT, "--project", "edge-proj"
    )
    assert json.loads(created.out)["worker"]["projectIds"] == [PROJECT, "edge-proj"]
    only = await cli.item("worker", "projects", "edge-2", "--project", "edge-proj")
    assert only["projectIds"] == ["edge-proj"]
    table = (await cli.ok("worker", "list", "--output", "table")).out.splitlines()
    assert "PROJECTS" in table[0].split()
    rows = {row.split()[0]: row.split() for row in table[1:]}
    assert "edge-proj" in rows["edge-2"]
    assert "*" in rows["worker-a"]  # every project
    everywhere = await cli.item("worker", "projects", "edge-2", "--all-projects")
    assert "projectIds" not in everywhere
    # Nothing, or both, is a usage error; a project that does not exist is refused.
    neither = await cli.admin("worker", "projects", "edge-2")
    assert neither.code == 2
    both = await cli.admin("worker", "projects", "edge-2", "--project", PROJECT, "--all-projects")
    assert both.code == 2
    missing = await cli.admin("worker", "projects", "edge-2", "--project", "no-such")
    assert (missing.code, missing.out) == (1, "")
    assert missing.err.startswith("error: NOT_FOUND PROJECT_NOT_FOUND")
    assert "project_ids[0]" in missing.err


async def test_audit_records_filtered_and_paged(cli: Cli) -> None:
    await cli.ok("project", "list")
    root = next(u for u in await cli.items("user", "list", "--all") if u["name"] == "root")
    records = await cli.items(
        "audit", "list", "--principal", "root", "--operation", "AdminService/ListProjects",
        "--outcome", "admitted", "--since", "1h", "--all",
    )  # fmt: skip
    assert records
    for record in records:
        assert record["principalId"] == root["principalId"]
        assert record["principalName"] == "root"
        assert record["outcome"] == "AUDIT_OUTCOME_ADMITTED"
        assert record["operation"] == "AdminService/ListProjects"
    table = await cli.ok(
        "audit", "list", "--principal", "root", "--operation", "AdminService/ListProjects",
        "--page-size", "1", "--output", "table",
    )  # fmt: skip
    header, row = table.out.splitlines()
    assert "CALLER" in header.split()
    assert "user:root" in row.split()  # (an admitted call's REASON is blank)
    # A Worker's call is listed by its id, which is its name; no name is looked up.
    workers = [r for r in await cli.items("audit", "list", "--page-size", "500")
               if r.get("principalKind") == "worker"]  # fmt: skip
    assert all("principalName" not in r for r in workers)
    future = await cli.items("audit", "list", "--since", "2999-01-01T00:00:00Z")
    assert future == []
    first = await cli.ok("audit", "list", "--page-size", "1")
    assert len(first.out.splitlines()) == 1
    assert "next page: --page-token " in first.err


async def test_a_non_admin_is_refused_on_stderr_with_exit_1(cli: Cli, tmp_path: Path) -> None:
    alice = tmp_path / "alice.token"  # the operator's token: a project role, no admin
    for refused in (
        await cli.admin("project", "list", "--token-file", str(alice)),
        await cli.run("worker", "list", "--token-file", str(alice)),
    ):
        assert (refused.code, refused.out) == (1, "")
        assert refused.err.startswith("error: PERMISSION_DENIED: ")
        assert "Traceback" not in refused.err
    # Both refusals are in the audit, which the admin reads by outcome.
    denied = await cli.items("audit", "list", "--outcome", "permission_denied", "--all")
    operations = {record["operation"] for record in denied}
    assert {"AdminService/ListProjects", "AdminService/ListWorkers"} <= operations


async def test_names_and_times_that_mean_nothing_are_explained(cli: Cli) -> None:
    ghost = await cli.admin("token", "issue", "ghost")
    assert (ghost.code, ghost.out) == (1, "")
    assert ghost.err == "error: NOT_FOUND: no agent or user is named 'ghost'\n"
    malformed = await cli.admin("token", "revoke", "not-a-uuid")
    assert malformed.code == 1
    assert "  token_id: " in malformed.err
    bad_time = await cli.admin("audit", "list", "--since", "yesterday")
    assert bad_time.code == 2
    assert "not a time: 'yesterday'" in bad_time.err


async def test_a_stack_file_without_an_admin_token(cli: Cli, tmp_path: Path) -> None:
    document = json.loads(cli.stack_file.read_text())
    root_token = Path(document.pop("admin")["token_file"])
    older = tmp_path / "older.json"
    older.write_text(json.dumps(document))
    refused = await qinglong("worker", "list", "--stack", str(older))
    assert (refused.code, refused.out) == (2, "")
    assert "names no admin token file" in refused.err
    assert "QINGLONG_ADMIN_TOKEN_FILE" in refused.err
    # The environment names it instead (the flag would win over both).
    context = OperatorContext.from_stack(
        older, ADMIN_TOKEN, environ={"QINGLONG_ADMIN_TOKEN_FILE": str(root_token)}
    )
    assert context.token_file == root_token
    flagged = OperatorContext.from_stack(
        older, ADMIN_TOKEN, token_file=tmp_path / "x", environ={"QINGLONG_ADMIN_TOKEN_FILE": "y"}
    )
    assert flagged.token_file == tmp_path / "x"


async def test_a_project_and_a_principal_are_shown_by_get(cli: Cli) -> None:
    created = await cli.item("project", "create", "get-proj", "--display-name", "Get me")
    assert await cli.item("project", "get", "get-proj") == created
    table = (await cli.ok("project", "get", "get-proj", "--output", "table")).out.splitlines()
    assert table[0].split() == ["PROJECT", "NAME", "STATE", "VERSION", "CREATED"]
    assert table[1].split()[:2] == ["get-proj", "Get"]
    dora = await cli.item("user", "create", "dora-get")
    # By name (looked up among users) or by id, as `user disable` takes it.
    assert await cli.item("user", "get", "dora-get") == dora
    assert await cli.item("user", "get", dora["principalId"]) == dora
    root = await cli.item("user", "get", "root")
    assert (root["clusterAdmin"], root["kind"]) == (True, "PRINCIPAL_KIND_USER")
    bot = await cli.item("agent", "create", "bot-get")
    assert await cli.item("agent", "get", "bot-get") == bot
    header = (await cli.ok("user", "get", "root", "--output", "table")).out.splitlines()[0]
    assert header.split() == ["PRINCIPAL", "KIND", "NAME", "STATE", "CLUSTER_ADMIN", "CREATED"]
    # Missing ones on stderr, exit 1: the server's NOT_FOUND, or the name lookup's.
    missing = await cli.admin("project", "get", "no-such-proj")
    assert (missing.code, missing.out) == (1, "")
    assert missing.err.startswith("error: NOT_FOUND PROJECT_NOT_FOUND")
    nobody = await cli.admin("user", "get", str(uuid.uuid4()))
    assert (nobody.code, nobody.out) == (1, "")
    assert nobody.err.startswith("error: NOT_FOUND PRINCIPAL_NOT_FOUND")
    unnamed = await cli.admin("user", "get", "no-such-user")
    assert (unnamed.code, unnamed.out) == (1, "")
    assert "no user is named 'no-such-user'" in unnamed.err
    # An id names any principal; `user get` shows only a user, as a name would.
    not_a_user = await cli.admin("user", "get", bot["principalId"])
    assert (not_a_user.code, not_a_user.out) == (1, "")
    assert f"no user has the id {bot['principalId']}" in not_a_user.err
    assert "Traceback" not in missing.err + nobody.err + unnamed.err + not_a_user.err


async def test_token_list_shows_each_tokens_last_use(cli: Cli, tmp_path: Path) -> None:
    await cli.ok("project", "create", "used-proj")
    await cli.ok("user", "create", "uma")
    await cli.ok("role", "grant", "used-proj", "uma", "viewer")
    used = tmp_path / "uma.token"
    await cli.ok("token", "issue", "uma", "--save", str(used), "--request-id", "t-used")
    await cli.ok("token", "issue", "uma", "--save", str(tmp_path / "idle.token"))
    listed = await cli.run("run", "list", "--project", "used-proj", "--token-file", str(used))
    assert listed.code == 0, listed.err
    tokens = await cli.items("token", "list", "uma")
    last_used = {t["prefix"]: t.get("lastUsedTime") for t in tokens}
    assert last_used[used.read_text().strip()[:11]] is not None
    assert list(last_used.values()).count(None) == 1  # the idle token was never used
    table = (await cli.ok("token", "list", "uma", "--output", "table")).out.splitlines()
    assert table[0].split() == [
        "TOKEN_ID", "PRINCIPAL", "PREFIX", "STATE", "CREATED", "EXPIRES", "LAST_USED",
    ]  # fmt: skip
    # Newest first: the idle token (never used: "-"), then the one uma listed Runs with.
    assert [row.split()[-1] for row in table[1:]] == [
        "-",
        next(t["lastUsedTime"] for t in tokens if t.get("lastUsedTime")),
    ]
    # The admin's own calls are its token's uses: this very listing is the newest.
    (root_token,) = await cli.items("token", "list", "root")

    def moment(text: str) -> dt.datetime:
        return dt.datetime.fromisoformat(text)

    assert moment(root_token["lastUsedTime"]) >= moment(tokens[-1]["lastUsedTime"])
