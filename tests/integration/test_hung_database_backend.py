"""A PostgreSQL backend that stops answering while its kernel still acknowledges (SIGSTOP:
a hung server process, not a dead node) must not hold ingress's audit writer, nor
control's reconcile cycle, for ever.

Ingress runs here with one pooled connection. A Worker's call is one audit statement on it;
the backend behind it is stopped. Without a bound, the batch's writer waits on that
statement for as long as the backend stays stopped and every later call fails; with it,
the writer gives up after the statement bound, the connection is closed, and the next
calls are served on a new connection — while the old backend is still stopped. An
operator's call, whose lookups run on that connection, is answered UNAVAILABLE within
ingress's admission budget, not after psycopg's own cancellation of the statement."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any

import grpc
import psycopg
import pytest
from qinglong.control.v1 import run_service_pb2 as rs
from qinglong.control.v1 import run_service_pb2_grpc, task_service_pb2_grpc
from qinglong.control.v1 import task_service_pb2 as ts
from qinglong.worker.v1 import worker_service_pb2_grpc
from qinglong_control.db.pool import open_runtime_pool
from qinglong_control.reconciler import Reconciler, ReconcilerLimits
from qinglong_protocol.errors import error_info_of
from qinglong_protocol.pooling import PoolSizing
from qinglong_protocol.storage import StorageBounds

from tests.support.postgres import MigratedDatabase
from tests.support.stack import PROJECT, Stack, bearer, running_stack
from tests.support.worker_steps import open_session, queued_run, session_request

BOUNDS = StorageBounds(1.0)
#: The statement bound, then psycopg's cancel (5 s) and its wait for the answer (5 s).
RECOVERY_BOUND_SECONDS = BOUNDS.statement_timeout_ms / 1000 + 10 + 10


@pytest.fixture
async def stack(
    database_pg18: MigratedDatabase, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    async with running_stack(
        database_pg18,
        tmp_path_factory.mktemp("pki"),
        ingress_pool_size=1,
        ingress_storage=BOUNDS,
    ) as running:
        yield running


def backends(database: MigratedDatabase, role: str) -> list[int]:
    with psycopg.connect(database.urls.migration) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE usename = %s AND datname = current_database()",
            (role,),
        ).fetchall()
    return [pid for (pid,) in rows]


@contextlib.contextmanager
def stopped_backend(database: MigratedDatabase, role: str) -> Iterator[int]:
    """The role's one backend, stopped (SIGSTOP: it answers nothing while its kernel still
    acknowledges) until the block ends; its pid."""
    [stopped] = backends(database, role)
    os.kill(stopped, signal.SIGSTOP)
    try:
        yield stopped
    finally:
        os.kill(stopped, signal.SIGCONT)


async def answered_unavailable(call: Awaitable[Any]) -> float:
    """``call`` must fail UNAVAILABLE / STORAGE_UNAVAILABLE; the seconds it took."""
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call
    answered_after = time.monotonic() - started
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE, refused.value.details()
    info = error_info_of(refused.value)
    assert info is not None
    assert info.reason == "STORAGE_UNAVAILABLE"
    return answered_after


async def test_a_stopped_backend_frees_the_audit_writer(stack: Stack) -> None:
    async with stack.channel(stack.worker_identity("worker-a")) as channel:
        worker = worker_service_pb2_grpc.WorkerServiceStub(channel)
        await open_session(worker, "worker-a")
        with stopped_backend(stack.database, "qinglong_ingress") as stopped:
            started = time.monotonic()
            failed: list[str] = []
            while True:
                try:
                    await open_session(worker, "worker-a")
                    break
                except grpc.aio.AioRpcError as error:
                    failed.append(error.code().name)
                elapsed = time.monotonic() - started
                assert elapsed < RECOVERY_BOUND_SECONDS, (
                    f"no call served {elapsed:.0f} s after the backend stopped: {failed}"
                )
            recovered_after = time.monotonic() - started
            async with stack.ingress_pool.connection() as conn:
                serving = conn.info.backend_pid
    print(
        f"stopped ingress backend: {len(failed)} calls failed "
        f"({', '.join(sorted(set(failed)))}), served again after {recovered_after:.1f} s "
        "on a new connection"
    )
    assert failed, "the stopped backend was never met"
    assert set(failed) <= {"UNAVAILABLE", "DEADLINE_EXCEEDED"}
    assert serving != stopped  # the stopped backend's connection was given up


async def test_an_operator_call_is_answered_within_the_admission_budget(stack: Stack) -> None:
    """The token lookup waits on the stopped backend. The caller gets UNAVAILABLE after
    ingress's admission budget (0.9 x the 1 s bound), well inside a 4 s deadline: before,
    it waited for psycopg to cancel the statement (up to 10 s) and got DEADLINE_EXCEEDED,
    which a client cannot tell from a slow answer (R-ERR-2)."""
    async with stack.channel(stack.operator_identity("alice")) as channel:
        tasks = task_service_pb2_grpc.TaskServiceStub(channel)
        request = ts.ListTasksRequest(project_id=PROJECT)
        await tasks.ListTasks(request, metadata=bearer(stack, "alice"), timeout=10)
        with stopped_backend(stack.database, "qinglong_ingress"):
            answered_after = await answered_unavailable(
                tasks.ListTasks(request, metadata=bearer(stack, "alice"), timeout=4)
            )
    print(f"stopped ingress backend: an operator's call answered after {answered_after:.1f} s")


async def test_a_worker_call_is_answered_within_controls_budget(
    database_pg18: MigratedDatabase, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Control's command waits on its stopped backend: ingress forwarded it (its own
    backend answers) and the Worker gets UNAVAILABLE from control after control's bound
    (1 s), well inside a 4 s deadline — not DEADLINE_EXCEEDED after waiting for psycopg to
    cancel the statement (R-ERR-2). The next calls are served once the backend answers."""
    async with (
        running_stack(
            database_pg18,
            tmp_path_factory.mktemp("pki"),
            control_pool_size=1,
            control_storage=BOUNDS,
        ) as stack,
        stack.channel(stack.worker_identity("worker-a")) as channel,
    ):
        worker = worker_service_pb2_grpc.WorkerServiceStub(channel)
        await open_session(worker, "worker-a")
        with stopped_backend(stack.database, "qinglong_runtime"):
            answered_after = await answered_unavailable(
                worker.OpenSession(session_request("worker-a"), timeout=4)
            )
        served = await open_session(worker, "worker-a")
    print(f"stopped control backend: a Worker's call answered after {answered_after:.1f} s")
    assert answered_after < 3.0
    assert served.worker_generation >= 1


async def test_a_slow_operator_command_is_not_cut_at_the_storage_bound(
    database_pg18: MigratedDatabase, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Control's budget leaves a healthy but slow command alone: a cancellation waits on a
    Run another transaction holds for longer than the storage bound (1 s) and is answered
    once the lock is free — an operator's command gets the statement bound (5 s)."""
    async with (
        running_stack(
            database_pg18, tmp_path_factory.mktemp("pki"), control_storage=BOUNDS
        ) as stack,
        stack.channel(stack.operator_identity("ops")) as channel,
    ):
        run_id = await queued_run(stack)
        async with await psycopg.AsyncConnection.connect(stack.database.urls.migration) as held:
            await held.execute(
                "SELECT 1 FROM qinglong.runs WHERE run_id = %s FOR UPDATE", (run_id,)
            )
            cancel = asyncio.ensure_future(
                run_service_pb2_grpc.RunServiceStub(channel).CancelRun(
                    rs.CancelRunRequest(project_id=PROJECT, run_id=run_id, mutation_id="c-1"),
                    metadata=bearer(stack, "alice"),
                    timeout=10,
                )
            )
            await asyncio.sleep(2.5)  # past the storage bound, within the statement bound
            assert not cancel.done()
            await held.rollback()
        answered = await cancel
    assert answered.outcome == rs.CANCEL_RUN_OUTCOME_ACCEPTED


async def test_a_stopped_backend_fails_one_reconcile_cycle_not_all(
    database_pg18: MigratedDatabase,
) -> None:
    pool = await open_runtime_pool(
        database_pg18.urls.runtime, sizing=PoolSizing(1, 1), bounds=BOUNDS
    )
    reconciler = Reconciler(
        pool, ReconcilerLimits(), page_timeout_seconds=BOUNDS.statement_timeout_ms / 1000
    )
    try:
        await reconciler.cycle()
        with stopped_backend(database_pg18, "qinglong_runtime") as stopped:
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                # The outer bound only ends the test: the cycle must end by itself sooner.
                await asyncio.wait_for(reconciler.cycle(), RECOVERY_BOUND_SECONDS + 5)
            failed_after = time.monotonic() - started
            report = await asyncio.wait_for(reconciler.cycle(), RECOVERY_BOUND_SECONDS)
            async with pool.connection() as conn:
                serving = conn.info.backend_pid
    finally:
        await pool.close()
    print(f"stopped runtime backend: one cycle failed after {failed_after:.1f} s, the next ran")
    assert failed_after < RECOVERY_BOUND_SECONDS
    assert report.expired == 0
    assert serving != stopped
