"""Ingress admission as stages: their order, how a held call is answered, and how a
refusal is audited. The running pipeline is proven in tests/integration (the real stack)."""

from __future__ import annotations

import uuid
from typing import Any

import grpc
import pytest
from qinglong.control.v1 import run_service_pb2
from qinglong.rpc.v1.error_reason_pb2 import ErrorReason
from qinglong_ingress.admission import DEFAULT_POLICY, Decision, Permission, Policy
from qinglong_ingress.audit import AuditOutcome, refused_outcome
from qinglong_ingress.principals import CredentialKind, Principal, PrincipalKind
from qinglong_ingress.routes import ROUTES
from qinglong_ingress.stages import (
    Authentication,
    Authorisation,
    Bounds,
    JoiningMachine,
    RateLimit,
    Refusal,
    RefusedCertificates,
    SizeCap,
    TransportSecurity,
    admission_stages,
    enrollment_stages,
)
from qinglong_protocol.errors import code_for

_E = ErrorReason


def test_the_stages_run_in_the_documented_order() -> None:
    directory: Any = object()  # the stages only keep it; nothing is read here
    stages = admission_stages(directory, "qinglong.local")
    assert [type(stage) for stage in stages] == [
        TransportSecurity,
        SizeCap,
        RefusedCertificates,
        Authentication,
        Bounds,
        Authorisation,
    ]


APPROVAL_ID = "0b5d6c1e-6a53-4d5e-9f0a-6f2b8f6c1d2e"


def test_cancel_run_answers_approval_with_its_own_outcome_and_the_request() -> None:
    [cancel] = [route for route in ROUTES if route.name == "CancelRun"]
    answer = cancel.approval_response(APPROVAL_ID)
    assert answer is not None
    # The outcome and the request that holds the call; no Run (nothing was read).
    expected = run_service_pb2.CancelRunResponse(
        outcome=run_service_pb2.CANCEL_RUN_OUTCOME_REQUIRE_APPROVAL, approval_id=APPROVAL_ID
    )
    assert answer.SerializeToString() == expected.SerializeToString()
    assert answer is not cancel.approval_response(APPROVAL_ID), "a fresh message per call"


def test_only_a_contract_outcome_answers_approval_otherwise_a_typed_status() -> None:
    with_outcome = {
        route.name for route in ROUTES if route.approval_response(APPROVAL_ID) is not None
    }
    assert with_outcome == {"CancelRun"}
    # A stream never has a single answer, whatever its messages look like.
    assert all(route.approval_outcome is None for route in ROUTES if route.server_streaming)


def _principal(kind: PrincipalKind) -> Principal:
    return Principal(kind, str(uuid.uuid4()), "someone", CredentialKind.BEARER_TOKEN, "bearer")


@pytest.mark.parametrize(
    ("kind", "role", "permission", "decision"),
    [
        (PrincipalKind.USER, "operator", Permission.RUN_STOP, Decision.ADMIT),
        (PrincipalKind.AGENT, "operator", Permission.RUN_STOP, Decision.REQUIRE_APPROVAL),
        (PrincipalKind.AGENT, "viewer", Permission.RUN_STOP, Decision.DENY),
        (PrincipalKind.USER, "operator", Permission.APPROVAL_DECIDE, Decision.ADMIT),
        (PrincipalKind.USER, "viewer", Permission.APPROVAL_DECIDE, Decision.DENY),
        # An Agent's request waits for a person: an Agent may not decide one.
        (PrincipalKind.AGENT, "owner", Permission.APPROVAL_DECIDE, Decision.DENY),
        (PrincipalKind.AGENT, "operator", Permission.READ, Decision.ADMIT),
        (PrincipalKind.USER, None, Permission.READ, Decision.DENY),
    ],
)
def test_the_default_policy(
    kind: PrincipalKind, role: str | None, permission: Permission, decision: Decision
) -> None:
    assert DEFAULT_POLICY.decide(_principal(kind), role, permission) is decision


def test_another_policy_holds_another_method_without_code() -> None:
    """Requiring an approval for a method is a line of data, not a special case."""
    policy = Policy(
        grants=DEFAULT_POLICY.grants,
        held={PrincipalKind.USER: frozenset({Permission.RUN_TRIGGER})},
    )
    user, agent = _principal(PrincipalKind.USER), _principal(PrincipalKind.AGENT)
    assert policy.decide(user, "owner", Permission.RUN_TRIGGER) is Decision.REQUIRE_APPROVAL
    assert policy.decide(agent, "owner", Permission.RUN_TRIGGER) is Decision.ADMIT
    assert policy.decide(agent, "owner", Permission.RUN_STOP) is Decision.ADMIT


@pytest.mark.parametrize(
    ("reason", "outcome"),
    [
        (_E.ERROR_REASON_TLS_VERSION_REJECTED, AuditOutcome.UNAUTHENTICATED),
        (_E.ERROR_REASON_UNAUTHENTICATED_PRINCIPAL, AuditOutcome.UNAUTHENTICATED),
        (_E.ERROR_REASON_PRINCIPAL_MISMATCH, AuditOutcome.PERMISSION_DENIED),
        (_E.ERROR_REASON_PERMISSION_DENIED, AuditOutcome.PERMISSION_DENIED),
        (_E.ERROR_REASON_FIELD_INVALID, AuditOutcome.INVALID_ARGUMENT),
        (_E.ERROR_REASON_REQUEST_TOO_LARGE, AuditOutcome.INVALID_ARGUMENT),
        (_E.ERROR_REASON_UNKNOWN_FIELD, AuditOutcome.INVALID_ARGUMENT),
        (_E.ERROR_REASON_CAPABILITY_MALFORMED, AuditOutcome.INVALID_ARGUMENT),
        (_E.ERROR_REASON_CAPABILITY_WEAK, AuditOutcome.INVALID_ARGUMENT),
        (_E.ERROR_REASON_STORAGE_UNAVAILABLE, AuditOutcome.UNAVAILABLE),
        (_E.ERROR_REASON_INTERNAL, AuditOutcome.INTERNAL),
    ],
)
def test_a_refusal_is_audited_as_the_code_it_is_answered_with(
    reason: ErrorReason.ValueType, outcome: AuditOutcome
) -> None:
    assert refused_outcome(reason) is outcome


def test_ingress_cannot_audit_a_refusal_it_never_gives() -> None:
    with pytest.raises(ValueError, match=grpc.StatusCode.ABORTED.name):
        refused_outcome(_E.ERROR_REASON_LEASE_VERSION_FENCED)


# --- the enrollment listener's rate limit ---------------------------------------------------


class _Peer:
    """What RateLimit reads of a call: the peer it came from (no server needed)."""

    def __init__(self, peer: str) -> None:
        self.context = self
        self._peer = peer

    def peer(self) -> str:
        return self._peer


def test_enrollment_stages_limit_rate_before_they_trust_anything() -> None:
    stages = enrollment_stages(per_peer_per_minute=3, total_per_minute=10)
    kinds = [type(stage) for stage in stages]
    assert kinds == [TransportSecurity, SizeCap, RateLimit, JoiningMachine, Bounds]


async def test_rate_limit_per_peer_host_and_in_total_and_refills_with_time() -> None:
    now = [1000.0]
    limit = RateLimit(per_peer_per_minute=3, total_per_minute=5, clock=lambda: now[0])

    async def attempt(peer: str) -> bool:
        reasons = []
        try:
            await limit.check(_Peer(peer))  # type: ignore[arg-type]
        except Refusal as refusal:
            reasons.append(refusal.answer.reason)
        assert reasons in ([], [_E.ERROR_REASON_RATE_LIMITED])
        return not reasons

    # One host gets three, whatever port it comes from; another host gets the rest.
    assert [await attempt(f"ipv4:10.0.0.1:{port}") for port in range(4)] == [
        True,
        True,
        True,
        False,
    ]
    # The total (5 a minute) runs out before the second host's own three do.
    assert [await attempt("ipv4:10.0.0.2:1") for _ in range(3)] == [True, True, False]
    # Twenty seconds refill a third of a minute: one more for the first host, and then
    # the total has less than one left for a third host.
    now[0] += 20
    assert await attempt("ipv4:10.0.0.1:9")
    assert not await attempt("ipv4:10.0.0.3:9"), "the total of 5 per minute holds"
    assert code_for(_E.ERROR_REASON_RATE_LIMITED) == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_ipv6_peers_share_their_networks_share() -> None:
    """An IPv6 subscriber holds a whole network of addresses: a fresh bucket per address
    would let it make (and have audited) as many attempts as it has addresses."""
    now = [1000.0]
    limit = RateLimit(per_peer_per_minute=2, total_per_minute=1_000, clock=lambda: now[0])

    async def admitted(peer: str) -> bool:
        try:
            await limit.check(_Peer(peer))  # type: ignore[arg-type]
        except Refusal:
            return False
        return True

    same_network = [f"ipv6:[2001:db8:1:{n:x}::{n}]:4000" for n in range(0x10, 0x20)]
    results = [await admitted(peer) for peer in same_network]
    assert results.count(True) == 2, "16 addresses of one /56: one share"
    assert await admitted("ipv6:[2001:db8:2::1]:4000"), "another network has its own"
    # An IPv4 address written as IPv6 counts as that IPv4 host.
    assert [await admitted(p) for p in ("ipv4:10.0.0.9:1", "ipv6:[::ffff:10.0.0.9]:2")] == [
        True,
        True,
    ]
    assert not await admitted("ipv6:[::ffff:10.0.0.9]:3")


async def test_a_peers_rate_limited_refusals_are_audited_once_a_minute() -> None:
    now = [1000.0]
    limit = RateLimit(per_peer_per_minute=1, total_per_minute=100, clock=lambda: now[0])

    async def audited(peer: str) -> bool | None:
        """None: admitted; else whether the refusal is to be audited."""
        try:
            await limit.check(_Peer(peer))  # type: ignore[arg-type]
        except Refusal as refusal:
            return refusal.audited
        return None

    host = "ipv4:10.0.0.1:1"
    assert [await audited(host) for _ in range(4)] == [None, True, False, False]
    assert await audited("ipv4:10.0.0.2:1") is None, "another host has its own count"
    assert await audited("ipv4:10.0.0.2:1") is True
    now[0] += 30  # half a refill: still refused, and still within the minute
    assert await audited(host) is False
    now[0] += 31  # a minute since the last audited refusal, and one token back
    assert await audited(host) is None
    assert await audited(host) is True


async def test_refusals_of_the_total_are_audited_once_a_minute_in_all() -> None:
    """Many addresses, each within its own share, over the total: one audit row a minute
    in all, not one per address."""
    now = [1000.0]
    limit = RateLimit(per_peer_per_minute=5, total_per_minute=2, clock=lambda: now[0])

    async def refusals(hosts: range) -> list[bool]:
        audited = []
        for n in hosts:
            try:
                await limit.check(_Peer(f"ipv4:10.0.1.{n}:1"))  # type: ignore[arg-type]
            except Refusal as refusal:
                audited.append(refusal.audited)
        return audited

    assert await refusals(range(12)) == [True] + [False] * 9
    now[0] += 61  # two more for the total, and a minute since the audited refusal
    assert await refusals(range(12, 20)) == [True] + [False] * 5
