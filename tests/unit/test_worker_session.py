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
from qinglong_worker.session import SessionKeeper

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


def _keeper(inbox: Inbox, server: SessionServer) -> SessionKeeper:
    return SessionKeeper(
        inbox=inbox,
        client=server,  # type: ignore[arg-type]
        worker_id=WORKER,
        max_concurrency=2,
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
    keeper = _keeper(inbox, server)
    server.open_refusals = [
        CallFailed("OpenSession", grpc.StatusCode.UNAVAILABLE, None),
        CallFailed(
            "OpenSession", grpc.StatusCode.ABORTED, ErrorReason.ERROR_REASON_SESSION_EXPIRED
        ),
    ]
    assert await keeper.ensure() is None
    assert await keeper.ensure() is None
    assert server.opened[0] == server.opened[1], "a transient failure keeps the id"
    opened = await keeper.ensure()
    assert opened is not None
    assert server.opened[2] != server.opened[1], "a refusal for good ends that id"
    stored = inbox.session()
    assert stored is not None
    assert (stored.open_request_id, stored.session_id) == (server.opened[2], opened.session_id)
