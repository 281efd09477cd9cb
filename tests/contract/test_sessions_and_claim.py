"""Sessions, placement and claim (SPEC R-CLAIM-1, R-CLAIM-2), and lease expiry (SPEC §7.4)."""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import replace

import psycopg
import pytest
from qinglong_control.db import placement, sessions
from qinglong_control.db.start_facts import acknowledge_starting
from qinglong_control.domain.capability import digest_of_capability
from qinglong_control.domain.claim import ClaimRequest
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.domain.sessions import SessionClaim
from qinglong_control.domain.timings import Timings
from qinglong_protocol.bounds import encode_lease_capability

from tests.support.plans import rows_a_pull_examines
from tests.support.postgres import MigratedDatabase
from tests.support.world import PROJECT, World, enroll, fresh_claim


def new_digest() -> object:
    return digest_of_capability(encode_lease_capability(secrets.token_bytes(32)))


async def test_open_session_is_idempotent_and_a_new_generation_replaces_the_old(
    world: World,
) -> None:
    first = await world.session("worker-a", request_id="boot-1")
    retried = await world.session("worker-a", request_id="boot-1")
    assert retried == first
    second = await world.session("worker-a", request_id="boot-2")
    assert second.worker_generation == first.worker_generation + 1
    with pytest.raises(Refused) as fenced:
        await sessions.renew_session(world.conn, first, world.timings)
    assert fenced.value.reason is Reason.SESSION_FENCED
    renewed = await sessions.renew_session(world.conn, second, world.timings)
    assert renewed.remaining_ms == world.timings.session_ttl_ms
    cursor = await world.conn.execute(
        "SELECT generation, status FROM qinglong.worker_sessions WHERE worker_id = 'worker-a'"
        " ORDER BY generation"
    )
    assert await cursor.fetchall() == [(1, "replaced"), (2, "online")]


async def test_a_retried_open_session_must_ask_the_same_of_a_live_session(
    world: World,
) -> None:
    """A retry with the request id of an earlier OpenSession gets that session only if it
    asks for the same terms and the session is still live and unexpired."""
    asked = sessions.OpenSession("worker-a", "boot-1", ("remote_worker",), 8, "test")
    first = await sessions.open_session(world.conn, asked, world.timings)
    retried = await sessions.open_session(world.conn, asked, world.timings)
    assert (retried.session_id, retried.worker_generation) == (
        first.session_id,
        first.worker_generation,
    )
    for other in (
        replace(asked, max_concurrency=16),
        replace(asked, agent_version="test-2"),
        replace(asked, passes_run_parameters=True),
        replace(asked, labels={"gpu": "a100"}),
    ):
        with pytest.raises(Refused) as mismatch:
            await sessions.open_session(world.conn, other, world.timings)
        assert mismatch.value.reason is Reason.REPLAY_MISMATCH
    await world.conn.execute(
        "UPDATE qinglong.worker_sessions SET expires_at_ms = qinglong.db_now_ms() - 1"
        " WHERE session_id = %s",
        (first.session_id,),
    )
    with pytest.raises(Refused) as expired:
        await sessions.open_session(world.conn, asked, world.timings)
    assert expired.value.reason is Reason.SESSION_EXPIRED
    # A new request id opens the Worker's next session.
    again = await sessions.open_session(
        world.conn, replace(asked, request_id="boot-2"), world.timings
    )
    assert again.worker_generation == first.worker_generation + 1


async def test_unknown_worker_cannot_open_a_session(world: World) -> None:
    with pytest.raises(Refused) as refused:
        await world.session("worker-unknown")
    assert refused.value.reason is Reason.SESSION_FENCED


async def test_pull_gives_stable_offers_and_respects_capacity(world: World) -> None:
    runs = [await world.queued_run() for _ in range(3)]
    session = await world.session("worker-a")
    first = await placement.pull_offers(world.conn, session, 2, world.timings)
    again = await placement.pull_offers(world.conn, session, 2, world.timings)
    assert [o.offer_id for o in first.offers] == [o.offer_id for o in again.offers]
    # Oldest first; Runs queued within one millisecond may tie, so compare as sets.
    assert {o.run_id for o in first.offers} == set(runs[:2])
    # Another worker gets the Run nobody holds, never one already offered.
    other = await world.session("worker-b")
    theirs = await placement.pull_offers(world.conn, other, 8, world.timings)
    assert [o.run_id for o in theirs.offers] == [runs[2]]


async def test_a_run_with_parameters_goes_only_to_a_worker_that_passes_them_on(
    world: World,
) -> None:
    """A Worker of an earlier version does not know Run parameters, and would run such a
    Run without them: its session (which does not say it passes them on) is offered only
    the Runs without any, and the one with parameters waits for a Worker that says so,
    whose offer and claim carry them."""
    given = {"TARGET": "eu"}
    with_parameters = await world.queued_run(parameters=given)
    plain = await world.queued_run()
    older = await world.session("worker-a", passes_parameters=False)
    offered = await placement.pull_offers(world.conn, older, 8, world.timings)
    assert [o.run_id for o in offered.offers] == [plain]
    newer = await world.session("worker-b")
    [offer] = (await placement.pull_offers(world.conn, newer, 8, world.timings)).offers
    assert (offer.run_id, offer.parameters) == (with_parameters, given)
    request, _ = fresh_claim(newer, offer.offer_id, with_parameters)
    claimed = await placement.claim_offer(world.conn, request, world.timings)
    assert claimed.plan.parameters == given


async def test_each_renewal_says_again_whether_the_worker_passes_parameters_on(
    world: World,
) -> None:
    """A restarted Worker resumes its session, whatever version opened it: the renewal of
    an upgraded Worker makes its old session take Runs with parameters, and one of a
    Worker of an earlier version (which says nothing) stops that again."""
    with_parameters = await world.queued_run(parameters={"TARGET": "eu"})
    session = await world.session("worker-a", passes_parameters=False)
    assert (await placement.pull_offers(world.conn, session, 8, world.timings)).offers == []
    await sessions.renew_session(world.conn, session, world.timings, passes_run_parameters=True)
    [offer] = (await placement.pull_offers(world.conn, session, 8, world.timings)).offers
    assert offer.run_id == with_parameters
    await world.conn.execute(
        "UPDATE qinglong.offers SET state = 'withdrawn' WHERE offer_id = %s", (offer.offer_id,)
    )
    await sessions.renew_session(world.conn, session, world.timings)  # an older Worker
    assert (await placement.pull_offers(world.conn, session, 8, world.timings)).offers == []


async def test_a_run_with_a_worker_selector_goes_only_to_a_worker_with_those_labels(
    world: World,
) -> None:
    """Placement offers a Run whose revision has a worker_selector only to a session whose
    labels include every entry of it (more labels are fine; another value is not), and a
    Run without a selector to any session."""
    needs_gpu = await world.queued_run(worker_selector={"gpu": "a100", "zone": "eu"})
    plain = await world.queued_run()
    unlabelled = await world.session("worker-a")
    offered = await placement.pull_offers(world.conn, unlabelled, 8, world.timings)
    assert [o.run_id for o in offered.offers] == [plain]
    for labels in ({"gpu": "t4", "zone": "eu"}, {"gpu": "a100"}, {"GPU": "a100", "zone": "eu"}):
        other = await world.session("worker-b", labels=labels)
        offered = await placement.pull_offers(world.conn, other, 8, world.timings)
        assert offered.offers == [], labels
    matching = await world.session("worker-b", labels={"gpu": "a100", "zone": "eu", "os": "l"})
    [offer] = (await placement.pull_offers(world.conn, matching, 8, world.timings)).offers
    assert offer.run_id == needs_gpu
    request, _ = fresh_claim(matching, offer.offer_id, needs_gpu)
    claimed = await placement.claim_offer(world.conn, request, world.timings)
    assert not claimed.replayed
    assert claimed.lease_version == 1


async def test_a_labelled_worker_is_offered_runs_with_a_selector_on_the_same_conditions(
    world: World,
) -> None:
    """The part of the pull that reads Runs with a selector (a Worker of every project
    with labels) places them on the conditions of every other part: none with a cancel
    intent, none with parameters when the Worker does not pass them on, none with a live
    offer elsewhere."""
    gpu = {"gpu": "a100"}
    offered_elsewhere = await world.queued_run(worker_selector=gpu)
    elsewhere = await world.session("worker-b", labels=gpu)
    [held] = (await placement.pull_offers(world.conn, elsewhere, 8, world.timings)).offers
    assert held.run_id == offered_elsewhere
    cancelled = await world.queued_run(worker_selector=gpu)
    await world.conn.execute(
        "UPDATE qinglong.runs SET cancel_requested_at_ms = qinglong.db_now_ms(),"
        " cancel_reason = 'user' WHERE run_id = %s",
        (cancelled,),
    )
    with_parameters = await world.queued_run(worker_selector=gpu, parameters={"X": "1"})
    placeable = await world.queued_run(worker_selector=gpu)
    session = await world.session("worker-a", labels=gpu, passes_parameters=False)
    offered = await placement.pull_offers(world.conn, session, 8, world.timings)
    assert [o.run_id for o in offered.offers] == [placeable]
    assert with_parameters not in {o.run_id for o in offered.offers}


async def test_each_renewal_sets_the_labels_and_withdraws_offers_they_no_longer_fit(
    world: World,
) -> None:
    """A Worker restarted with other labels resumes its session: its renewal replaces the
    session's labels, placement follows them, and an open offer of a Run the new labels
    no longer qualify for goes back to the pool (its inbox may still hold it); an offer
    they still qualify for stays open."""
    needs_gpu = await world.queued_run(worker_selector={"gpu": "a100"})
    needs_linux = await world.queued_run(worker_selector={"os": "linux"})
    session = await world.session("worker-a", labels={"gpu": "a100", "os": "linux"})
    offered = await placement.pull_offers(world.conn, session, 8, world.timings)
    assert {o.run_id for o in offered.offers} == {needs_gpu, needs_linux}
    await sessions.renew_session(world.conn, session, world.timings, labels={"os": "linux"})
    states = await world.conn.execute(
        "SELECT run_id, state FROM qinglong.offers WHERE session_id = %s",
        (session.session_id,),
    )
    assert dict(await states.fetchall()) == {needs_gpu: "withdrawn", needs_linux: "open"}
    again = await placement.pull_offers(world.conn, session, 8, world.timings)
    assert [o.run_id for o in again.offers] == [needs_linux]
    gpu_offer = next(o for o in offered.offers if o.run_id == needs_gpu)
    request, _ = fresh_claim(session, gpu_offer.offer_id, needs_gpu)
    with pytest.raises(Refused):
        await placement.claim_offer(world.conn, request, world.timings)
    labelled = await world.conn.execute(
        "SELECT labels FROM qinglong.worker_sessions WHERE session_id = %s",
        (session.session_id,),
    )
    assert await labelled.fetchone() == ({"os": "linux"},)
    other = await world.session("worker-b", labels={"gpu": "a100"})
    [taken] = (await placement.pull_offers(world.conn, other, 8, world.timings)).offers
    assert taken.run_id == needs_gpu


async def test_a_worker_without_labels_never_reads_runs_that_need_some(
    world: World, database: MigratedDatabase
) -> None:
    """Runs waiting for a label nobody has cost a Worker without labels nothing: its pull
    reads only the Runs any Worker may take (migration 0036), read from the executed plan.
    A labelled Worker reads both parts of the queue, and takes the oldest Run it may
    across them."""
    for _ in range(12):
        await world.queued_run(worker_selector={"gpu": "nosuch"})
    plain = [await world.queued_run() for _ in range(2)]
    unlabelled = await world.session("worker-a")
    labelled = await world.session("worker-b", labels={"gpu": "a100"})

    def examined(session: SessionClaim) -> int:
        return rows_a_pull_examines(database.urls.runtime, session, 8)

    assert examined(unlabelled) == len(plain)
    assert examined(labelled) == 12 + len(plain)
    older = await world.queued_run(worker_selector={"gpu": "a100"})
    await world.conn.execute(
        "UPDATE qinglong.runs SET created_at_ms = created_at_ms - 60000 WHERE run_id = %s",
        (older,),
    )
    [first] = (await placement.pull_offers(world.conn, labelled, 1, world.timings)).offers
    assert first.run_id == older
    offered = await placement.pull_offers(world.conn, unlabelled, 8, world.timings)
    assert {o.run_id for o in offered.offers} == set(plain)


async def test_each_renewal_sets_the_capacity_the_worker_runs_with_now(world: World) -> None:
    """A Worker restarted with another --max-concurrency resumes its session: placement
    follows the capacity its renewal declares (its open session used to keep the first
    one for as long as it was renewed); a renewal that declares none (a Worker of an
    earlier version) leaves it as it was."""
    queued = [await world.queued_run() for _ in range(12)]
    session = await world.session("worker-a")  # capacity 8
    first = await placement.pull_offers(world.conn, session, 64, world.timings)
    assert len(first.offers) == 8
    await sessions.renew_session(world.conn, session, world.timings, max_concurrency=10)
    grown = await placement.pull_offers(world.conn, session, 64, world.timings)
    assert len(grown.offers) == 10
    await sessions.renew_session(world.conn, session, world.timings)
    same = await placement.pull_offers(world.conn, session, 64, world.timings)
    assert len(same.offers) == 10
    await sessions.renew_session(world.conn, session, world.timings, max_concurrency=2)
    cursor = await world.conn.execute(
        "SELECT max_concurrency FROM qinglong.worker_sessions WHERE session_id = %s",
        (session.session_id,),
    )
    assert await cursor.fetchone() == (2,)
    # Its newest open offers beyond the new capacity went back to the pool.
    fewer = await placement.pull_offers(world.conn, session, 64, world.timings)
    assert [o.offer_id for o in fewer.offers] == [o.offer_id for o in grown.offers[:2]]
    states = await world.conn.execute(
        "SELECT state, count(*) FROM qinglong.offers WHERE session_id = %s GROUP BY state",
        (session.session_id,),
    )
    assert dict(await states.fetchall()) == {"open": 2, "withdrawn": 8}
    other = await world.session("worker-b")
    taken = await placement.pull_offers(world.conn, other, 64, world.timings)
    kept = {o.run_id for o in fewer.offers}
    assert {o.run_id for o in taken.offers} <= set(queued) - kept
    assert len(taken.offers) == 8  # its own capacity: the withdrawn ones were free


async def test_draining_session_gets_no_offers_and_releases_its_own(world: World) -> None:
    run_id = await world.queued_run()
    session = await world.session("worker-a")
    assert (await placement.pull_offers(world.conn, session, 4, world.timings)).offers
    await sessions.drain_session(world.conn, session, world.timings)
    assert (await placement.pull_offers(world.conn, session, 4, world.timings)).offers == []
    other = await world.session("worker-b")
    assert [
        o.run_id for o in (await placement.pull_offers(world.conn, other, 4, world.timings)).offers
    ] == [run_id]


async def test_claim_retry_is_exact_and_another_capability_is_rejected(world: World) -> None:
    run_id = await world.queued_run()
    session = await world.session("worker-a")
    [offer] = (await placement.pull_offers(world.conn, session, 4, world.timings)).offers
    request = ClaimRequest(
        "worker-a",
        session.session_id,
        session.worker_generation,
        offer.offer_id,
        PROJECT,
        run_id,
        new_digest(),  # type: ignore[arg-type]
    )
    first = await placement.claim_offer(world.conn, request, world.timings)
    retried = await placement.claim_offer(world.conn, request, world.timings)
    assert (retried.attempt_id, retried.lease_version, retried.replayed) == (
        first.attempt_id,
        1,
        True,
    )
    with pytest.raises(Refused) as refused:
        await placement.claim_offer(
            world.conn,
            replace(request, token_digest=new_digest()),  # type: ignore[arg-type]
            world.timings,
        )
    assert refused.value.reason is Reason.OFFER_CLAIMED_BY_OTHER_CAPABILITY
    cursor = await world.conn.execute(
        "SELECT r.state, r.attempt_count, count(a.*), l.version, l.status"
        " FROM qinglong.runs r JOIN qinglong.attempts a ON a.run_id = r.run_id"
        " JOIN qinglong.run_leases l ON l.attempt_id = a.attempt_id"
        " WHERE r.run_id = %s GROUP BY r.state, r.attempt_count, l.version, l.status",
        (run_id,),
    )
    assert await cursor.fetchall() == [("dispatching", 1, 1, 1, "leased")]


async def test_lease_expiry_fences_acks_and_leaves_the_run_alone(
    database: MigratedDatabase,
) -> None:
    """SPEC §7.4: an expired lease (by DB time) never changes a Run."""
    enroll(database, "worker-a")
    conn = await psycopg.AsyncConnection.connect(database.urls.runtime, autocommit=True)
    try:
        world = World(conn, Timings(lease_ttl_ms=1_000))
        work = await world.claimed()
        snapshot = await (
            await conn.execute(
                "SELECT r.*, a.* FROM qinglong.runs r JOIN qinglong.attempts a USING (run_id)"
                " WHERE a.attempt_id = %s",
                (work.fence.attempt_id,),
            )
        ).fetchall()
        await asyncio.sleep(1.2)  # the database's clock passes the lease's expiry
        with pytest.raises(Refused) as refused:
            await acknowledge_starting(conn, work.fence)
        assert refused.value.reason is Reason.LEASE_EXPIRED
        after = await (
            await conn.execute(
                "SELECT r.*, a.* FROM qinglong.runs r JOIN qinglong.attempts a USING (run_id)"
                " WHERE a.attempt_id = %s",
                (work.fence.attempt_id,),
            )
        ).fetchall()
        assert after == snapshot
    finally:
        await conn.close()
