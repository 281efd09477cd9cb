"""Claiming an offer (SPEC R-CLAIM-1): create the Attempt and the Run Lease, or replay."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from qinglong_control.domain.capability import TokenDigest
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.domain.sessions import SessionRow
from qinglong_control.domain.states import RunState


@dataclass(frozen=True)
class ClaimRequest:
    worker_id: str
    session_id: uuid.UUID
    worker_generation: int
    offer_id: uuid.UUID
    project_id: str
    run_id: uuid.UUID
    token_digest: TokenDigest


@dataclass(frozen=True)
class OfferRow:
    offer_id: uuid.UUID
    run_id: uuid.UUID
    session_id: uuid.UUID
    worker_id: str
    worker_generation: int
    state: str
    expires_at_ms: int


@dataclass(frozen=True)
class ClaimedRunRow:
    run_id: uuid.UUID
    project_id: str
    state: RunState
    attempt_count: int
    event_sequence: int
    cancel_requested_at_ms: int | None
    served: bool | None
    """Whether the claiming Worker serves the Run's project now."""
    project_active: bool | None
    """Whether the Run's project is still active (not disabled since the offer)."""
    worker_cordoned: bool | None = None
    """Whether an administrator cordoned the claiming Worker since the offer."""


@dataclass(frozen=True)
class ExistingClaim:
    """The Attempt and Lease an earlier claim of this offer created."""

    attempt_id: uuid.UUID
    lease_generation: int
    lease_version: int
    lease_status: str
    token_digest: str
    expires_at_ms: int


@dataclass(frozen=True)
class NewClaim:
    attempt_number: int
    lease_generation: int


def decide_claim(
    request: ClaimRequest,
    session: SessionRow,
    offer: OfferRow | None,
    run: ClaimedRunRow | None,
    existing: ExistingClaim | None,
    now_ms: int,
    session_room: int,
) -> NewClaim | ExistingClaim:
    """A new claim, the earlier claim (exact retry), or a refusal."""
    if offer is None or run is None or offer.run_id != run.run_id:
        raise Refused(Reason.OFFER_NOT_FOUND, "no such offer")
    if run.project_id != request.project_id or run.run_id != request.run_id:
        raise Refused(Reason.FENCE_MISMATCH, "offer is of another run")
    holder = (offer.session_id, offer.worker_id, offer.worker_generation)
    if holder != (session.session_id, session.worker_id, session.generation):
        raise Refused(Reason.FENCE_MISMATCH, "offer was placed on another session")
    if offer.state == "claimed":
        if existing is None or not request.token_digest.matches(existing.token_digest):
            raise Refused(
                Reason.OFFER_CLAIMED_BY_OTHER_CAPABILITY,
                "offer was claimed with another capability",
            )
        if existing.lease_status != "leased":
            # The claim's authority has ended; a retry must not look like a live claim.
            raise Refused(Reason.LEASE_NOT_LEASED, f"the claim's lease is {existing.lease_status}")
        return existing
    if offer.state != "open" or offer.expires_at_ms <= now_ms:
        raise Refused(Reason.OFFER_EXPIRED, "offer expired")
    if not run.served:
        # Its projects changed since the offer was made: the offer is void.
        raise Refused(Reason.OFFER_EXPIRED, "the Worker no longer serves the offer's project")
    if not run.project_active:
        # Disabled since the offer was made: none of its Runs may start any more.
        raise Refused(Reason.OFFER_EXPIRED, "the offer's project is disabled")
    if run.worker_cordoned:
        # Cordoned since the offer was made: it takes no new work until uncordoned.
        raise Refused(Reason.OFFER_EXPIRED, "the Worker is cordoned")
    if session.status != "online":
        raise Refused(Reason.SESSION_FENCED, "a draining session takes no new work")
    if run.state is not RunState.QUEUED or run.cancel_requested_at_ms is not None:
        raise Refused(Reason.STATE_CONFLICT, f"run is {run.state}")
    if session_room <= 0:
        raise Refused(Reason.STATE_CONFLICT, "the session runs as many attempts as it may")
    # Each claim of a Run is a new Attempt with a new lease generation, so a fence from an
    # earlier Attempt can never match a later one.
    attempt_number = run.attempt_count + 1
    return NewClaim(attempt_number=attempt_number, lease_generation=attempt_number)
