"""TaskService.ListTasks end to end through ingress (issue 12, part 4): a project's Tasks
newest first, keyset-paged like ListRuns, and never a Task of another project — not on any
page, not with another project's page token."""

from __future__ import annotations

import asyncio

import grpc
import psycopg
from qinglong.control.v1 import task_pb2, task_service_pb2, task_service_pb2_grpc
from qinglong_control.db.identities import bind_role, ensure_principal, ensure_project
from qinglong_protocol.errors import error_reason_of

from tests.support.calls import failure
from tests.support.stack import PROJECT, Stack, bearer

ts = task_service_pb2
OTHER = "proj-b"


def also_operator_of(stack: Stack, project_id: str) -> None:
    """Alice, operator of PROJECT, becomes operator of a second project as well."""
    with psycopg.connect(stack.database.urls.migration, autocommit=True) as conn:
        ensure_project(conn, project_id, project_id)
        bind_role(conn, project_id, ensure_principal(conn, "user", "alice"), "operator")


async def create_tasks(
    tasks: task_service_pb2_grpc.TaskServiceStub,
    meta: tuple[tuple[str, str], ...],
    project_id: str,
    names: list[str],
) -> list[task_pb2.Task]:
    created = []
    for name in names:
        response = await tasks.CreateTask(
            ts.CreateTaskRequest(project_id=project_id, request_id=name, display_name=name),
            metadata=meta,
        )
        created.append(response.task)
        await asyncio.sleep(0.002)  # distinct creation milliseconds: "newest" is defined
    return created


async def every_page(
    tasks: task_service_pb2_grpc.TaskServiceStub,
    meta: tuple[tuple[str, str], ...],
    project_id: str,
    page_size: int,
) -> list[list[task_pb2.Task]]:
    pages: list[list[task_pb2.Task]] = []
    request = ts.ListTasksRequest(project_id=project_id, page_size=page_size)
    while True:
        page = await tasks.ListTasks(request, metadata=meta)
        pages.append(list(page.tasks))
        if not page.next_page_token:
            return pages
        assert len(pages) <= 10, "paging does not end"
        request.page_token = page.next_page_token


async def test_tasks_page_newest_first_and_stay_in_their_project(stack: Stack) -> None:
    also_operator_of(stack, OTHER)
    meta = bearer(stack, "alice")
    async with stack.channel(stack.operator_identity("ops")) as channel:
        tasks = task_service_pb2_grpc.TaskServiceStub(channel)
        empty = await tasks.ListTasks(ts.ListTasksRequest(project_id=PROJECT), metadata=meta)
        assert (list(empty.tasks), empty.next_page_token) == ([], "")
        # Interleaved: the other project's Tasks sit between this project's in time.
        ours = await create_tasks(tasks, meta, PROJECT, ["a-1", "a-2"])
        theirs = await create_tasks(tasks, meta, OTHER, ["b-1", "b-2"])
        ours += await create_tasks(tasks, meta, PROJECT, ["a-3", "a-4", "a-5"])
        newest_first = ours[::-1]

        pages = await every_page(tasks, meta, PROJECT, page_size=2)
        assert [[t.display_name for t in page] for page in pages] == [
            ["a-5", "a-4"],
            ["a-3", "a-2"],
            ["a-1"],
        ]
        assert [t for page in pages for t in page] == newest_first  # whole Tasks, as created
        # The default page holds them all; a page holding exactly all is the last page:
        # its token is empty (the contract), not one that leads to an empty page.
        assert await every_page(tasks, meta, PROJECT, page_size=0) == [newest_first]
        assert await every_page(tasks, meta, PROJECT, page_size=5) == [newest_first]

        other_pages = await every_page(tasks, meta, OTHER, page_size=1)
        assert [t for page in other_pages for t in page] == theirs[::-1]
        assert all(t.project_id == OTHER for page in other_pages for t in page)

        # A token names a place in time, not a project: the other project's token pages
        # this project's Tasks older than that place, and only this project's.
        first_of_other = await tasks.ListTasks(
            ts.ListTasksRequest(project_id=OTHER, page_size=1), metadata=meta
        )
        assert first_of_other.tasks[0].display_name == "b-2"
        crossed = await tasks.ListTasks(
            ts.ListTasksRequest(project_id=PROJECT, page_token=first_of_other.next_page_token),
            metadata=meta,
        )
        assert [t.display_name for t in crossed.tasks] == ["a-2", "a-1"]

        # A well-formed token no server issued is refused on its field.
        forged = await failure(
            tasks.ListTasks(ts.ListTasksRequest(project_id=PROJECT, page_token="NQ"), metadata=meta)
        )
        assert forged.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_reason_of(forged) == "FIELD_INVALID"


async def test_listing_tasks_needs_read_in_the_project(stack: Stack) -> None:
    async with stack.channel(stack.operator_identity("ops")) as channel:
        tasks = task_service_pb2_grpc.TaskServiceStub(channel)
        [created] = await create_tasks(tasks, bearer(stack, "alice"), PROJECT, ["visible"])
        request = ts.ListTasksRequest(project_id=PROJECT)
        # A viewer reads the list.
        seen = await tasks.ListTasks(request, metadata=bearer(stack, "vera"))
        assert list(seen.tasks) == [created]
        # No role in the project: denied, and nothing reaches control.
        calls = list(stack.control_calls.methods)
        outsider = await failure(tasks.ListTasks(request, metadata=bearer(stack, "mallory")))
        assert outsider.code() == grpc.StatusCode.PERMISSION_DENIED
        # A project the caller has no role in is denied like one that does not exist.
        elsewhere = await failure(
            tasks.ListTasks(ts.ListTasksRequest(project_id=OTHER), metadata=bearer(stack, "vera"))
        )
        assert elsewhere.code() == grpc.StatusCode.PERMISSION_DENIED
        assert stack.control_calls.methods == calls
    operations = {row["operation"] for row in stack.audit_rows()}
    assert "TaskService/ListTasks" in operations
