"""Races around the start facts, on separate connections (SPEC §7.3, §7.6; issue 3).

The real lease-control and cancel commands race the start facts at the end of this file.
The tests before them hold a renewal's or an intent's transaction open at a chosen point,
which a command's own transaction cannot be made to do: they write those durable facts as
the runtime role, in one transaction each, the way the commands do, and say so.
"""

from __future__ import annotations

import asyncio
import secrets
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import psycopg
import pytest
from qinglong_control.db import placement, runs, sessions
from qinglong_control.db.cancellation import CancelRequest, cancel_run
from qinglong_control.db.events import Actor
from qinglong_control.db.identities import bind_role, enroll_operator_token
from qinglong_control.db.lease_control import control_lease
from qinglong_control.db.start_facts import (
    acknowledge_running,
    acknowledge_starting,
    report_start_failure,
)
from qinglong_control.domain.cancellation import BindingSnapshot, CancelOutcome
from qinglong_control.domain.capability import digest_of_capability, parse_digest
from qinglong_control.domain.claim import ClaimRequest
from qinglong_control.domain.lease_control import LeaseAnswer
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.domain.retry import Ending, RetryPolicy
from qinglong_control.domain.sessions import SessionClaim
from qinglong_control.domain.start_facts import (
    RunningDecision,
    RunningOutcome,
    RunningReport,
    StartFailureDecision,
    StartingDecision,
    StartingOutcome,
)
from qinglong_protocol.bounds import encode_lease_capability

from tests.support.postgres import MigratedDatabase
from tests.support.seed import digest
from tests.support.world import OPERATOR, PROJECT, ClaimedWork, World, enroll, with_version

REPORT = RunningReport("pid:4242;start:1700000000", "log-1", 7, parse_digest("ab" * 32))

# Terminal mapping of a start failure by the Run's cancellation fact (R-FAIL-1).
TERMINAL = {
    None: ("failed", "EXECUTOR_START_FAILED"),
    "user": ("cancelled", "EXECUTION_CANCELLED"),
    "timeout": ("timed_out", "EXECUTION_TIMED_OUT"),
}

Conn = psycopg.AsyncConnection[Any]
Answer = TypeVar("Answer")

PULL_ROUNDS = 3


@pytest.fixture
async def connect(database: MigratedDatabase) -> AsyncIterator[Any]:
    """Opens extra runtime-role connections and closes them after the test."""
    opened: list[Conn] = []

    async def open_connections(count: int) -> list[Conn]:
        conns = await asyncio.gather(
            *(
                psycopg.AsyncConnection.connect(database.urls.runtime, autocommit=True)
                for _ in range(count)
            )
        )
        opened.extend(conns)
        return list(conns)

    yield open_connections
    await asyncio.gather(*(conn.close() for conn in opened))


async def wait_until_blocked(observer: Conn, blocked: Conn) -> None:
    """Until `blocked`'s backend waits for a lock another transaction holds."""
    pid = blocked.info.backend_pid
    deadline = asyncio.get_running_loop().time() + 30.0  # liveness, however loaded the machine
    while True:
        cursor = await observer.execute("SELECT cardinality(pg_blocking_pids(%s))", (pid,))
        row = await cursor.fetchone()
        if row is not None and row[0] > 0:
            return
        assert asyncio.get_running_loop().time() < deadline, "the command never waited"
        await asyncio.sleep(0.01)


async def renew(conn: Conn, work: ClaimedWork) -> int:
    """A lease renewal's writes, in a transaction the caller may hold open.

    Written as the runtime role in one transaction, as a renewal will: the Attempt's
    advisory lock first (R-ACK-3, so it serialises with every ACK), then the lease version
    and the Attempt's projection of it advance together (R-ACK-7: only renewal does this).
    """
    await conn.execute(
        "SELECT pg_advisory_xact_lock(hashtextextended('qinglong.attempt:' || %s, 0))",
        (str(work.fence.attempt_id),),
    )
    cursor = await conn.execute(
        "UPDATE qinglong.run_leases SET version = version + 1,"
        " renewed_at_ms = qinglong.db_now_ms(), expires_at_ms = qinglong.db_now_ms() + 30000"
        " WHERE attempt_id = %s AND status = 'leased' RETURNING version",
        (work.fence.attempt_id,),
    )
    row = await cursor.fetchone()
    assert row is not None
    await conn.execute(
        "UPDATE qinglong.attempts SET lease_version = %s WHERE attempt_id = %s",
        (row[0], work.fence.attempt_id),
    )
    return int(row[0])


async def renewed(conn: Conn, work: ClaimedWork) -> int:
    async with conn.transaction():
        return await renew(conn, work)


async def request_cancel(conn: Conn, work: ClaimedWork, reason: str) -> bool:
    """A cancellation's or a timeout's durable intent, in a transaction the caller may hold
    open.

    Written as the runtime role, the way a cancel command records its durable fact: only
    on a Run that is not terminal. Returns whether the intent was recorded.
    """
    cursor = await conn.execute(
        "UPDATE qinglong.runs SET cancel_requested_at_ms = qinglong.db_now_ms(),"
        " cancel_reason = %s, cancel_requested_by = %s"
        " WHERE run_id = %s AND cancel_requested_at_ms IS NULL"
        "   AND state NOT IN ('succeeded', 'failed', 'cancelled', 'timed_out')"
        " RETURNING run_id",
        (reason, OPERATOR.id, work.fence.run_id),
    )
    return await cursor.fetchone() is not None


async def outcome(conn: Conn, work: ClaimedWork) -> dict[str, Any]:
    cursor = await conn.execute(
        "SELECT r.state, r.error_code, r.cancel_reason, a.state, a.error_code, a.lease_version,"
        "       l.status, l.version,"
        "       (SELECT array_agg(event_type ORDER BY sequence) FROM qinglong.run_events e"
        "         WHERE e.run_id = r.run_id)"
        "  FROM qinglong.runs r JOIN qinglong.attempts a ON a.run_id = r.run_id"
        "  JOIN qinglong.run_leases l ON l.attempt_id = a.attempt_id WHERE a.attempt_id = %s",
        (work.fence.attempt_id,),
    )
    row = await cursor.fetchone()
    assert row is not None
    keys = (
        "run_state",
        "run_error",
        "cancel_reason",
        "attempt_state",
        "attempt_error",
        "attempt_lease_version",
        "lease_status",
        "lease_version",
        "events",
    )
    return dict(zip(keys, row, strict=True))


def assert_terminal(facts: dict[str, Any], cancel_reason: str | None, lease_version: int) -> None:
    """Attempt and Run agree on the terminal state the cancellation fact selects."""
    state, code = TERMINAL[cancel_reason]
    assert (facts["run_state"], facts["run_error"]) == (state, code)
    assert (facts["attempt_state"], facts["attempt_error"]) == (state, code)
    assert (facts["lease_status"], facts["lease_version"]) == ("completed", lease_version)
    assert facts["attempt_lease_version"] == lease_version
    assert facts["events"][-2:] == [f"attempt.{state}", f"run.{state}"]
    assert sum(event.split(".")[1] == state for event in facts["events"]) == 2


# --- SPEC §7.3: renewal fences the old expected version ---------------------------------


async def test_after_renewal_old_version_is_fenced_and_newest_proceeds(world: World) -> None:
    """SPEC §7.3, through all three start facts."""
    work = await world.claimed()
    v1 = work.fence
    v2 = with_version(v1, await renewed(world.conn, work))
    assert v2.expected_lease_version == 2
    before = await outcome(world.conn, work)
    with pytest.raises(Refused) as refused:
        await acknowledge_starting(world.conn, v1)
    assert refused.value.reason is Reason.LEASE_VERSION_FENCED
    assert await outcome(world.conn, work) == before
    assert (await acknowledge_starting(world.conn, v2)).outcome is StartingOutcome.STARTING

    v3 = with_version(v1, await renewed(world.conn, work))
    with pytest.raises(Refused) as refused:
        await acknowledge_running(world.conn, v2, REPORT)
    assert refused.value.reason is Reason.LEASE_VERSION_FENCED
    assert (await outcome(world.conn, work))["attempt_state"] == "starting"
    assert (await acknowledge_running(world.conn, v3, REPORT)).outcome is RunningOutcome.RUNNING
    facts = await outcome(world.conn, work)
    # The ACKs moved neither the lease nor its projection (R-ACK-7).
    assert (facts["lease_version"], facts["attempt_lease_version"]) == (3, 3)


async def test_after_renewal_start_failure_needs_the_newest_version(world: World) -> None:
    """SPEC §7.3 for start-failure, and its lost-response replay at the renewed version."""
    work = await world.claimed()
    await acknowledge_starting(world.conn, work.fence)
    v2 = with_version(work.fence, await renewed(world.conn, work))
    with pytest.raises(Refused) as refused:
        await report_start_failure(world.conn, work.fence, "boom")
    assert refused.value.reason is Reason.LEASE_VERSION_FENCED
    assert (await outcome(world.conn, work))["lease_status"] == "leased"
    decision = await report_start_failure(world.conn, v2, "boom")
    assert decision.completed_lease_version == 3
    assert_terminal(await outcome(world.conn, work), None, 3)
    assert (await report_start_failure(world.conn, v2, "boom")).replayed
    with pytest.raises(Refused) as refused:  # completed 3 != 1 + 1
        await report_start_failure(world.conn, work.fence, "boom")
    assert refused.value.reason is Reason.REPLAY_MISMATCH


async def test_ack_waiting_behind_an_in_flight_renewal_is_fenced(
    world: World, connect: Any
) -> None:
    """SPEC §7.3 as a race: the ACK queued behind the renewal sees the new version."""
    renewer, observer = await connect(2)
    work = await world.claimed()
    async with renewer.transaction():
        assert await renew(renewer, work) == 2
        ack = asyncio.create_task(acknowledge_starting(world.conn, work.fence))
        await wait_until_blocked(observer, world.conn)
    with pytest.raises(Refused) as refused:
        await ack
    assert refused.value.reason is Reason.LEASE_VERSION_FENCED
    assert (await outcome(world.conn, work))["attempt_state"] == "claimed"
    decision = await acknowledge_starting(world.conn, with_version(work.fence, 2))
    assert decision.outcome is StartingOutcome.STARTING


# --- SPEC §7.6: cancellation and timeout racing a start failure --------------------------


@pytest.mark.parametrize("reason", ["user", "timeout"])
async def test_intent_recorded_before_start_failure_selects_the_terminal_state(
    world: World, reason: str
) -> None:
    work = await world.claimed()
    await acknowledge_starting(world.conn, work.fence)
    assert await request_cancel(world.conn, work, reason)
    decision = await report_start_failure(world.conn, work.fence, "exec: no such file")
    state, code = TERMINAL[reason]
    assert (decision.run_state.value, decision.attempt_state.value) == (state, state)
    assert decision.error_code == code
    assert_terminal(await outcome(world.conn, work), reason, 2)
    replay = await report_start_failure(world.conn, work.fence, "exec: no such file")
    assert replay.replayed
    assert replay.error_code == code


@pytest.mark.parametrize(("gap_ms", "replayed"), [(0, True), (1, False)])
async def test_a_start_failure_replay_after_an_intent_of_the_same_millisecond(
    world: World, gap_ms: int, replayed: bool
) -> None:
    """The start failure commits (the Run waits for a retry); a cancel that waited on the
    Run's lock records its intent in the same millisecond of DB time; the answer was lost
    and the Worker sends the report again. Which came first cannot be read from the
    times, and the stored ending is one the report could have had: it is a replay. An
    intent a millisecond before the commit would have made it `cancelled`: a `failed`
    Attempt does not match it."""
    retrying = RetryPolicy(max_attempts=2, retry_on=frozenset({Ending.START_FAILED}))
    work = await world.claimed(retry_policy=retrying)
    await acknowledge_starting(world.conn, work.fence)
    decision = await report_start_failure(world.conn, work.fence, "exec: no such file")
    assert decision.run_state.value == "retry_wait"
    await world.conn.execute(
        "UPDATE qinglong.runs SET cancel_reason = 'user', cancel_requested_by = %s,"
        " cancel_requested_at_ms = (SELECT finished_at_ms - %s FROM qinglong.attempts"
        "                            WHERE attempt_id = %s)"
        " WHERE run_id = %s",
        (OPERATOR.id, gap_ms, work.fence.attempt_id, work.fence.run_id),
    )
    if replayed:
        replay = await report_start_failure(world.conn, work.fence, "exec: no such file")
        assert replay.replayed
        assert (replay.attempt_state.value, replay.error_code) == TERMINAL[None]
    else:
        with pytest.raises(Refused) as refused:
            await report_start_failure(world.conn, work.fence, "exec: no such file")
        assert refused.value.reason is Reason.REPLAY_MISMATCH


@pytest.mark.parametrize("reason", ["user", "timeout"])
async def test_intent_committed_while_start_failure_waits_wins(
    world: World, connect: Any, reason: str
) -> None:
    """The start failure queues behind the intent's Run lock and then honours it."""
    canceller, observer = await connect(2)
    work = await world.claimed()
    await acknowledge_starting(world.conn, work.fence)
    async with canceller.transaction():
        assert await request_cancel(canceller, work, reason)
        failure = asyncio.create_task(report_start_failure(world.conn, work.fence, "boom"))
        await wait_until_blocked(observer, world.conn)
    decision = await failure
    assert decision.error_code == TERMINAL[reason][1]
    assert_terminal(await outcome(world.conn, work), reason, 2)


@pytest.mark.parametrize("reason", ["user", "timeout"])
async def test_start_failure_committed_first_keeps_failed(
    world: World, connect: Any, reason: str
) -> None:
    """An intent arriving after the terminal commit changes nothing, even by raw SQL."""
    (raw,) = await connect(1)
    work = await world.claimed()
    await acknowledge_starting(world.conn, work.fence)
    await report_start_failure(world.conn, work.fence, "boom")
    assert not await request_cancel(world.conn, work, reason)
    with pytest.raises(psycopg.errors.CheckViolation):
        await raw.execute(
            "UPDATE qinglong.runs SET cancel_requested_at_ms = 1, cancel_reason = %s"
            " WHERE run_id = %s",
            (reason, work.fence.run_id),
        )
    assert_terminal(await outcome(world.conn, work), None, 2)


async def raced_with_a_start_failure(
    world: World, intent: Callable[[ClaimedWork], Awaitable[Answer]], first: int
) -> tuple[ClaimedWork, Answer, StartFailureDecision]:
    """A fresh `starting` Attempt whose start failure races ``intent`` on another
    connection; the one handed to gather first alternates with ``first`` (0 or 1). The
    work, what ``intent`` answered, and the start failure's decision."""
    work = await world.claimed()
    await acknowledge_starting(world.conn, work.fence)
    asked = intent(work)
    failure = report_start_failure(world.conn, work.fence, "boom")
    if first:
        answered, decision = await asyncio.gather(asked, failure)
    else:
        decision, answered = await asyncio.gather(failure, asked)
    return work, answered, decision


@pytest.mark.parametrize("reason", ["user", "timeout"])
async def test_intent_racing_start_failure_never_mixes_outcomes(
    world: World, connect: Any, reason: str
) -> None:
    """Whoever wins, Attempt, Run, Events and Lease tell one story, many times over."""
    (canceller,) = await connect(1)
    seen: Counter[str] = Counter()
    for iteration in range(10):
        work, recorded, decision = await raced_with_a_start_failure(
            world, lambda work: request_cancel(canceller, work, reason), first=iteration % 2
        )
        facts = await outcome(world.conn, work)
        # The intent counts if and only if it committed before the start failure.
        winner = reason if recorded else None
        assert facts["cancel_reason"] == winner
        assert decision.error_code == TERMINAL[winner][1]
        assert_terminal(facts, winner, 2)
        seen[str(winner)] += 1
    # Which side wins is up to the scheduler; each iteration above proved its story.
    print(f"intent first {seen[reason]}, start failure first {seen['None']}")


# --- Issue 3 concurrency ------------------------------------------------------------------


async def test_twenty_identical_running_acks_make_one_transition(
    world: World, connect: Any
) -> None:
    work = await world.claimed()
    await acknowledge_starting(world.conn, work.fence)
    conns = await connect(20)
    answers: list[RunningDecision] = await asyncio.gather(
        *(acknowledge_running(conn, work.fence, REPORT) for conn in conns)
    )
    outcomes = Counter(answer.outcome for answer in answers)
    assert outcomes == {RunningOutcome.RUNNING: 1, RunningOutcome.ALREADY_RUNNING: 19}
    assert len({answer.started_at_ms for answer in answers}) == 1
    facts = await outcome(world.conn, work)
    assert (facts["run_state"], facts["attempt_state"]) == ("running", "running")
    running_events = [e for e in facts["events"] if e in ("attempt.running", "run.running")]
    assert running_events == ["attempt.running", "run.running"]
    assert len(facts["events"]) == 6


async def test_session_replacement_racing_starting_is_one_or_the_other(
    world: World, connect: Any
) -> None:
    """Either the ACK committed before the replacement, or it was fenced: never both."""
    ack_conn, open_conn = await connect(2)
    seen: Counter[str] = Counter()
    for iteration in range(30):
        work = await world.claimed()
        ack = acknowledge_starting(ack_conn, work.fence)
        replace_session = sessions.open_session(
            open_conn,
            sessions.OpenSession("worker-a", uuid.uuid4().hex, ("remote_worker",), 8, "test"),
            world.timings,
        )
        if iteration % 2:
            answer, opened = await asyncio.gather(ack, replace_session, return_exceptions=True)
        else:
            opened, answer = await asyncio.gather(replace_session, ack, return_exceptions=True)
        assert isinstance(opened, sessions.SessionView), opened
        cursor = await world.conn.execute(
            "SELECT a.state, a.starting_at_ms, s.opened_at_ms, old.status,"
            "       (SELECT count(*) FROM qinglong.run_events e"
            "         WHERE e.attempt_id = a.attempt_id AND e.event_type = 'attempt.starting')"
            "  FROM qinglong.attempts a, qinglong.worker_sessions s, qinglong.worker_sessions old"
            " WHERE a.attempt_id = %s AND s.session_id = %s AND old.session_id = %s",
            (work.fence.attempt_id, opened.session_id, work.fence.session_id),
        )
        row = await cursor.fetchone()
        assert row is not None
        state, starting_at, replaced_at, old_status, starting_events = row
        assert old_status == "replaced"
        if isinstance(answer, StartingDecision):
            assert answer.outcome is StartingOutcome.STARTING
            assert (state, starting_events) == ("starting", 1)
            assert starting_at <= replaced_at, "the ACK committed after the replacement"
            seen["acked"] += 1
        else:
            assert isinstance(answer, Refused), answer
            assert answer.reason is Reason.SESSION_FENCED
            assert (state, starting_at, starting_events) == ("claimed", None, 0)
            seen["fenced"] += 1
    assert sum(seen.values()) == 30
    # The gather order alternates, so each side wins some rounds: both branches are proven.
    assert seen["acked"], seen
    assert seen["fenced"], seen


async def test_fifty_sessions_pulling_at_once_never_claim_a_run_twice(
    database: MigratedDatabase, world: World, connect: Any
) -> None:
    """50 Workers pull at once, several rounds, then claim (and try to steal) their offers.

    Each round opens a new generation of every session, which withdraws the previous
    round's offers, so every round places the same pool under full contention again.
    (The interleaving that makes a pull fail here is forced deterministically by
    `test_pull_racing_a_committed_placement_of_the_same_runs` below.)
    """
    workers = [f"worker-{index:02d}" for index in range(50)]
    enroll(database, *workers)
    task_id = await world.task()
    for index in range(80):
        await runs.trigger_run(
            world.conn, runs.TriggerRun(PROJECT, task_id, None, f"pool-{index}"), OPERATOR
        )
    conns = await connect(50)
    failures: list[str] = []
    claims: list[SessionClaim] = []
    offers: list[list[placement.PlacedOffer]] = []
    for round_number in range(PULL_ROUNDS):
        opened = await asyncio.gather(
            *(
                sessions.open_session(
                    conn,
                    sessions.OpenSession(
                        worker, f"open-{round_number}", ("remote_worker",), 8, "test"
                    ),
                    world.timings,
                )
                for conn, worker in zip(conns, workers, strict=True)
            )
        )
        claims = [
            SessionClaim(worker, view.session_id, view.worker_generation)
            for worker, view in zip(workers, opened, strict=True)
        ]
        pulled = await asyncio.gather(
            *(
                placement.pull_offers(conn, claim, 4, world.timings)
                for conn, claim in zip(conns, claims, strict=True)
            ),
            return_exceptions=True,
        )
        failures += [
            f"round {round_number}: {result!r}"
            for result in pulled
            if isinstance(result, BaseException)
        ]
        offers = [
            result.offers if isinstance(result, placement.Offers) else [] for result in pulled
        ]
        offered_runs = [offer.run_id for session_offers in offers for offer in session_offers]
        assert offered_runs, "nothing was placed"
        assert len(offered_runs) == len(set(offered_runs)), "a Run was offered to two sessions"
    assert not failures, (
        f"{len(failures)} of {50 * PULL_ROUNDS} concurrent pulls failed: {failures[:2]}"
    )

    async def claim_all(index: int) -> list[str]:
        conn, claim = conns[index], claims[index]
        answers: list[str] = []
        neighbour = offers[(index + 1) % len(offers)]
        # Each session claims its own offers, then tries to steal a neighbour's.
        for offer, own in [(offer, True) for offer in offers[index]] + [
            (offer, False) for offer in neighbour[:1]
        ]:
            capability = encode_lease_capability(secrets.token_bytes(32))
            request = ClaimRequest(
                claim.worker_id,
                claim.session_id,
                claim.worker_generation,
                offer.offer_id,
                PROJECT,
                offer.run_id,
                digest_of_capability(capability),
            )
            try:
                claimed = await placement.claim_offer(conn, request, world.timings)
            except Refused as refused:
                answers.append(f"{'own' if own else 'steal'}:{refused.reason}")
            else:
                assert not claimed.replayed
                answers.append(f"{'own' if own else 'steal'}:claimed")
        return answers

    answers = Counter(
        answer
        for session_answers in await asyncio.gather(*(claim_all(i) for i in range(50)))
        for answer in session_answers
    )
    steals = sum(1 for session_offers in offers if session_offers)
    assert answers == {"own:claimed": len(offered_runs), "steal:FENCE_MISMATCH": steals}
    cursor = await world.conn.execute(
        "SELECT count(*), count(DISTINCT a.run_id),"
        "       count(*) FILTER (WHERE o.session_id = a.session_id AND o.state = 'claimed'),"
        "       (SELECT count(*) FROM qinglong.runs WHERE state = 'dispatching')"
        "  FROM qinglong.attempts a JOIN qinglong.offers o ON o.offer_id = a.offer_id"
    )
    assert await cursor.fetchone() == (len(offered_runs),) * 4


# A test-only gate on the runs table: a connection that sets `qinglong_test.gate = on`
# waits, in the middle of any statement that reads a Run, until the test releases an
# advisory lock. It pauses a pull after its statement snapshot was taken.
_GATE = """
CREATE FUNCTION qinglong.test_gate() RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('qinglong_test.gate', true) = 'on' THEN
        PERFORM pg_advisory_lock_shared(4242);
        PERFORM pg_advisory_unlock_shared(4242);
    END IF;
    RETURN true;
END
$$;
GRANT EXECUTE ON FUNCTION qinglong.test_gate() TO qinglong_runtime;
ALTER TABLE qinglong.runs ENABLE ROW LEVEL SECURITY;
CREATE POLICY test_gate ON qinglong.runs USING (qinglong.test_gate()) WITH CHECK (true);
"""


async def test_pull_racing_a_committed_placement_of_the_same_runs(
    database: MigratedDatabase, world: World, connect: Any
) -> None:
    """Deterministic form of the race above: B's candidate scan started before A committed.

    B's statement snapshot predates A's offers; when B reaches the Runs, A's row locks are
    gone and the Runs themselves were not updated, so B locks them and tries to offer them
    again. A second placement must be skipped or refused as a typed answer, never an
    internal error, and never a second open offer.
    """
    enroll(database, "worker-b")
    async with await psycopg.AsyncConnection.connect(
        database.urls.migration, autocommit=True
    ) as owner:
        await owner.execute(_GATE)
        for _ in range(2):
            await world.queued_run()
        a_conn, b_conn, observer = await connect(3)
        a = await World(a_conn).session("worker-a")
        b = await World(b_conn).session("worker-b")
        await owner.execute("SELECT pg_advisory_lock(4242)")
        await b_conn.execute("SET qinglong_test.gate = 'on'")
        b_pull = asyncio.create_task(placement.pull_offers(b_conn, b, 4, world.timings))
        try:
            await wait_until_blocked(observer, b_conn)
            placed_a = await placement.pull_offers(a_conn, a, 4, world.timings)
            assert len(placed_a.offers) == 2
        finally:
            await owner.execute("SELECT pg_advisory_unlock(4242)")
        try:
            placed_b = await b_pull
        except psycopg.Error as error:
            pytest.fail(f"a pull racing a committed placement failed: {error!r}")
        a_runs = {offer.run_id for offer in placed_a.offers}
        assert not a_runs & {offer.run_id for offer in placed_b.offers}
        cursor = await observer.execute(
            "SELECT count(*), count(DISTINCT run_id) FROM qinglong.offers WHERE state = 'open'"
        )
        assert await cursor.fetchone() == (2, 2)


# --- the real commands racing the start facts ------------------------------------------


CancelRequestFor = Callable[[uuid.UUID], CancelRequest]


@pytest.fixture
def canceller(database: MigratedDatabase) -> CancelRequestFor:
    """An operator allowed to cancel, and the CancelRun request it makes for a Run."""
    with psycopg.connect(database.urls.migration, autocommit=True) as admin:
        alice = enroll_operator_token(admin, "alice", "user", digest("qlo1_alice"))
        bind_role(admin, PROJECT, alice, "operator")
    snapshot = BindingSnapshot(project_version=1, binding_version=1, role="operator")

    def request(run_id: uuid.UUID) -> CancelRequest:
        return CancelRequest(PROJECT, run_id, "m-1", Actor("user", str(alice)), alice, snapshot)

    return request


async def gapless(conn: Conn, run_id: uuid.UUID) -> list[str]:
    cursor = await conn.execute(
        "SELECT sequence, event_type FROM qinglong.run_events WHERE run_id = %s ORDER BY 1",
        (run_id,),
    )
    rows = list(await cursor.fetchall())
    assert [sequence for sequence, _ in rows] == list(range(1, len(rows) + 1))
    return [event_type for _, event_type in rows]


async def test_the_cancel_command_racing_a_start_failure_tells_one_story(
    world: World, connect: Any, canceller: CancelRequestFor
) -> None:
    """cancel_run (serializable, retried) against report_start_failure, both orders, many
    times: the intent counts exactly when the cancel committed first; Attempt, Run, Lease
    and a gapless Event sequence agree whichever side wins (the tally is printed)."""
    (other,) = await connect(1)
    seen: Counter[str] = Counter()
    for iteration in range(12):
        work, answered, decision = await raced_with_a_start_failure(
            world, lambda work: cancel_run(other, canceller(work.fence.run_id)), iteration % 2
        )
        facts = await outcome(world.conn, work)
        won = answered is CancelOutcome.ACCEPTED
        assert answered in (CancelOutcome.ACCEPTED, CancelOutcome.ALREADY_TERMINAL)
        winner = "user" if won else None
        assert facts["cancel_reason"] == winner
        assert decision.error_code == TERMINAL[winner][1]
        assert_terminal(facts, winner, 2)
        events = await gapless(world.conn, work.fence.run_id)
        assert events.count("run.cancel_requested") == (1 if won else 0)
        seen[str(winner)] += 1
    # Which side wins is up to the scheduler; each iteration above proved its story.
    print(f"cancel first {seen['user']}, start failure first {seen['None']}")


async def test_a_renewal_queued_before_an_ack_fences_it(world: World, connect: Any) -> None:
    """control_lease and acknowledge_starting queue for the Attempt (its advisory lock,
    held here): the renewal, first in the queue, commits version 2, and the ACK behind it
    at version 1 is fenced; at version 2 it proceeds."""
    holder, renewer, observer = await connect(3)
    work = await world.claimed()
    lock = "SELECT pg_advisory_xact_lock(hashtextextended('qinglong.attempt:' || %s, 0))"
    async with holder.transaction():
        await holder.execute(lock, (str(work.fence.attempt_id),))
        renewal = asyncio.create_task(control_lease(renewer, work.fence, world.timings))
        await wait_until_blocked(observer, renewer)
        ack = asyncio.create_task(acknowledge_starting(world.conn, work.fence))
        await wait_until_blocked(observer, world.conn)
    renewed_to = await renewal
    assert (renewed_to.answer, renewed_to.new_lease_version) == (LeaseAnswer.RENEWED, 2)
    with pytest.raises(Refused) as refused:
        await ack
    assert refused.value.reason is Reason.LEASE_VERSION_FENCED
    assert (await outcome(world.conn, work))["attempt_state"] == "claimed"
    decision = await acknowledge_starting(world.conn, with_version(work.fence, 2))
    assert decision.outcome is StartingOutcome.STARTING


async def test_the_cancel_command_racing_the_running_ack_reaches_the_worker(
    world: World, connect: Any, canceller: CancelRequestFor
) -> None:
    """Whichever commits first, the Run ends up running with the intent recorded once, and
    the Worker's next lease control answers stop_requested."""
    (other,) = await connect(1)
    for iteration in range(6):
        work = await world.claimed()
        await acknowledge_starting(world.conn, work.fence)
        cancel = cancel_run(other, canceller(work.fence.run_id))
        running = acknowledge_running(world.conn, work.fence, REPORT)
        if iteration % 2:
            answered, _ = await asyncio.gather(cancel, running)
        else:
            _, answered = await asyncio.gather(running, cancel)
        assert answered is CancelOutcome.ACCEPTED
        facts = await outcome(world.conn, work)
        assert (facts["run_state"], facts["attempt_state"], facts["cancel_reason"]) == (
            "running",
            "running",
            "user",
        )
        assert (await gapless(world.conn, work.fence.run_id)).count("run.cancel_requested") == 1
        told = await control_lease(world.conn, work.fence, world.timings)
        assert (told.answer, told.cancel_reason) == (LeaseAnswer.STOP_REQUESTED, "user")
