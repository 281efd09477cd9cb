"""The Worker session across a drain (issue 7): a draining keeper only renews, and a later
start that finds its session left draining keeps it while it still owns open records,
then opens a fresh one. A real inbox; the network is a scripted stand-in."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from qinglong.rpc.v1.error_reason_pb2 import ErrorReason
from qinglong.worker.v1 import worker_pb2
from qinglong.worker.v1 import worker_service_pb2 as ws
from qinglong_worker.client import CallFailed
from qinglong_worker.inbox import Inbox, InboxRecord, RecordState, SessionRecord
from qinglong_worker.reconcile import new_capability
from qinglong_worker.session import (
    OPEN_BACKOFF_FIRST_SECONDS,
    OPEN_BACKOFF_MAX_SECONDS,
    SessionKeeper,
)

WORKER = "worker-a"


def _duration(seconds: int) -> Duration:
    value = Duration()
    value.FromSeconds(seconds)
    return value


class SessionServer:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.state = worker_pb2.SESSION_STATE_ONLINE
        self.renewal_refusal: CallFailed | None = None
        self.open_refusals: list[CallFailed] = []
        self.opened: list[str] = []

    async def open_session(
        self, request: ws.OpenSessionRequest, *, budget_seconds: float | None = None
    ) -> ws.OpenSessionResponse:
        self.calls.append("OpenSession")
        self.opened.append(request.request_id)
        if self.open_refusals:
            raise self.open_refusals.pop(0)
        return ws.OpenSessionResponse(
            session_id=str(uuid.uuid4()),
            worker_generation=len(self.opened) + 1,
            session_state=worker_pb2.SESSION_STATE_ONLINE,
            session_remaining=_duration(30),
            renew_interval=_duration(10),
        )

    async def renew_session(
        self, request: ws.RenewSessionRequest, *, budget_seconds: float | None = None
    ) -> ws.RenewSessionResponse:
        self.calls.append("RenewSession")
        if self.renewal_refusal is not None:
            raise self.renewal_refusal
        return ws.RenewSessionResponse(session_state=self.state, session_remaining=_duration(30))

    async def drain_session(
        self, request: ws.DrainSessionRequest, *, budget_seconds: float | None = None
    ) -> ws.DrainSessionResponse:
        self.calls.append("DrainSession")
        assert budget_seconds is not None, "a drain is bounded"
        self.state = worker_pb2.SESSION_STATE_DRAINING
        return ws.DrainSessionResponse(
            session_state=worker_pb2.SESSION_STATE_DRAINING, session_remaining=_duration(30)
        )


@pytest.fixture
def inbox(tmp_path: Path) -> Iterator[Inbox]:
    opened = Inbox.open(tmp_path / "inbox.db")
    yield opened
    opened.close()


class Clock:
    """The keeper's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def _keeper(inbox: Inbox, server: SessionServer, clock: Clock | None = None) -> SessionKeeper:
    return SessionKeeper(
        inbox=inbox,
        client=server,  # type: ignore[arg-type]
        worker_id=WORKER,
        max_concurrency=2,
        clock=clock or Clock(),
    )


def _stored_session(inbox: Inbox) -> SessionRecord:
    return inbox.save_session(
        None,
        SessionRecord(
            revision=0,
            worker_id=WORKER,
            open_request_id="first",
            session_id=str(uuid.uuid4()),
            worker_generation=1,
        ),
    )


def _open_record(inbox: Inbox, session_id: str) -> InboxRecord:
    record = InboxRecord(
        offer_id=str(uuid.uuid4()),
        revision=1,
        state=RecordState.CLAIMING,
        worker_id=WORKER,
        session_id=session_id,
        worker_generation=1,
        project_id="default",
        run_id=str(uuid.uuid4()),
        capability=new_capability(),
        argv=("true",),
        timeout_ms=None,
        created_unix_ms=1,
        updated_unix_ms=1,
    )
    assert inbox.admit(record)
    return record


async def test_a_draining_keeper_drains_once_and_then_only_renews(inbox: Inbox) -> None:
    stored = _stored_session(inbox)
    server = SessionServer()
    keeper = _keeper(inbox, server)
    assert (await keeper.ensure()) is not None
    await keeper.drain()
    assert keeper.draining
    active = keeper.active
    assert active is not None
    assert not active.online, "no pulls from a draining session"
    # The session is gone (fenced): a draining Worker does not open another.
    server.renewal_refusal = CallFailed(
        "RenewSession", grpc.StatusCode.ABORTED, ErrorReason.ERROR_REASON_SESSION_FENCED
    )
    keeper._active = None  # force the renewal now
    assert await keeper.ensure() is None
    assert server.calls == ["RenewSession", "DrainSession", "RenewSession"]
    assert inbox.session() == stored


async def test_a_session_left_draining_is_kept_while_it_owns_open_records(inbox: Inbox) -> None:
    stored = _stored_session(inbox)
    assert stored.session_id is not None
    record = _open_record(inbox, stored.session_id)
    server = SessionServer()
    server.state = worker_pb2.SESSION_STATE_DRAINING  # an earlier run of this Worker drained
    keeper = _keeper(inbox, server)
    resumed = await keeper.ensure()
    assert resumed is not None
    assert resumed.session_id == stored.session_id
    assert not resumed.online
    assert "OpenSession" not in server.calls, "its records are finished under it"

    # Once nothing is open any more, a fresh, online session is opened.
    inbox.compare_and_set(record, dataclasses.replace(record, state=RecordState.ABANDONED))
    fresh = await keeper.ensure()
    assert fresh is not None
    assert fresh.online
    assert fresh.session_id != stored.session_id
    assert server.opened
    assert server.opened[0] != stored.open_request_id


async def test_an_open_session_refused_for_good_is_retried_under_a_new_request_id(
    inbox: Inbox,
) -> None:
    """A lost OpenSession answer is retried with the same request id (the server answers
    the session it opened); once the server refuses that id for good (its session expired
    or was replaced meanwhile, or the Worker now asks other terms), the Worker opens a new
    session under a new id instead of sending the refused one for ever."""
    server = SessionServer()
    clock = Clock()
    keeper = _keeper(inbox, server, clock)
    server.open_refusals = [
        CallFailed("OpenSession", grpc.StatusCode.UNAVAILABLE, None),
        CallFailed(
            "OpenSession", grpc.StatusCode.ABORTED, ErrorReason.ERROR_REASON_SESSION_EXPIRED
        ),
    ]
    assert await keeper.ensure() is None
    assert await keeper.ensure() is None
    assert server.opened[0] == server.opened[1], "a transient failure keeps the id"
    clock.now += OPEN_BACKOFF_FIRST_SECONDS
    opened = await keeper.ensure()
    assert opened is not None
    assert server.opened[2] != server.opened[1], "a refusal for good ends that id"
    stored = inbox.session()
    assert stored is not None
    assert (stored.open_request_id, stored.session_id) == (server.opened[2], opened.session_id)


async def test_a_worker_refused_for_good_backs_off_instead_of_asking_twice_a_second(
    inbox: Inbox,
) -> None:
    """A disabled Worker's calls are refused, and each refusal is an audit row in ingress:
    its renewal is refused once, then it asks for a session again after 1 s, 2 s, 4 s …
    up to a minute apart — never again at every tick — and at once again after success."""
    server = SessionServer()
    clock = Clock()
    keeper = _keeper(inbox, server, clock)
    _stored_session(inbox)
    disabled = CallFailed("OpenSession", grpc.StatusCode.PERMISSION_DENIED, None)
    server.renewal_refusal = CallFailed("RenewSession", grpc.StatusCode.PERMISSION_DENIED, None)
    server.open_refusals = [disabled] * 10
    waits: list[float] = []
    for _ in range(8):
        asked = len(server.calls)
        waited = 0.0
        while len(server.calls) == asked:
            assert await keeper.ensure() is None
            clock.now += 0.5  # a tick
            waited += 0.5
        waits.append(waited)
    assert server.calls.count("RenewSession") == 1, "the refused session is not renewed again"
    assert waits[1:] == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0][: len(waits) - 1]
    assert max(waits) <= OPEN_BACKOFF_MAX_SECONDS
    server.open_refusals, server.renewal_refusal = [], None  # enabled again
    clock.now += OPEN_BACKOFF_MAX_SECONDS
    assert await keeper.ensure() is not None
    # Disabled once more: the wait starts again from the first.
    server.open_refusals = [disabled] * 2
    server.renewal_refusal = CallFailed("RenewSession", grpc.StatusCode.PERMISSION_DENIED, None)
    clock.now += 60.0  # its renewal is due
    assert await keeper.ensure() is None
    opens = server.calls.count("OpenSession")
    clock.now += OPEN_BACKOFF_FIRST_SECONDS
    assert await keeper.ensure() is None
    assert server.calls.count("OpenSession") == opens + 1


async def test_a_session_refused_as_fenced_elsewhere_is_replaced_at_once(inbox: Inbox) -> None:
    """A pull refused SESSION_FENCED (another process of this identity took over, or a
    suspend outlived it) makes the keeper forget the session: the next ensure renews it
    (refused, then opens another) instead of handing it out until its renewal is due."""
    server = SessionServer()
    keeper = _keeper(inbox, server)
    first = await keeper.ensure()
    assert first is not None
    assert await keeper.ensure() is first  # its renewal is not due yet
    keeper.forget(first.session_id)
    server.renewal_refusal = CallFailed(
        "RenewSession", grpc.StatusCode.ABORTED, ErrorReason.ERROR_REASON_SESSION_FENCED
    )
    second = await keeper.ensure()
    assert second is not None
    assert second.session_id != first.session_id
    assert server.calls[-2:] == ["RenewSession", "OpenSession"]
