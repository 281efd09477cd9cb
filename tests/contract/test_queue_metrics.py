"""The queue's gauges (docs/observability.md): how many Runs wait in each part of the
queue, and how long the oldest has waited, read from the database."""

from __future__ import annotations

from prometheus_client import REGISTRY
from qinglong_control.queue_metrics import forget_queue, record_queue

from tests.support.world import World


def _gauge(name: str, part: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"part": part})


async def test_the_gauges_count_each_part_of_the_queue_and_its_oldest_wait(
    world: World,
) -> None:
    await record_queue(world.conn)
    assert _gauge("qinglong_control_queued_runs", "any_worker") == 0
    assert _gauge("qinglong_control_oldest_queued_run_age_seconds", "with_selector") == 0
    for _ in range(2):
        await world.queued_run()
    waiting = await world.queued_run(worker_selector={"gpu": "nosuch"})
    # Created two hours ago, queued again ten minutes ago (a retry): it has waited ten.
    await world.conn.execute(
        "UPDATE qinglong.runs SET created_at_ms = created_at_ms - 7200000,"
        " updated_at_ms = updated_at_ms - 600000 WHERE run_id = %s",
        (waiting,),
    )
    cancelled = await world.queued_run(worker_selector={"gpu": "nosuch"})
    await world.conn.execute(
        "UPDATE qinglong.runs SET cancel_requested_at_ms = qinglong.db_now_ms(),"
        " cancel_reason = 'user' WHERE run_id = %s",
        (cancelled,),
    )
    claimed = await world.claimed()  # a Run taken is no longer queued
    assert claimed.fence.attempt_id
    limited = await world.task(max_concurrent_runs=1)
    for _ in range(3):  # one queued (any_worker), two waiting for its slot
        await world.run_of(limited)
    await world.conn.execute(
        "UPDATE qinglong.runs SET created_at_ms = created_at_ms - 300000,"
        " updated_at_ms = updated_at_ms - 300000 WHERE task_id = %s AND state = 'created'",
        (limited,),
    )
    await record_queue(world.conn)
    assert _gauge("qinglong_control_queued_runs", "any_worker") == 3
    assert _gauge("qinglong_control_queued_runs", "with_selector") == 1
    assert _gauge("qinglong_control_queued_runs", "waiting_for_slot") == 2
    slot_wait = _gauge("qinglong_control_oldest_queued_run_age_seconds", "waiting_for_slot")
    assert slot_wait is not None
    assert 300 <= slot_wait < 600
    oldest = _gauge("qinglong_control_oldest_queued_run_age_seconds", "with_selector")
    assert oldest is not None
    assert 600 <= oldest < 900
    newest = _gauge("qinglong_control_oldest_queued_run_age_seconds", "any_worker")
    assert newest is not None
    assert 0 <= newest < 300


async def test_a_failed_sample_leaves_no_stale_value_behind(world: World) -> None:
    """An alert on a growing wait cannot fire on a value a failing sampler froze: after a
    failure the series are absent (an alert on absence can fire) until a sample works."""
    await record_queue(world.conn)
    assert _gauge("qinglong_control_queued_runs", "any_worker") is not None
    forget_queue()
    assert _gauge("qinglong_control_queued_runs", "any_worker") is None
    assert _gauge("qinglong_control_oldest_queued_run_age_seconds", "with_selector") is None
    await record_queue(world.conn)
    assert _gauge("qinglong_control_queued_runs", "with_selector") == 0
