"""Worker sessions: one live incarnation per Worker, fenced by generation."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from qinglong_control.domain.refusals import Reason, Refused

LIVE_SESSION_STATES = frozenset({"online", "draining"})


@dataclass(frozen=True)
class SessionRow:
    session_id: uuid.UUID
    worker_id: str
    generation: int
    status: str
    expires_at_ms: int


@dataclass(frozen=True)
class SessionClaim:
    """What a Worker says its session is."""

    worker_id: str
    session_id: uuid.UUID
    worker_generation: int


def check_session(claim: SessionClaim, row: SessionRow | None, now_ms: int) -> SessionRow:
    """The session must be the Worker's present, live, unexpired incarnation."""
    if row is None:
        raise Refused(Reason.SESSION_NOT_FOUND, "no such session")
    if (row.worker_id, row.generation) != (claim.worker_id, claim.worker_generation):
        raise Refused(Reason.SESSION_FENCED, "session belongs to another worker or generation")
    if row.status not in LIVE_SESSION_STATES:
        raise Refused(Reason.SESSION_FENCED, "session is no longer live")
    if row.expires_at_ms <= now_ms:
        raise Refused(Reason.SESSION_EXPIRED, "session expired")
    return row


@dataclass(frozen=True)
class SessionRequest:
    """What an OpenSession asks for; a retry (the same request id) must ask the same."""

    executor_types: tuple[str, ...]
    max_concurrency: int
    agent_version: str
    passes_run_parameters: bool = False
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class OpenedBefore:
    """The session an earlier OpenSession with the same request id opened."""

    session_id: uuid.UUID
    generation: int
    status: str
    expires_at_ms: int
    request: SessionRequest


def check_open_replay(earlier: OpenedBefore, request: SessionRequest, now_ms: int) -> None:
    """A retried OpenSession (AIP-155) is answered with the session it opened only when it
    asks for the same thing and that session is still the Worker's live one; otherwise the
    Worker is told why and opens another with a new request id."""
    if earlier.request != request:
        raise Refused(Reason.REPLAY_MISMATCH, "that request id opened a session with other terms")
    if earlier.status not in LIVE_SESSION_STATES:
        raise Refused(Reason.SESSION_FENCED, "that session was replaced or closed")
    if earlier.expires_at_ms <= now_ms:
        raise Refused(Reason.SESSION_EXPIRED, "that session expired")
