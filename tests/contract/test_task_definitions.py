"""A task created with its first revision in one transaction, what a trigger of an unknown
task answers, and Events that name the person who caused them."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from qinglong_control.db import definitions, runs
from qinglong_control.db.events import Actor
from qinglong_control.db.identities import ensure_principal
from qinglong_control.domain.refusals import Reason, Refused

from tests.support.postgres import MigratedDatabase
from tests.support.world import OPERATOR, PROJECT, World

PLAN = definitions.RevisionPlan("remote_worker", ["echo", "hi"], 60_000)


def _tasks_created_by(database: MigratedDatabase, request_id: str) -> int:
    with psycopg.connect(database.urls.migration) as conn:
        row = conn.execute(
            "SELECT count(*) FROM qinglong.tasks WHERE create_request_id = %s", (request_id,)
        ).fetchone()
    assert row is not None
    return int(row[0])


async def test_a_task_and_its_first_revision_are_one_create_and_one_replay(
    world: World,
) -> None:
    task = await definitions.create_task(
        world.conn, PROJECT, "t", {}, "create-1", OPERATOR.id, PLAN
    )
    assert task.latest_revision_number == 1
    first = await definitions.get_revision(world.conn, PROJECT, task.task_id, revision_number=1)
    assert (first.command, first.timeout_ms) == (["echo", "hi"], 60_000)
    replayed = await definitions.create_task(
        world.conn, PROJECT, "t", {}, "create-1", OPERATOR.id, PLAN
    )
    assert (replayed.task_id, replayed.latest_revision_number) == (task.task_id, 1)


async def test_a_refused_first_revision_leaves_no_task_behind(
    world: World, database: MigratedDatabase
) -> None:
    # Past the contract (ingress refuses it first): the table's CHECK is the last word.
    out_of_bounds = definitions.RevisionPlan("remote_worker", ["true"], 0)
    with pytest.raises(Refused) as refused:
        await definitions.create_task(
            world.conn, PROJECT, "t", {}, "create-2", OPERATOR.id, out_of_bounds
        )
    assert refused.value.reason is Reason.FIELD_INVALID
    assert _tasks_created_by(database, "create-2") == 0
    # The connection is usable, and the same request id may now succeed.
    task = await definitions.create_task(
        world.conn, PROJECT, "t", {}, "create-2", OPERATOR.id, PLAN
    )
    assert task.latest_revision_number == 1


async def test_a_retry_that_adds_a_plan_to_a_planless_create_is_a_mismatch(
    world: World,
) -> None:
    await definitions.create_task(world.conn, PROJECT, "t", {}, "create-3", OPERATOR.id)
    with pytest.raises(Refused) as refused:
        await definitions.create_task(world.conn, PROJECT, "t", {}, "create-3", OPERATOR.id, PLAN)
    assert refused.value.reason is Reason.REPLAY_MISMATCH


@pytest.mark.parametrize("first_plan", [PLAN, None], ids=["with a plan", "without"])
async def test_a_revision_under_the_tasks_own_request_id_is_a_mismatch(
    world: World, first_plan: definitions.RevisionPlan | None
) -> None:
    """CreateTask's request id names the task and its first revision: CreateTaskRevision
    under it is another request. It used to answer revision 1 unchanged (with a plan), or
    make revision 1 and so turn CreateTask's own retry into a mismatch (without)."""
    task = await definitions.create_task(
        world.conn, PROJECT, "t", {}, "create-8", OPERATOR.id, first_plan
    )
    with pytest.raises(Refused) as refused:
        await definitions.create_revision(
            world.conn, definitions.NewRevision.of(PROJECT, task.task_id, "create-8", PLAN),
            OPERATOR.id,
        )  # fmt: skip
    assert refused.value.reason is Reason.REPLAY_MISMATCH
    again = await definitions.create_task(
        world.conn, PROJECT, "t", {}, "create-8", OPERATOR.id, first_plan
    )
    assert (again.task_id, again.latest_revision_number) == (
        task.task_id,
        task.latest_revision_number,
    )


async def test_a_retry_that_asks_for_something_else_is_a_mismatch(world: World) -> None:
    # AIP-155: a request id names one request; another body under it is refused and
    # changes nothing, where it used to answer with what the first call made.
    task = await definitions.create_task(
        world.conn, PROJECT, "t", {"team": "a"}, "create-6", OPERATOR.id, PLAN
    )
    other_plan = definitions.RevisionPlan("remote_worker", ["deploy", "v2"], 60_000)
    for retry in (
        ("renamed", {"team": "a"}, PLAN),
        ("t", {"team": "b"}, PLAN),
        ("t", {"team": "a"}, other_plan),
        ("t", {"team": "a"}, None),
    ):
        name, labels, plan = retry
        with pytest.raises(Refused) as refused:
            await definitions.create_task(
                world.conn, PROJECT, name, labels, "create-6", OPERATOR.id, plan
            )
        assert refused.value.reason is Reason.REPLAY_MISMATCH, retry

    # A revision's request id, likewise: the same plan replays, another is refused.
    def revision(plan: definitions.RevisionPlan) -> definitions.NewRevision:
        return definitions.NewRevision.of(PROJECT, task.task_id, "revise-1", plan)

    second = await definitions.create_revision(world.conn, revision(other_plan), OPERATOR.id)
    again = await definitions.create_revision(world.conn, revision(other_plan), OPERATOR.id)
    assert (second.revision_number, again.revision_id) == (2, second.revision_id)
    with pytest.raises(Refused) as refused:
        await definitions.create_revision(world.conn, revision(PLAN), OPERATOR.id)
    assert refused.value.reason is Reason.REPLAY_MISMATCH
    # And a trigger's: another task, or another revision than the Run pinned.
    other = await definitions.create_task(
        world.conn, PROJECT, "u", {}, "create-7", OPERATOR.id, PLAN
    )
    run = await runs.trigger_run(
        world.conn, runs.TriggerRun(PROJECT, task.task_id, 1, "trigger-6"), OPERATOR
    )
    for same in (1, None):
        replayed = await runs.trigger_run(
            world.conn, runs.TriggerRun(PROJECT, task.task_id, same, "trigger-6"), OPERATOR
        )
        assert replayed.run_id == run.run_id
    for task_id, number in ((other.task_id, None), (task.task_id, 2)):
        with pytest.raises(Refused) as refused:
            await runs.trigger_run(
                world.conn, runs.TriggerRun(PROJECT, task_id, number, "trigger-6"), OPERATOR
            )
        assert refused.value.reason is Reason.REPLAY_MISMATCH, (task_id, number)
    latest = await definitions.get_task(world.conn, PROJECT, task.task_id)
    assert latest.latest_revision_number == 2


async def test_a_runs_parameters_are_kept_and_part_of_its_trigger(world: World) -> None:
    """Stored as given (read back by GetRun, left out of a listing); a retry of the
    trigger must carry the same ones: other values, fewer or none are REPLAY_MISMATCH."""
    task = await definitions.create_task(world.conn, PROJECT, "p", {}, "create-p", "alice", PLAN)
    given = {"TARGET": "eu=west \u6625", "EMPTY": ""}

    def trigger(parameters: dict[str, str]) -> runs.TriggerRun:
        return runs.TriggerRun(PROJECT, task.task_id, None, "trigger-p", parameters)

    run = await runs.trigger_run(world.conn, trigger(given), OPERATOR)
    assert run.parameters == given
    assert (await runs.get_run(world.conn, PROJECT, run.run_id)).parameters == given
    again = await runs.trigger_run(world.conn, trigger(dict(reversed(given.items()))), OPERATOR)
    assert again.run_id == run.run_id
    for other in ({"TARGET": "us"}, {"TARGET": given["TARGET"]}, {}):
        with pytest.raises(Refused) as refused:
            await runs.trigger_run(world.conn, trigger(other), OPERATOR)
        assert refused.value.reason is Reason.REPLAY_MISMATCH, other
    page = await runs.list_runs(world.conn, PROJECT, limit=10, task_id=task.task_id)
    assert [(listed.run_id, listed.parameters) for listed in page.runs] == [(run.run_id, {})]


async def test_a_worker_selector_is_part_of_the_plan_and_each_run_keeps_its_own(
    world: World,
) -> None:
    """The selector is read back with its revision and compared by a retry like the rest
    of the plan; each Run keeps the selector of the revision it pinned, so a later
    revision with another selector changes no Run already queued."""
    gpu = definitions.RevisionPlan(
        "remote_worker", ["train"], None, worker_selector={"gpu": "a100"}
    )
    task = await definitions.create_task(world.conn, PROJECT, "s", {}, "create-s", "alice", gpu)
    first = await definitions.get_revision(world.conn, PROJECT, task.task_id, revision_number=1)
    assert first.plan == gpu
    assert first.worker_selector == {"gpu": "a100"}
    other = definitions.RevisionPlan("remote_worker", ["train"], None, worker_selector={})
    with pytest.raises(Refused) as refused:
        await definitions.create_task(world.conn, PROJECT, "s", {}, "create-s", "alice", other)
    assert refused.value.reason is Reason.REPLAY_MISMATCH
    queued = await runs.trigger_run(
        world.conn, runs.TriggerRun(PROJECT, task.task_id, None, "trigger-s1"), OPERATOR
    )
    tpu = definitions.RevisionPlan("remote_worker", ["train"], None, worker_selector={"tpu": "v5"})
    await definitions.create_revision(
        world.conn, definitions.NewRevision.of(PROJECT, task.task_id, "revise-s", tpu), "alice"
    )
    later = await runs.trigger_run(
        world.conn, runs.TriggerRun(PROJECT, task.task_id, None, "trigger-s2"), OPERATOR
    )
    kept = await world.conn.execute(
        "SELECT run_id, worker_selector FROM qinglong.runs WHERE run_id IN (%s, %s)",
        (queued.run_id, later.run_id),
    )
    assert dict(await kept.fetchall()) == {
        queued.run_id: {"gpu": "a100"},
        later.run_id: {"tpu": "v5"},
    }


async def test_triggering_an_unknown_task_is_task_not_found(world: World) -> None:
    unknown = runs.TriggerRun(PROJECT, uuid.UUID(int=1), None, "trigger-unknown")
    with pytest.raises(Refused) as refused:
        await runs.trigger_run(world.conn, unknown, OPERATOR)
    assert refused.value.reason is Reason.TASK_NOT_FOUND
    planless = await definitions.create_task(world.conn, PROJECT, "t", {}, "create-4", "alice")
    no_revision = runs.TriggerRun(PROJECT, planless.task_id, None, "trigger-planless")
    with pytest.raises(Refused) as refused:
        await runs.trigger_run(world.conn, no_revision, OPERATOR)
    assert refused.value.reason is Reason.REVISION_NOT_FOUND


async def test_events_name_the_principal_who_caused_them(
    world: World, database: MigratedDatabase
) -> None:
    with psycopg.connect(database.urls.migration, autocommit=True) as admin:
        alice = ensure_principal(admin, "user", "alice")
    task = await definitions.create_task(
        world.conn, PROJECT, "t", {}, "create-5", OPERATOR.id, PLAN
    )
    by_principal = await runs.trigger_run(
        world.conn,
        runs.TriggerRun(PROJECT, task.task_id, None, "trigger-named"),
        Actor("user", str(alice)),
    )
    events, _ = await runs.list_events(
        world.conn, PROJECT, by_principal.run_id, after_sequence=0, limit=10
    )
    assert [(e.actor_id, e.actor_name) for e in events] == [(str(alice), "alice")]
    # An actor id that is not a principal id (the world's bare "alice") has no name.
    by_text = await runs.trigger_run(
        world.conn, runs.TriggerRun(PROJECT, task.task_id, None, "trigger-bare"), OPERATOR
    )
    events, _ = await runs.list_events(
        world.conn, PROJECT, by_text.run_id, after_sequence=0, limit=10
    )
    assert [e.actor_name for e in events] == [None]


async def test_run_pages_end_with_an_empty_token(world: World) -> None:
    # "Token for the next page; empty on the last page", also when the last page is full.
    made = {await world.queued_run() for _ in range(3)}
    whole = await runs.list_runs(world.conn, PROJECT, limit=3)
    assert ({r.run_id for r in whole.runs}, whole.next_cursor) == (made, None)
    first = await runs.list_runs(world.conn, PROJECT, limit=2)
    assert len(first.runs) == 2
    assert first.next_cursor is not None
    rest = await runs.list_runs(world.conn, PROJECT, limit=2, before=first.next_cursor)
    assert (len(rest.runs), rest.next_cursor) == (1, None)
    assert {r.run_id for r in [*first.runs, *rest.runs]} == made
