"""Convergence (SPEC R-CONV-*, §7.13) and lease expiry (B-EXP), on rows and Events."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY
from qinglong_control.db.convergence import converge_page, expire_leases
from qinglong_control.db.pool import open_runtime_pool
from qinglong_control.db.start_facts import acknowledge_starting
from qinglong_control.domain.convergence import derived_event_id
from qinglong_control.domain.timings import Timings
from qinglong_control.main import drive
from qinglong_control.reconciler import Reconciler, ReconcilerLimits, ReconcilerStopped
from qinglong_protocol.pooling import PoolSizing

from tests.support.postgres import MigratedDatabase
from tests.support.seed import FAR_FUTURE_MS, NOW_MS, seed_claimed_attempt, seed_identity
from tests.support.world import World, enroll


async def intend(world: World, run_id: uuid.UUID, reason: str = "user") -> None:
    await world.conn.execute(
        "UPDATE qinglong.runs SET cancel_requested_at_ms = qinglong.db_now_ms(),"
        " cancel_reason = %s WHERE run_id = %s",
        (reason, run_id),
    )


async def state_of(world: World, run_id: uuid.UUID) -> tuple[Any, ...]:
    cursor = await world.conn.execute(
        "SELECT r.state, r.error_code, a.state"
        " FROM qinglong.runs r LEFT JOIN qinglong.attempts a ON a.run_id = r.run_id"
        " WHERE r.run_id = %s",
        (run_id,),
    )
    row = await cursor.fetchone()
    assert row is not None
    return row


async def reconciler_events(world: World, run_id: uuid.UUID) -> list[tuple[Any, ...]]:
    cursor = await world.conn.execute(
        "SELECT sequence, event_type, event_id FROM qinglong.run_events"
        " WHERE run_id = %s AND actor_kind = 'reconciler' ORDER BY sequence",
        (run_id,),
    )
    return list(await cursor.fetchall())


async def test_queued_run_with_intent_converges_once_with_a_derived_event(world: World) -> None:
    run_id = await world.queued_run()
    await intend(world, run_id)
    page = await converge_page(world.conn, 128)
    assert (page.candidates, page.converged, page.blocked) == (1, 1, 0)
    assert await state_of(world, run_id) == ("cancelled", "EXECUTION_CANCELLED", None)
    [(sequence, event_type, event_id)] = await reconciler_events(world, run_id)
    assert (sequence, event_type) == (2, "run.cancelled")
    cursor = await world.conn.execute(
        "SELECT cancel_requested_at_ms FROM qinglong.runs WHERE run_id = %s", (run_id,)
    )
    intent_row = await cursor.fetchone()
    assert intent_row is not None
    assert event_id == derived_event_id("qinglong.converge.run", run_id, intent_row[0])
    assert (await converge_page(world.conn, 128)).candidates == 0


async def test_timeout_intent_converges_to_timed_out(world: World) -> None:
    run_id = await world.queued_run()
    await intend(world, run_id, "timeout")
    await converge_page(world.conn, 128)
    assert await state_of(world, run_id) == ("timed_out", "EXECUTION_TIMED_OUT", None)


async def test_queued_run_with_claimed_attempt_converges_attempt_then_run(
    database: MigratedDatabase, world: World
) -> None:
    """A claimed Attempt whose lease is no longer active: two consecutive Events."""
    with psycopg.connect(database.urls.migration, autocommit=True) as admin:
        seed_identity(admin, "proj-q", "worker-q")
    with psycopg.connect(database.urls.runtime, autocommit=True) as runtime:
        seeded = seed_claimed_attempt(runtime, "proj-q", "worker-q", run_state="queued")
    await intend(world, seeded.run_id)
    page = await converge_page(world.conn, 128)
    assert page.converged == 1
    assert await state_of(world, seeded.run_id) == ("cancelled", "EXECUTION_CANCELLED", "cancelled")
    events = await reconciler_events(world, seeded.run_id)
    assert [(s, t) for s, t, _ in events] == [(1, "attempt.cancelled"), (2, "run.cancelled")]
    cursor = await world.conn.execute(
        "SELECT status FROM qinglong.run_leases WHERE attempt_id = %s", (seeded.attempt_id,)
    )
    assert await cursor.fetchone() == ("expired",)


async def test_active_lease_or_started_attempt_is_blocked_never_forged(
    database: MigratedDatabase, world: World
) -> None:
    with psycopg.connect(database.urls.migration, autocommit=True) as admin:
        seed_identity(admin, "proj-q", "worker-q")
    with psycopg.connect(database.urls.runtime, autocommit=True) as runtime:
        active = seed_claimed_attempt(
            runtime, "proj-q", "worker-q", run_state="queued", lease_expires_at_ms=FAR_FUTURE_MS
        )
    await intend(world, active.run_id)
    page = await converge_page(world.conn, 128)
    assert (page.converged, page.blocked) == (0, 1)
    assert await state_of(world, active.run_id) == ("queued", None, "claimed")
    assert await reconciler_events(world, active.run_id) == []


async def test_expiry_skips_a_lease_another_replica_holds_and_expires_the_rest(
    database: MigratedDatabase,
) -> None:
    """Replicas share expiry (R-HA-1): a lease whose rows another transaction holds (a
    replica expiring it, a command on it) is skipped, not waited for, and the next cycle
    decides it; the rest of the page is expired meanwhile."""
    with psycopg.connect(database.urls.migration, autocommit=True) as admin:
        for name in ("e", "f"):
            seed_identity(admin, f"proj-{name}", f"worker-{name}")
    with psycopg.connect(database.urls.runtime, autocommit=True) as runtime:
        held, free = (
            seed_claimed_attempt(
                runtime, f"proj-{name}", f"worker-{name}", lease_expires_at_ms=NOW_MS + 1
            )
            for name in ("e", "f")
        )
    async with (
        await psycopg.AsyncConnection.connect(database.urls.runtime) as other,
        await psycopg.AsyncConnection.connect(database.urls.runtime, autocommit=True) as conn,
    ):
        await other.execute(
            "SELECT 1 FROM qinglong.run_leases WHERE attempt_id = %s FOR UPDATE",
            (held.attempt_id,),
        )
        assert (await asyncio.wait_for(expire_leases(conn, 128), 10)).expired == 1
        states = await conn.execute(
            "SELECT attempt_id, status FROM qinglong.run_leases WHERE attempt_id = ANY(%s)",
            ([held.attempt_id, free.attempt_id],),
        )
        assert dict(await states.fetchall()) == {
            held.attempt_id: "leased",
            free.attempt_id: "expired",
        }
        await other.rollback()
        assert (await expire_leases(conn, 128)).expired == 1


async def test_a_cycle_pages_on_past_leases_another_replica_holds(
    database: MigratedDatabase, runtime_pool: Any
) -> None:
    """Replicas list the same oldest expired leases and each expires those the others have
    not taken: a page a replica only partly expired itself is still a full page, and its
    cycle goes on to the next (R-HA-1). Here the oldest lease is held by another
    transaction (another replica's, or a command's) all cycle long."""
    with psycopg.connect(database.urls.migration, autocommit=True) as admin:
        for i in range(10):
            seed_identity(admin, f"proj-p{i}", f"worker-p{i}")
    with psycopg.connect(database.urls.runtime, autocommit=True) as runtime:
        leases = [
            seed_claimed_attempt(
                runtime, f"proj-p{i}", f"worker-p{i}", lease_expires_at_ms=NOW_MS + i
            ).attempt_id
            for i in range(10)
        ]
    async with await psycopg.AsyncConnection.connect(database.urls.runtime) as other:
        await other.execute(
            "SELECT 1 FROM qinglong.run_leases WHERE attempt_id = %s FOR UPDATE", (leases[0],)
        )
        reconciler = Reconciler(runtime_pool, ReconcilerLimits(page_size=4, max_pages=64))
        report = await asyncio.wait_for(reconciler.cycle(), 30)
        assert report.expired == 9  # three pages of three, then the held one alone
        states = await other.execute(
            "SELECT count(*) FILTER (WHERE status = 'leased') FROM qinglong.run_leases"
            " WHERE attempt_id = ANY(%s)",
            (leases,),
        )
        assert await states.fetchone() == (1,)
        await other.rollback()
    assert (await reconciler.cycle()).expired == 1


async def test_expiry_makes_the_attempt_and_run_lost_then_convergence_ends_the_run(
    database: MigratedDatabase,
) -> None:
    enroll(database, "worker-a")
    conn = await psycopg.AsyncConnection.connect(database.urls.runtime, autocommit=True)
    try:
        world = World(conn, Timings(lease_ttl_ms=1_000))
        work = await world.claimed()
        await acknowledge_starting(conn, work.fence)
        await asyncio.sleep(1.2)
        assert (await expire_leases(conn, 128)).expired == 1
        assert await state_of(world, work.fence.run_id) == ("lost", None, "lost")
        assert [t for _, t, _ in await reconciler_events(world, work.fence.run_id)] == [
            "attempt.lost",
            "run.lost",
        ]
        assert (await expire_leases(conn, 128)).expired == 0  # nothing twice
        # lost is not terminal: a cancel intent now converges it, with only the Run Event.
        await intend(world, work.fence.run_id)
        await converge_page(conn, 128)
        assert await state_of(world, work.fence.run_id) == (
            "cancelled",
            "EXECUTION_CANCELLED",
            "lost",
        )
    finally:
        await conn.close()


@pytest.fixture
async def runtime_pool(database: MigratedDatabase) -> AsyncIterator[Any]:
    pool = await open_runtime_pool(database.urls.runtime, sizing=PoolSizing(1, 4))
    try:
        yield pool
    finally:
        await pool.close()


async def test_cycles_are_paged_and_coalesced(world: World, runtime_pool: Any) -> None:
    runs = [await world.queued_run() for _ in range(5)]
    for run_id in runs:
        await intend(world, run_id)
    reconciler = Reconciler(runtime_pool, ReconcilerLimits(page_size=2, max_pages=2))
    first, joined = await asyncio.gather(reconciler.cycle(), reconciler.cycle())
    assert first is joined  # the second caller waited for the same cycle
    assert (first.converged, first.pages) == (4, 2)
    second = await reconciler.cycle()
    assert second.converged == 1


async def test_a_stopped_reconciler_ends_its_cycle_and_starts_no_other(
    world: World, runtime_pool: Any
) -> None:
    """Stop (§7.13): the service's cadence is cancelled while a cycle runs; the cycle
    (shielded from its caller) is let finish before the pools close, and none starts
    after it."""
    runs = [await world.queued_run() for _ in range(6)]
    for run_id in runs:
        await intend(world, run_id)
    reconciler = Reconciler(runtime_pool, ReconcilerLimits(page_size=1, max_pages=64))
    cadence = asyncio.create_task(drive(reconciler, 0.001))
    deadline = asyncio.get_running_loop().time() + 30.0  # liveness, however loaded the machine
    while reconciler._running is None:
        assert asyncio.get_running_loop().time() < deadline, "no cycle started"
        await asyncio.sleep(0.001)
    running = reconciler._running
    cadence.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await cadence
    assert await reconciler.stop(30.0), "the cycle in flight did not finish"
    assert running.done()
    assert not running.cancelled()
    ended = [await state_of(world, run_id) for run_id in runs]
    await asyncio.sleep(0.1)
    assert [await state_of(world, run_id) for run_id in runs] == ended, "work after stop"
    with pytest.raises(ReconcilerStopped):
        await reconciler.cycle()


async def test_a_cycle_that_does_not_end_within_the_grace_is_cancelled(
    world: World, runtime_pool: Any, database: MigratedDatabase
) -> None:
    """Shutdown is bounded: a cycle stuck behind a lock is cancelled once the grace is
    spent, and stop() returns within it plus the short unwinding allowance."""
    reconciler = Reconciler(runtime_pool, ReconcilerLimits())
    async with await psycopg.AsyncConnection.connect(database.urls.migration) as blocker:
        await blocker.execute("LOCK TABLE qinglong.run_leases IN ACCESS EXCLUSIVE MODE")
        cycle = asyncio.ensure_future(reconciler.cycle())
        await asyncio.sleep(0.2)
        assert not cycle.done(), "the cycle waits behind the lock"
        started = asyncio.get_running_loop().time()
        assert not await reconciler.stop(0.5)
        took = asyncio.get_running_loop().time() - started
        await blocker.rollback()
    assert took < 3.0, took
    with pytest.raises(asyncio.CancelledError):
        await cycle


async def test_replicas_share_candidates_without_double_work(
    world: World, database: MigratedDatabase
) -> None:
    runs = [await world.queued_run() for _ in range(12)]
    for run_id in runs:
        await intend(world, run_id)
    replicas = [
        await psycopg.AsyncConnection.connect(database.urls.runtime, autocommit=True)
        for _ in range(3)
    ]
    try:
        pages = await asyncio.gather(*(converge_page(conn, 5) for conn in replicas))
        while sum(p.converged for p in pages) < 12:
            pages += [await converge_page(replicas[0], 5)]
    finally:
        for conn in replicas:
            await conn.close()
    assert sum(p.converged for p in pages) == 12
    for run_id in runs:
        assert len(await reconciler_events(world, run_id)) == 1


def step_failures(step: str) -> float:
    sampled = REGISTRY.get_sample_value(
        "qinglong_control_reconcile_step_failures_total", {"step": step}
    )
    return sampled or 0.0


async def test_a_step_that_fails_on_its_own_does_not_stop_the_cycle(
    world: World, database: MigratedDatabase, runtime_pool: Any
) -> None:
    """A step failing for a reason of its own (here a real one: a privilege the disabled-
    project sweep needs is gone) is counted, and the steps after it still run; it is no
    outage, which would end the cycle (test_hung_database_backend.py)."""
    run_id = await world.queued_run()
    await intend(world, run_id)
    with psycopg.connect(database.urls.migration, autocommit=True) as owner:
        owner.execute("REVOKE SELECT ON qinglong.projects FROM qinglong_runtime")
    before = step_failures("stop_disabled")
    report = await Reconciler(runtime_pool, ReconcilerLimits()).cycle()
    assert step_failures("stop_disabled") == before + 1
    assert report.converged == 1  # convergence runs after the failed sweep
    assert (await state_of(world, run_id))[0] == "cancelled"
