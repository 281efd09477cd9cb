"""A retry is answered only once what it confirms would survive a promotion (R-HA-2).

A command that outlasts control's storage budget is cancelled and its caller answered
UNAVAILABLE. If the cancel lands while its COMMIT waits for the synchronous standby,
PostgreSQL ends the wait with a warning and keeps the transaction — on the primary only.
The caller retries (same request id): the retry finds the first call's rows and, writing
nothing itself, used to commit and answer at once. A promotion then lost what the caller
had just been told was done (found by review: a TriggerRun answered, the Run gone on the
promoted standby).

Here, with the real repository functions on the services' own pools and a real
synchronous standby: the standby stops; each command's first call outlasts its budget
(its rows are visible on the primary: the hazard is set up); its retry, which writes
nothing, must get no answer either while the standby is down (without the barrier, four
of these five retries were answered); once the standby is back the retry answers with
the first call's result, and a promotion then finds it there (a check of the setup more
than of the fix: by then the standby has caught up). The commands: TriggerRun,
CreateTask and OpenSession (runtime role), CreateProject and a repeated RevokeRole (admin
role), the last a change already made rather than a replay.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final, LiteralString

import psycopg
from qinglong_control.db import admin, definitions, runs, sessions
from qinglong_control.db.identities import enroll_worker, ensure_project
from qinglong_control.db.pool import open_admin_pool, open_runtime_pool
from qinglong_control.domain.timings import Timings
from qinglong_protocol.budget import settle_within
from qinglong_protocol.pooling import RecoveringPool
from qinglong_protocol.storage import StorageBounds

from tests.support.postgres_control import PostgresControl
from tests.support.standby_pair import Pair
from tests.support.world import OPERATOR, PROJECT, World

#: Each call's budget, as control's error interceptor gives a command (short: the first
#: call of each command must outlast it while the standby is down).
BUDGET_SECONDS: Final = 1.0
WORKER: Final = "worker-durable"
#: How long an abandoned call's cancel may take to end its COMMIT's wait (psycopg sends
#: it as the call is abandoned; libpq's cancel is a new connection).
CANCEL_SECONDS: Final = 10.0


@dataclass(frozen=True)
class Command:
    name: str
    pool: RecoveringPool
    call: Callable[[psycopg.AsyncConnection[Any]], Awaitable[object]]
    #: SQL (migration role) counting the rows the first call wrote (1 once it did), and
    #: its parameters.
    written: tuple[LiteralString, tuple[object, ...]]


async def _answer(command: Command) -> object:
    async def once() -> object:
        async with command.pool.connection() as conn:
            return await command.call(conn)

    return await settle_within(BUDGET_SECONDS, once())


async def _unanswered(command: Command) -> bool:
    try:
        await _answer(command)
    except TimeoutError:
        return True
    return False


def _count(url: str, query: tuple[LiteralString, tuple[object, ...]]) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(*query).fetchone()
    assert row is not None
    return int(row[0])


async def _written_soon(url: str, query: tuple[LiteralString, tuple[object, ...]]) -> int:
    deadline = time.monotonic() + CANCEL_SECONDS
    while time.monotonic() < deadline:
        if written := _count(url, query):
            return written
        await asyncio.sleep(0.1)
    return _count(url, query)


async def test_a_retry_is_answered_only_once_the_first_write_is_on_the_standby(
    pair: Pair,
) -> None:
    with psycopg.connect(pair.urls.migration, autocommit=True) as owner:
        ensure_project(owner, PROJECT, PROJECT)
        enroll_worker(owner, WORKER, f"spiffe://qinglong.local/worker/{WORKER}")
    bounds = StorageBounds(BUDGET_SECONDS)
    runtime = await open_runtime_pool(pair.urls.runtime, bounds=bounds)
    admins = await open_admin_pool(pair.urls.admin, bounds=bounds)
    try:
        async with runtime.connection() as conn:
            task_id = await World(conn).task()
        async with admins.connection() as conn:
            member = await admin.create_principal(conn, "p-1", "user", "mia", cluster_admin=False)
            await admin.grant_role(conn, PROJECT, member.principal_id, "viewer")
        commands = (
            Command(
                "TriggerRun",
                runtime,
                lambda c: runs.trigger_run(
                    c, runs.TriggerRun(PROJECT, task_id, None, "durable-trigger"), OPERATOR
                ),
                (
                    "SELECT count(*) FROM qinglong.runs WHERE trigger_request_id = %s",
                    ("durable-trigger",),
                ),
            ),
            Command(
                "CreateTask",
                runtime,
                lambda c: definitions.create_task(
                    c, PROJECT, "durable", {}, "durable-task", OPERATOR.id
                ),
                (
                    "SELECT count(*) FROM qinglong.tasks WHERE create_request_id = %s",
                    ("durable-task",),
                ),
            ),
            Command(
                "OpenSession",
                runtime,
                lambda c: sessions.open_session(
                    c,
                    sessions.OpenSession(WORKER, "durable-open", ("remote_worker",), 4, "test"),
                    Timings(),
                ),
                (
                    "SELECT count(*) FROM qinglong.worker_sessions WHERE open_request_id = %s",
                    ("durable-open",),
                ),
            ),
            Command(
                "CreateProject",
                admins,
                lambda c: admin.create_project(c, "durable-project", "proj-durable", "D"),
                ("SELECT count(*) FROM qinglong.projects WHERE project_id = %s", ("proj-durable",)),
            ),
            Command(
                "RevokeRole",
                admins,
                lambda c: admin.revoke_role(c, PROJECT, member.principal_id),
                (
                    "SELECT count(*) FROM qinglong.role_bindings"
                    " WHERE principal_id = %s AND status = 'revoked'",
                    (member.principal_id,),
                ),
            ),
        )
        standby = PostgresControl.attach(pair.standby.data_dir)
        standby.stop()
        tally: dict[str, list[str]] = {}
        for command in commands:
            assert await _unanswered(command), f"{command.name} answered with no standby"
            # The hazard: the first call's COMMIT was cancelled in its wait for the
            # standby (once the abandoned call's cancel reached it), and PostgreSQL kept
            # it on the primary.
            written = await _written_soon(pair.urls.migration, command.written)
            retry_unanswered = await _unanswered(command)
            tally[command.name] = [
                f"first call written on the primary alone: {written}",
                f"retry answered with no standby: {not retry_unanswered}",
            ]
        standby.start()
        answers = {command.name: await _answer(command) for command in commands}
    finally:
        await runtime.close()
        await admins.close()
    # Every answer given is on the standby: promote it and look.
    PostgresControl.attach(pair.primary.data_dir).stop()
    standby.promote()
    promoted = standby.url("qinglong_migration", "qinglong")
    for command in commands:
        tally[command.name].append(f"on the promoted standby: {_count(promoted, command.written)}")
    print()
    for name, lines in tally.items():
        print(f"{name:13} " + "; ".join(lines))
    assert all(lines[0].endswith(": 1") for lines in tally.values()), tally
    assert all(lines[1].endswith(": False") for lines in tally.values()), tally
    assert all(lines[2].endswith(": 1") for lines in tally.values()), tally
    # The Run the retry answered is the one the first call made, and it survived.
    trigger = answers["TriggerRun"]
    assert isinstance(trigger, runs.RunView)
    survived = ("SELECT count(*) FROM qinglong.runs WHERE run_id = %s", (trigger.run_id,))
    assert _count(promoted, survived) == 1
