"""The operator CLI as a user meets it: the real `qinglong` executable against a real stack
(control + ingress over mTLS, PostgreSQL), answers on stdout, errors on stderr with their
code, reason and field violations, and documented exit codes — never a traceback."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import re
from pathlib import Path

import psycopg
from qinglong_cli.cli_errors import EXIT_PENDING_APPROVAL
from qinglong_protocol.identities import operator_uri

from tests.support.cli import QINGLONG, qinglong
from tests.support.lossy_proxy import FaultSchedule, LossyProxy, lose_answers
from tests.support.stack import Stack


async def test_task_create_trigger_list_as_json_with_numbers(stack_file: Path) -> None:
    created = await qinglong(
        "task", "create", "--stack", str(stack_file), "--name", "hello",
        "--timeout-ms", "60000", "--max-attempts", "3", "--", "echo", "hi",
    )  # fmt: skip
    assert (created.code, created.err) == (0, "")
    revision = json.loads(created.out)
    assert revision["revisionNumber"] == 1  # an int64, printed as a number
    assert revision["plan"]["retryPolicy"]["maxAttempts"] == 3
    task_id = revision["taskId"]
    got = await qinglong("task", "get", task_id, "--stack", str(stack_file), "--output", "json")
    assert json.loads(got.out)["latestRevisionNumber"] == 1
    triggered = await qinglong("run", "trigger", "--task", task_id, "--stack", str(stack_file))
    run = json.loads(triggered.out)
    assert (run["state"], run["maxAttempts"], run["version"]) == ("RUN_STATE_QUEUED", 3, 1)
    listed = await qinglong(
        "run", "list", "--stack", str(stack_file), "--state", "queued", "--task", task_id,
        "--output", "table",
    )  # fmt: skip
    header, row = listed.out.splitlines()
    assert header.split() == ["RUN", "STATE", "ATTEMPTS", "PRIORITY", "CREATED", "ERROR"]
    assert row.split()[:4] == [run["runId"], "queued", "0/3", "0"]
    none = await qinglong("run", "list", "--stack", str(stack_file), "--state", "succeeded")
    assert (none.code, none.out) == (0, "")


async def test_a_run_pins_the_revision_asked_for_or_the_newest(stack_file: Path) -> None:
    stack = ("--stack", str(stack_file))
    created = await qinglong("task", "create", *stack, "--name", "pinned", "--", "echo", "1")
    task_id = json.loads(created.out)["taskId"]
    revised = await qinglong("task", "revise", task_id, *stack, "--", "echo", "2")
    assert json.loads(revised.out)["revisionNumber"] == 2
    first = await qinglong("run", "trigger", "--task", task_id, "--revision", "1", *stack)
    newest = await qinglong("run", "trigger", "--task", task_id, *stack)
    assert json.loads(first.out)["revisionNumber"] == 1
    assert json.loads(newest.out)["revisionNumber"] == 2
    missing = await qinglong("run", "trigger", "--task", task_id, "--revision", "3", *stack)
    assert (missing.code, missing.out) == (1, "")
    assert missing.err.startswith("error: NOT_FOUND REVISION_NOT_FOUND")
    zero = await qinglong("run", "trigger", "--task", task_id, "--revision", "0", *stack)
    assert zero.code == 1
    assert zero.err.startswith("error: INVALID_ARGUMENT FIELD_INVALID")
    assert "  revision_number: " in zero.err


async def test_a_run_carries_its_parameters_and_a_retry_must_repeat_them(
    stack_file: Path,
) -> None:
    stack = ("--stack", str(stack_file))
    created = await qinglong("task", "create", *stack, "--name", "params", "--", "true")
    task_id = json.loads(created.out)["taskId"]
    params = ("--param", "TARGET=eu=west 1", "--param", "EMPTY=")
    trigger = ("run", "trigger", "--task", task_id, *stack, "--request-id", "params-1")
    first = await qinglong(*trigger, *params)
    assert (first.code, first.err) == (0, "")
    run = json.loads(first.out)
    assert run["parameters"] == {"TARGET": "eu=west 1", "EMPTY": ""}
    got = json.loads((await qinglong("run", "get", run["runId"], *stack)).out)
    assert got["parameters"] == run["parameters"]
    listed = [json.loads(line) for line in (await qinglong("run", "list", *stack)).out.splitlines()]
    mine = [item for item in listed if item["runId"] == run["runId"]]
    assert mine
    assert "parameters" not in mine[0]  # a page of Runs leaves them out
    again = await qinglong(*trigger, *params)
    assert json.loads(again.out)["runId"] == run["runId"]
    other = await qinglong(*trigger, "--param", "TARGET=us")
    assert other.code == 1
    assert other.err.startswith("error: ABORTED REPLAY_MISMATCH")
    lower = await qinglong("run", "trigger", "--task", task_id, *stack, "--param", "target=x")
    assert lower.code == 1
    assert lower.err.startswith("error: INVALID_ARGUMENT FIELD_INVALID")
    assert "parameters" in lower.err
    no_value = await qinglong("run", "trigger", "--task", task_id, *stack, "--param", "SECRETX")
    assert no_value.code != 0
    assert "NAME=VALUE" in no_value.err
    assert "SECRETX" not in no_value.err


async def test_a_rerun_queues_a_new_run_like_the_earlier_one(stack_file: Path) -> None:
    """Its task, its pinned revision (or with --newest the task's newest), its parameters
    and priority; a retried rerun (same --request-id) answers the same new Run."""
    stack = ("--stack", str(stack_file))
    created = await qinglong("task", "create", *stack, "--name", "again", "--", "echo", "1")
    task_id = json.loads(created.out)["taskId"]
    params = ("--param", "TARGET=eu", "--param", "EMPTY=", "--priority", "7")
    earlier = json.loads((await qinglong("run", "trigger", "--task", task_id, *stack, *params)).out)
    assert earlier["priority"] == 7
    await qinglong("task", "revise", task_id, *stack, "--", "echo", "2")
    rerun = ("run", "rerun", earlier["runId"], *stack)
    again = await qinglong(*rerun, "--request-id", "rerun-1")
    assert (again.code, again.err) == (0, "")
    run = json.loads(again.out)
    assert run["runId"] != earlier["runId"]
    assert (run["taskId"], run["revisionNumber"]) == (task_id, 1)
    assert run["parameters"] == {"TARGET": "eu", "EMPTY": ""}
    assert run["priority"] == 7
    retried = json.loads((await qinglong(*rerun, "--request-id", "rerun-1")).out)
    assert retried["runId"] == run["runId"]
    newest = json.loads((await qinglong(*rerun, "--newest")).out)
    assert newest["revisionNumber"] == 2
    assert newest["parameters"] == earlier["parameters"]
    assert len({earlier["runId"], run["runId"], newest["runId"]}) == 3
    unknown = "00000000-0000-4000-8000-000000000000"
    missing = await qinglong("run", "rerun", unknown, *stack)
    assert (missing.code, missing.out) == (1, "")
    assert missing.err.startswith("error: NOT_FOUND RUN_NOT_FOUND")
    too_urgent = await qinglong("run", "trigger", "--task", task_id, *stack, "--priority", "101")
    assert too_urgent.code == 1
    assert too_urgent.err.startswith("error: INVALID_ARGUMENT FIELD_INVALID")
    assert "priority" in too_urgent.err


async def test_a_revision_can_require_worker_labels(stack_file: Path) -> None:
    stack = ("--stack", str(stack_file))
    created = await qinglong("task", "create", *stack, "--name", "gpu", "--", "true")
    task_id = json.loads(created.out)["taskId"]
    needs = ("--require-label", "gpu=a100", "--require-label", "zone=eu-1")
    revised = await qinglong("task", "revise", task_id, *stack, *needs, "--", "train")
    assert (revised.code, revised.err) == (0, "")
    plan = json.loads(revised.out)["plan"]
    assert plan["workerSelector"] == {"gpu": "a100", "zone": "eu-1"}
    newest = await qinglong("task", "revision", task_id, *stack)
    assert json.loads(newest.out)["plan"] == plan
    table = await qinglong("task", "revision", task_id, *stack, "--output", "table")
    header, row = table.out.splitlines()
    assert header.split()[-2:] == ["ATTEMPTS", "NEEDS_LABELS"]
    assert row.split()[-2:] == ["1", "gpu=a100,zone=eu-1"]
    first = json.loads((await qinglong("task", "revision", task_id, "--number", "1", *stack)).out)
    assert (first["revisionNumber"], "workerSelector" in first["plan"]) == (1, False)
    upper = await qinglong("task", "revise", task_id, *stack, "--require-label", "GPU=x", "--", "t")
    assert upper.code == 1
    assert upper.err.startswith("error: INVALID_ARGUMENT FIELD_INVALID")
    assert "worker_selector" in upper.err
    bare = await qinglong("task", "revise", task_id, *stack, "--require-label", "gpu", "--", "t")
    assert bare.code != 0
    assert "--require-label needs KEY=VALUE" in bare.err


async def test_a_revision_can_bound_how_long_its_runs_wait_queued(stack_file: Path) -> None:
    stack = ("--stack", str(stack_file))
    created = await qinglong(
        "task", "create", *stack, "--name", "q", "--queue-timeout-ms", "90000", "--", "true"
    )
    assert (created.code, created.err) == (0, "")
    task_id = json.loads(created.out)["taskId"]
    plan = json.loads((await qinglong("task", "revision", task_id, *stack)).out)["plan"]
    assert plan["queueTimeoutMs"] == 90000  # the CLI prints int64 values as numbers
    table = await qinglong("task", "revision", task_id, *stack, "--output", "table")
    header, row = table.out.splitlines()
    column = header.split().index("QUEUE_TIMEOUT_MS")
    assert row.split()[column] == "90000"
    revised = await qinglong("task", "revise", task_id, *stack, "--", "true")
    assert "queueTimeoutMs" not in json.loads(revised.out)["plan"], "a revision is a whole plan"
    for out_of_range in ("999", "2592000001"):
        refused = await qinglong(
            "task", "revise", task_id, *stack, "--queue-timeout-ms", out_of_range, "--", "t"
        )
        assert refused.code == 1
        assert refused.err.startswith("error: INVALID_ARGUMENT FIELD_INVALID")
        assert "plan.queue_timeout_ms" in refused.err


async def test_a_revision_can_limit_how_many_of_its_tasks_runs_run_at_once(
    stack_file: Path,
) -> None:
    stack = ("--stack", str(stack_file))
    created = await qinglong(
        "task", "create", *stack, "--name", "deploy", "--max-concurrent-runs", "1", "--", "true"
    )
    assert (created.code, created.err) == (0, "")
    task_id = json.loads(created.out)["taskId"]
    assert json.loads(created.out)["plan"]["maxConcurrentRuns"] == 1
    table = await qinglong("task", "revision", task_id, *stack, "--output", "table")
    header, row = table.out.splitlines()
    assert row.split()[header.split().index("MAX_CONCURRENT")] == "1"
    first, second = [
        json.loads((await qinglong("run", "trigger", "--task", task_id, *stack)).out)["state"]
        for _ in range(2)
    ]
    assert (first, second) == ("RUN_STATE_QUEUED", "RUN_STATE_CREATED")
    for out_of_range in ("0", "10001"):
        refused = await qinglong(
            "task", "revise", task_id, *stack, "--max-concurrent-runs", out_of_range, "--", "t"
        )
        assert refused.code == 1
        assert refused.err.startswith("error: INVALID_ARGUMENT FIELD_INVALID")
        assert "plan.max_concurrent_runs" in refused.err


def task_names(stack: Stack) -> list[str]:
    with psycopg.connect(stack.database.urls.migration) as conn:
        return [row[0] for row in conn.execute("SELECT display_name FROM qinglong.tasks")]


async def test_a_refused_field_names_the_field_on_stderr_with_exit_1(
    stack: Stack, stack_file: Path
) -> None:
    refused = await qinglong(
        "task", "create", "--stack", str(stack_file), "--name", "bad",
        "--timeout-ms", "-5", "--", "true",
    )  # fmt: skip
    assert refused.code == 1
    assert refused.out == ""
    assert refused.err.startswith("error: INVALID_ARGUMENT FIELD_INVALID")
    assert "  first_revision_plan.timeout_ms: " in refused.err
    assert "Traceback" not in refused.err
    # One call: a refused plan leaves no task without a revision behind.
    assert "bad" not in task_names(stack)


async def test_an_unknown_task_is_task_not_found(stack_file: Path) -> None:
    unknown = "00000000-0000-4000-8000-000000000000"
    triggered = await qinglong("run", "trigger", "--task", unknown, "--stack", str(stack_file))
    assert (triggered.code, triggered.out) == (1, "")
    assert triggered.err.startswith("error: NOT_FOUND TASK_NOT_FOUND")
    revised = await qinglong("task", "revise", unknown, "--stack", str(stack_file), "--", "true")
    assert revised.code == 1
    assert revised.err.startswith("error: NOT_FOUND TASK_NOT_FOUND")


async def test_events_name_the_operator(stack_file: Path) -> None:
    created = await qinglong(
        "task", "create", "--stack", str(stack_file), "--name", "e", "--", "true"
    )
    task_id = json.loads(created.out)["taskId"]
    triggered = await qinglong("run", "trigger", "--task", task_id, "--stack", str(stack_file))
    run_id = json.loads(triggered.out)["runId"]
    listed = await qinglong("run", "events", run_id, "--stack", str(stack_file))
    (queued,) = [json.loads(line) for line in listed.out.splitlines()]
    assert (queued["type"], queued["actorName"]) == ("run.queued", "alice")
    table = await qinglong("run", "events", run_id, "--stack", str(stack_file), "--output", "table")
    header, row = table.out.splitlines()
    assert header.split() == ["SEQ", "TYPE", "ACTOR", "AT"]
    assert row.split()[:3] == ["1", "run.queued", "user:alice"]
    # Streamed a row at a time, the columns still line up under their headers.
    for column in ("TYPE", "ACTOR", "AT"):
        start = header.index(column)
        assert row[start - 1] == " ", (column, header, row)
        assert row[start] != " ", (column, header, row)


async def test_bad_ids_and_unknown_runs_are_explained(stack_file: Path) -> None:
    malformed = await qinglong("run", "get", "not-a-uuid", "--stack", str(stack_file))
    assert malformed.code == 1
    assert "  run_id: " in malformed.err
    missing = await qinglong(
        "run", "get", "00000000-0000-4000-8000-000000000000", "--stack", str(stack_file)
    )
    assert missing.code == 1
    assert missing.err.startswith("error: NOT_FOUND RUN_NOT_FOUND")


async def test_stack_file_problems_are_one_line_with_exit_2(tmp_path: Path) -> None:
    absent = await qinglong("run", "list", "--stack", str(tmp_path / "nope.json"))
    assert (absent.code, absent.out) == (2, "")
    assert absent.err.startswith(f"error: no stack file at {tmp_path / 'nope.json'}")
    empty = tmp_path / "empty.json"
    empty.write_text("")
    broken = await qinglong("run", "list", "--stack", str(empty))
    assert broken.code == 2
    assert f"cannot read stack file {empty}" in broken.err
    assert "Traceback" not in absent.err + broken.err


def moved_stack(stack_file: Path, tmp_path: Path, address: str = "127.0.0.1:1") -> Path:
    """The same identity, pointed at another address (by default, where nothing listens)."""
    document = json.loads(stack_file.read_text())
    document["ingress"]["address"] = address
    moved = tmp_path / "moved.json"
    moved.write_text(json.dumps(document))
    return moved


async def test_an_unreachable_stack_exits_3(stack_file: Path, tmp_path: Path) -> None:
    moved = moved_stack(stack_file, tmp_path)
    unreachable = await qinglong("run", "list", "--stack", str(moved))
    assert unreachable.code == 3
    assert unreachable.err.startswith("error: UNAVAILABLE")
    assert "Traceback" not in unreachable.err


async def test_a_terminal_gets_a_table_by_default(stack_file: Path) -> None:
    created = await qinglong(
        "task", "create", "--stack", str(stack_file), "--name", "t", "--", "true"
    )
    task_id = json.loads(created.out)["taskId"]
    primary, secondary = pty.openpty()
    try:
        process = await asyncio.create_subprocess_exec(
            str(QINGLONG), "task", "get", task_id, "--stack", str(stack_file),
            stdout=secondary, stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        os.close(secondary)
        _, err = await asyncio.wait_for(process.communicate(), timeout=60)
        assert (process.returncode, err) == (0, b"")
        shown = os.read(primary, 65536).decode()
    finally:
        os.close(primary)
    header, row = shown.splitlines()
    assert header.split() == ["TASK", "NAME", "REVISION", "CREATED"]
    assert row.split()[:3] == [task_id, "t", "1"]


async def test_run_list_pages_with_limit_and_page_token(stack_file: Path) -> None:
    stack = ("--stack", str(stack_file))
    created = await qinglong("task", "create", *stack, "--name", "paged", "--", "true")
    task_id = json.loads(created.out)["taskId"]
    triggered = [
        json.loads((await qinglong("run", "trigger", "--task", task_id, *stack)).out)["runId"]
        for _ in range(3)
    ]
    first = await qinglong("run", "list", *stack, "--task", task_id, "--limit", "2")
    assert first.code == 0
    # The footer is on stderr, so stdout stays one JSON object per line.
    assert first.err.startswith("next page: --page-token ")
    token = first.err.split()[-1]
    second = await qinglong(
        "run", "list", *stack, "--task", task_id, "--limit", "2", "--page-token", token
    )
    assert (second.code, second.err) == (0, "")
    listed = [json.loads(line)["runId"] for line in (first.out + second.out).splitlines()]
    assert listed == triggered[::-1]  # newest first


async def test_task_list_shows_tasks_newest_first_and_pages(stack_file: Path) -> None:
    stack = ("--stack", str(stack_file))
    created = []
    for name in ("first", "second", "third"):
        made = await qinglong("task", "create", *stack, "--name", name, "--", "true")
        created.append(json.loads(made.out)["taskId"])
    newest_first = created[::-1]
    first = await qinglong("task", "list", *stack, "--limit", "2")
    assert first.code == 0
    # The footer is on stderr, so stdout stays one JSON object per line.
    assert first.err.startswith("next page: --page-token ")
    token = first.err.split()[-1]
    second = await qinglong("task", "list", *stack, "--limit", "2", "--page-token", token)
    assert (second.code, second.err) == (0, "")
    listed = [json.loads(line) for line in (first.out + second.out).splitlines()]
    assert [task["taskId"] for task in listed] == newest_first
    assert [task["latestRevisionNumber"] for task in listed] == [1, 1, 1]  # numbers
    table = await qinglong("task", "list", *stack, "--output", "table")
    assert (table.code, table.err) == (0, "")
    header, *rows = table.out.splitlines()
    assert header.split() == ["TASK", "NAME", "REVISION", "CREATED"]
    names = ("third", "second", "first")
    assert [row.split()[:3] for row in rows] == [
        [task_id, name, "1"] for task_id, name in zip(newest_first, names, strict=True)
    ]


async def test_an_agents_cancel_is_approved_from_the_cli(
    stack: Stack, stack_file: Path, tmp_path: Path
) -> None:
    """R-OPS-2 as a newcomer meets it: the Agent's cancel names its approval request; a
    person lists, reads and approves it; deciding it again the other way is explained."""
    bot_token = tmp_path / "bot.token"
    bot_token.write_text(stack.tokens["bot"])
    bot_token.chmod(0o600)
    stack_flag = ("--stack", str(stack_file))
    created = await qinglong("task", "create", *stack_flag, "--name", "long", "--", "sleep", "1")
    task_id = json.loads(created.out)["taskId"]
    run_id = json.loads((await qinglong("run", "trigger", "--task", task_id, *stack_flag)).out)[
        "runId"
    ]
    held = await qinglong("run", "cancel", run_id, *stack_flag, "--token-file", str(bot_token))
    # Answered, not refused — but nothing was done: a script must not read it as done.
    assert held.code == EXIT_PENDING_APPROVAL
    answer = json.loads(held.out)
    assert answer["outcome"] == "CANCEL_RUN_OUTCOME_REQUIRE_APPROVAL"
    approval_id = answer["approvalId"]
    assert held.err == (
        f"held for approval {approval_id}: nothing was done yet; a person decides it with "
        f"`qinglong approval approve|deny {approval_id}`\n"
    )

    listed = await qinglong(
        "approval", "list", *stack_flag, "--state", "pending", "--output", "table"
    )
    header, row = listed.out.splitlines()
    assert header.split()[:5] == ["APPROVAL", "STATE", "METHOD", "RUN", "REQUESTED_BY"]
    assert row.split()[:5] == [approval_id, "pending", "CancelRun", run_id, "bot"]
    shown = json.loads((await qinglong("approval", "get", approval_id, *stack_flag)).out)
    assert shown["request"]["runId"] == run_id  # the exact held request, readable

    approved = await qinglong("approval", "approve", approval_id, *stack_flag, "--note", "ok")
    assert (approved.code, approved.err) == (0, "")
    decided = json.loads(approved.out)
    assert (decided["state"], decided["decidedByName"], decided["result"]) == (
        "APPROVAL_STATE_APPROVED",
        "alice",
        "ACCEPTED",
    )
    run = json.loads((await qinglong("run", "get", run_id, *stack_flag)).out)
    assert run["cancelIntent"]["reason"] == "CANCEL_REASON_USER"

    too_late = await qinglong("approval", "deny", approval_id, *stack_flag)
    assert (too_late.code, too_late.out) == (1, "")
    assert too_late.err.startswith("error: FAILED_PRECONDITION APPROVAL_NOT_PENDING")
    assert "approved" in too_late.err
    # An Agent may not decide: refused with the documented exit code, no traceback.
    agent = await qinglong(
        "approval", "deny", approval_id, *stack_flag, "--token-file", str(bot_token)
    )
    assert (agent.code, agent.out) == (1, "")
    assert agent.err.startswith("error: PERMISSION_DENIED: ")
    assert "Traceback" not in agent.err


def runs_of(stack: Stack, task_id: str) -> list[str]:
    with psycopg.connect(stack.database.urls.migration) as conn:
        return [
            str(row[0])
            for row in conn.execute(
                "SELECT run_id FROM qinglong.runs WHERE task_id = %s", (task_id,)
            )
        ]


async def test_a_trigger_whose_answer_was_lost_is_retried_by_its_request_id(
    stack: Stack, stack_file: Path, tmp_path: Path
) -> None:
    """A real lost answer: a proxy between the CLI and ingress throws TriggerRun's answer
    away after control committed the Run. The CLI names the request id; the same command
    with it answers that Run and makes no second one."""
    created = await qinglong("task", "create", "--stack", str(stack_file), "--name", "once",
                             "--", "true")  # fmt: skip
    task_id = json.loads(created.out)["taskId"]
    schedule = FaultSchedule([lose_answers("TriggerRun", 1)])
    with LossyProxy(
        upstream_address=stack.ingress_address,
        upstream_identity=stack.operator_identity("carol"),
        server_identity=stack.pki.ingress_server,
        allowed_peer_uri=operator_uri(stack.pki.trust_domain, "carol"),
        schedule=schedule,
    ) as proxy:
        through_proxy = moved_stack(stack_file, tmp_path, proxy.address)
        lost = await qinglong("run", "trigger", "--task", task_id, "--stack", str(through_proxy))
    assert schedule.faults["TriggerRun"] == 1  # the answer really was lost
    assert (lost.code, lost.out) == (3, "")
    hint = re.search(r"--request-id (\S+) answers what it did", lost.err)
    assert hint is not None, lost.err
    committed = runs_of(stack, task_id)
    assert len(committed) == 1  # control had made the Run

    again = await qinglong("run", "trigger", "--task", task_id, "--stack", str(stack_file),
                           "--request-id", hint.group(1))  # fmt: skip
    assert (again.code, again.err) == (0, "")
    assert json.loads(again.out)["runId"] == committed[0]
    fresh = await qinglong("run", "trigger", "--task", task_id, "--stack", str(stack_file))
    duplicates = len(runs_of(stack, task_id)) - 2
    print(f"lost TriggerRun answers 1, retried by request id 1, duplicate Runs {duplicates}")
    assert json.loads(fresh.out)["runId"] != committed[0]
    assert duplicates == 0


async def test_creates_repeat_their_answer_for_the_same_request_id(stack_file: Path) -> None:
    stack_flag = ("--stack", str(stack_file))
    create = ("task", "create", *stack_flag, "--name", "keyed", "--request-id", "create-1")
    first, second = [json.loads((await qinglong(*create, "--", "true")).out) for _ in range(2)]
    assert first == second
    task_id = first["taskId"]
    revise = ("task", "revise", task_id, *stack_flag, "--request-id", "revise-1", "--", "false")
    revised = [json.loads((await qinglong(*revise)).out) for _ in range(2)]
    assert revised[0] == revised[1]
    assert revised[0]["revisionNumber"] == 2
    changed = await qinglong("task", "revise", task_id, *stack_flag, "--request-id", "revise-1",
                             "--", "echo", "other")  # fmt: skip
    assert changed.code == 1
    assert changed.err.startswith("error: ABORTED REPLAY_MISMATCH")


async def test_retry_settings_without_max_attempts_are_refused_not_dropped(
    stack: Stack, stack_file: Path
) -> None:
    refused = await qinglong(
        "task", "create", "--stack", str(stack_file), "--name", "dropped",
        "--retry-on", "failed", "--retry-backoff-ms", "5000", "--", "false",
    )  # fmt: skip
    assert (refused.code, refused.out) == (2, "")
    assert refused.err.startswith("error: --retry-backoff-ms, --retry-on need --max-attempts")
    assert "dropped" not in task_names(stack)
