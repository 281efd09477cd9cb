"""Admission as stages: the rules a public call must pass before it is audited and forwarded.

Every stage has one method, ``check(call)``. It reads the :class:`Call` (and what earlier
stages learnt about it), may record what it learnt, and either lets the call go on
(``Verdict.PASS``), ends admission with an answer that needs an approval
(``Verdict.REQUIRE_APPROVAL``), or raises :class:`Refusal`. :func:`admission_stages` is the
order every call goes through:

1. transport: the negotiated TLS version must be 1.3;
2. size: the serialized request must fit the method's byte cap (then a certificate
   refused as unauthenticated too often is refused before any database work:
   :class:`RefusedCertificates`);
3. authentication: an operator by bearer token or certificate, enrolled and active; a
   worker by its certificate's SAN URI — which the audit statement checks (below);
4. bounds: every field within the contract's bounds, no unknown fields or enum values;
5. authorisation: an operator needs a project role for the method's permission (an
   agent asking to stop a Run needs an approval); a worker may speak only for itself
   and its own sessions — also checked by the audit statement.

A Worker's call makes one database round trip (R-PERF-1): the stages only note the
certificate's claim (:class:`WorkerClaim`), and the statement that writes the call's
audit row checks the identity and the binding and records what it found; the gateway
turns what it found into the refusal these stages would have raised, with the same
precedence (an unenrolled certificate first, the binding last).

The Worker enrollment listener uses :func:`enrollment_stages` instead: transport, size, a
rate limit, an anonymous caller (the join token is control's to check), bounds.

A new rule (an approval for another method, a rate limit) is one more class with
``check``, placed in that list where what it needs is known: after authentication for
anything about the caller, after bounds for anything that trusts a field. The gateway
audits whatever the stages decided, bounds all of a call's database work by one storage
budget, and answers a storage failure a stage meets by the rule control uses too — so a
stage neither times, audits nor catches anything itself.
"""

from __future__ import annotations

import ipaddress
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, Final, Protocol, runtime_checkable

import grpc
from google.protobuf.message import Message
from qinglong.rpc.v1.error_reason_pb2 import ErrorReason
from qinglong_protocol.errors import TypedStatus
from qinglong_protocol.tls import peer_tls

from qinglong_ingress.admission import Decision, decide
from qinglong_ingress.audit import AuditOutcome, refused_outcome
from qinglong_ingress.directory import (
    CLAIM_REFUSAL_REASONS,
    ClaimRefusal,
    Directory,
    RoleBinding,
    WorkerClaim,
)
from qinglong_ingress.principals import (
    JOINING_MACHINE,
    CredentialKind,
    Principal,
    PrincipalKind,
    bearer_token_digest,
    operator_uri_prefix,
    worker_uri_prefix,
)
from qinglong_ingress.routes import Route
from qinglong_ingress.targets import Targets, targets_of
from qinglong_ingress.transport_security import is_acceptable_transport
from qinglong_ingress.validation import (
    FieldViolation,
    primary_reason,
    request_size_violation,
    validate_request,
)

Context = grpc.aio.ServicerContext[Any, Any]


class Refusal(Exception):
    """A call ingress answers itself with a typed status; it is audited with the outcome
    its reason's code stands for, and never forwarded. ``audited=False`` only for the
    repeated refusals a rate limit counts instead (`RateLimit`)."""

    def __init__(
        self,
        reason: ErrorReason.ValueType,
        message: str,
        violations: Sequence[tuple[str, str]] = (),
        *,
        audited: bool = True,
    ) -> None:
        super().__init__(message)
        self.answer = TypedStatus(reason, message, tuple(violations))
        self.audited = audited

    @property
    def outcome(self) -> AuditOutcome:
        return refused_outcome(self.answer.reason)


class Verdict(Enum):
    PASS = auto()
    """The call goes on to the next stage (after the last: audit, then forward)."""
    REQUIRE_APPROVAL = auto()
    """Admission ends: the call is audited and answered as needing an approval."""


@dataclass(frozen=True)
class Received:
    """A request as it arrived: the parsed message (None if it did not parse), its size,
    and for bytes that did not parse, the violation that says where (R-ERR-1)."""

    message: Message | None
    size: int
    undecodable: FieldViolation | None = None


@dataclass
class Call:
    """One public call as admission sees it; stages fill in what they establish."""

    route: Route
    received: Received
    context: Context
    request: Message
    """The parsed request, or an empty one of its type when the bytes did not parse."""
    targets: Targets
    """The ids the request names, where they are well formed (for binding and audit)."""
    tls_version: str = ""
    peer_uris: tuple[str, ...] = ()
    """The SAN URIs of the caller's verified certificate, read once by the transport
    stage for the stages after it."""
    principal: Principal | None = None
    """Who is calling, once authentication established it."""
    binding: RoleBinding | None = None
    """The operator's role binding the call was authorised by."""
    claim: WorkerClaim | None = None
    """A Worker's identity and binding, for the audit statement to check."""

    @classmethod
    def arrived(cls, route: Route, received: Received, context: Context) -> Call:
        request = received.message or route.request_type()
        return cls(route, received, context, request, targets_of(request))

    @property
    def caller(self) -> Principal:
        """The authenticated principal; a stage that needs it runs after authentication."""
        if self.principal is None:
            raise RuntimeError("this stage must come after authentication")
        return self.principal


class Stage(Protocol):
    """One admission rule."""

    async def check(self, call: Call) -> Verdict: ...


@runtime_checkable
class Settles(Protocol):
    """A stage that also learns how admission ended (after the audit statement, which
    may refuse a Worker's claim)."""

    def settled(self, call: Call, decision: Verdict | Refusal) -> None: ...


def invalid(
    violations: Sequence[FieldViolation], message: str = "request is out of bounds"
) -> Refusal:
    return Refusal(
        primary_reason(violations), message, [(v.field, v.description) for v in violations]
    )


# --- the stages, in their order -----------------------------------------------------------


class TransportSecurity:
    """1. Only TLS 1.3 (the TLS 1.2 restriction is transport_security.py's)."""

    async def check(self, call: Call) -> Verdict:
        auth_context = call.context.auth_context()
        if not is_acceptable_transport(auth_context):
            raise Refusal(ErrorReason.ERROR_REASON_TLS_VERSION_REJECTED, "TLS 1.3 is required")
        peer = peer_tls(auth_context)
        call.tls_version, call.peer_uris = peer.tls_version or "", peer.uris
        return Verdict.PASS


class SizeCap:
    """2. The method's byte cap, on the request's size as received."""

    async def check(self, call: Call) -> Verdict:
        too_large = request_size_violation(call.route.full_method, call.received.size)
        if too_large is not None:
            raise invalid([too_large])
        return Verdict.PASS


class Authentication:
    """3. Who is calling: an enrolled, active operator credential, or the claim of a
    worker's certificate (which the audit statement, ``directory.write_audits``, checks)."""

    def __init__(self, directory: Directory, trust_domain: str) -> None:
        self._directory = directory
        self._worker_prefix = worker_uri_prefix(trust_domain)
        self._operator_prefix = operator_uri_prefix(trust_domain)

    async def check(self, call: Call) -> Verdict:
        uris = call.peer_uris
        if call.route.audience == "worker":
            call.claim = self._worker_claim(uris)
        else:
            call.principal = await self._operator(uris, _metadata(call.context, "authorization"))
        return Verdict.PASS

    def _worker_claim(self, uris: Sequence[str]) -> WorkerClaim:
        """The certificate's Worker URI (our CA issues exactly one), checked later by the
        audit statement; a certificate without one is refused here."""
        for uri in uris:
            if uri.startswith(self._worker_prefix):
                return WorkerClaim(uri)
        raise claim_refused(ClaimRefusal.UNENROLLED)

    async def _operator(self, uris: Sequence[str], authorization: str | None) -> Principal:
        if authorization is not None:
            digest = bearer_token_digest(authorization)
            row = None if digest is None else await self._directory.operator_by_token_digest(digest)
            if row is None:
                raise _unauthenticated("the bearer token is not valid")
            return Principal(
                PrincipalKind(row.kind),
                str(row.principal_id),
                row.name,
                CredentialKind.BEARER_TOKEN,
                "bearer",
                token_id=row.credential_id,
            )
        for uri in uris:
            if uri.startswith(self._operator_prefix):
                row = await self._directory.operator_by_certificate(uri)
                if row is not None:
                    return Principal(
                        PrincipalKind(row.kind),
                        str(row.principal_id),
                        row.name,
                        CredentialKind.CERTIFICATE,
                        uri,
                    )
        raise _unauthenticated("no enrolled operator credential")


class Bounds:
    """4. The request parsed, and every field is within the contract (validation.py)."""

    async def check(self, call: Call) -> Verdict:
        if call.received.message is None:
            raise invalid(
                [
                    call.received.undecodable
                    or FieldViolation(
                        call.request.DESCRIPTOR.full_name,
                        "the request bytes are not a well-formed message of this type",
                    )
                ],
                "the request is not a well-formed message",
            )
        violations = validate_request(call.request, serialized_size=call.received.size)
        if violations:
            raise invalid(violations)
        return Verdict.PASS


class Authorisation:
    """5. A worker speaks only for itself and its sessions (SPEC R-ING-1; checked by the
    audit statement, ``directory.write_audits``); an operator
    needs a project role for the method's permission (admission.py); an administrator
    must be a cluster admin, whatever its project roles (docs/decisions/0002)."""

    def __init__(self, directory: Directory) -> None:
        self._directory = directory

    async def check(self, call: Call) -> Verdict:
        if call.route.audience == "worker":
            return Verdict.PASS  # the binding is the audit statement's to check (above)
        principal, targets = call.caller, call.targets
        if call.route.audience == "admin":
            if principal.kind is PrincipalKind.AGENT:
                # As an administrator an Agent could make itself a person to approve its
                # own held requests (R-CAN-2); control never makes one a cluster admin.
                raise Refusal(
                    ErrorReason.ERROR_REASON_PERMISSION_DENIED,
                    "an agent may not call AdminService",
                )
            if not await self._directory.is_cluster_admin(uuid.UUID(principal.id)):
                raise Refusal(
                    ErrorReason.ERROR_REASON_PERMISSION_DENIED,
                    "only a cluster admin may call AdminService",
                )
            return Verdict.PASS
        # Every operator request names its project (the bounds stage refused it otherwise).
        assert call.route.permission is not None
        assert targets.project_id is not None
        binding = await self._directory.role_binding(targets.project_id, uuid.UUID(principal.id))
        decision = decide(
            principal, None if binding is None else binding.role, call.route.permission
        )
        if decision is Decision.DENY:
            raise Refusal(ErrorReason.ERROR_REASON_PERMISSION_DENIED, "no project role allows this")
        call.binding = binding
        if decision is Decision.REQUIRE_APPROVAL:
            return Verdict.REQUIRE_APPROVAL
        return Verdict.PASS


class JoiningMachine:
    """3'. An enrollment call has no credential but its join token, which only control
    can check (ingress holds no CA and writes no identity): the caller stays anonymous."""

    async def check(self, call: Call) -> Verdict:
        call.principal = JOINING_MACHINE
        return Verdict.PASS


class RateLimit:
    """A token bucket per peer host and one for everyone: a listener that accepts calls
    without a credential must not let anyone guess join tokens at line rate. Per replica
    (an attacker gains at most a factor of the replica count).

    The first refusal of a peer host in a minute is audited like any other call, and the
    first refusal of the shared total in a minute (whichever host it came from); the
    others are only counted (`qinglong_ingress_refusals_not_audited`):
    an audit row per refused call would let anyone who can reach the listener write to
    the database at line rate — the very thing the limit is for."""

    def __init__(
        self,
        per_peer_per_minute: float,
        total_per_minute: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._total = _Bucket(total_per_minute, clock())
        self._peers = _Buckets(per_peer_per_minute)
        self._clock = clock

    async def check(self, call: Call) -> Verdict:
        now = self._clock()
        peer = self._peers.of(_peer_host(call.context.peer()), now)
        # Refusals are audited once a minute per host that used up its own share, and
        # once a minute in all for refusals of the total (an attacker with many
        # addresses would otherwise get an audit row per address).
        if not peer.take(now):
            gate = peer
        elif not self._total.take(now):
            gate = self._total
        else:
            return Verdict.PASS
        raise gate.refusal(now, "too many attempts; retry later")


#: Refusals as unauthenticated a certificate may have a minute before its calls are
#: refused without database work (two a second, sustained).
REFUSALS_PER_MINUTE: Final = 120.0


class RefusedCertificates:
    """On the mutual-TLS listener every caller holds a certificate of our CA, yet one may
    no longer be anyone's: a disabled Worker's (valid for days), one whose bearer token
    was revoked, a script with a mistyped token. Each refused call is an audit row, so
    such a caller could write rows as fast as it sends (a reviewer: about 990 a second).
    So each certificate may be refused as unauthenticated :data:`REFUSALS_PER_MINUTE`
    times a minute (a bucket, full to start); beyond that its calls are refused
    RATE_LIMITED before any database work, the first of those each minute audited, the
    rest counted (`qinglong_ingress_refusals_not_audited`). A call admitted takes nothing,
    and once a token is back the next call is judged in full again: a certificate whose
    Worker or token is enabled again is served within a few seconds. Per replica."""

    def __init__(
        self, per_minute: float = REFUSALS_PER_MINUTE, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock
        self._certificates = _Buckets(per_minute)

    async def check(self, call: Call) -> Verdict:
        bucket = self._certificates.known(_certificate_key(call))
        now = self._clock()
        if bucket is None or bucket.has_token(now):
            return Verdict.PASS
        raise bucket.refusal(now, "too many refused calls with this certificate; retry later")

    def settled(self, call: Call, decision: Verdict | Refusal) -> None:
        """After admission: a refusal as unauthenticated takes a token of the caller's
        certificate."""
        if (
            not isinstance(decision, Refusal)
            or decision.outcome is not AuditOutcome.UNAUTHENTICATED
        ):
            return
        now = self._clock()
        self._certificates.of(_certificate_key(call), now).take(now)


def _certificate_key(call: Call) -> str:
    """A caller's certificate, by the identities it names (our CA issues one URI each);
    the peer's host for one that names none."""
    uris = call.peer_uris
    return "uri:" + ",".join(sorted(uris)) if uris else "host:" + _peer_host(call.context.peer())


#: Beyond this many peers, the least recently heard from is forgotten.
_MAX_TRACKED_PEERS: Final = 10_000
#: A peer host's rate-limited refusals: one audited per this many seconds.
_REFUSALS_AUDITED_EVERY_SECONDS: Final = 60.0


@dataclass
class _Bucket:
    per_minute: float
    updated: float
    tokens: float = -1.0
    refusal_audited_at: float = float("-inf")

    def __post_init__(self) -> None:
        if self.tokens < 0:
            self.tokens = self.per_minute  # a full minute's worth to start with

    def _refill(self, now: float) -> None:
        elapsed = max(0.0, now - self.updated)
        self.tokens = min(self.per_minute, self.tokens + elapsed * self.per_minute / 60.0)
        self.updated = now

    def refusal(self, now: float, message: str) -> Refusal:
        """The RATE_LIMITED answer of a call this bucket refuses: audited the first time
        a minute, counted the others (an audit row per refused call would let the caller
        write to the database at its own rate — what the limit is for)."""
        audited = now - self.refusal_audited_at >= _REFUSALS_AUDITED_EVERY_SECONDS
        if audited:
            self.refusal_audited_at = now
        return Refusal(ErrorReason.ERROR_REASON_RATE_LIMITED, message, audited=audited)

    def has_token(self, now: float) -> bool:
        self._refill(now)
        return self.tokens >= 1.0

    def take(self, now: float) -> bool:
        self._refill(now)
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class _Buckets:
    """A bucket per key (a peer host, a certificate), the least recently used forgotten
    beyond :data:`_MAX_TRACKED_PEERS`: O(1) per call whatever the churn of keys (a new
    key starts full anyway)."""

    def __init__(self, per_minute: float) -> None:
        self._per_minute = per_minute
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def known(self, key: str) -> _Bucket | None:
        return self._buckets.get(key)

    def of(self, key: str, now: float) -> _Bucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(self._per_minute, now)
            if len(self._buckets) > _MAX_TRACKED_PEERS:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
        return bucket


#: An IPv6 peer is counted by its network of this prefix: one subscriber commonly holds a
#: /56 (or more), and a bucket per address would give it one per address it cares to use.
IPV6_PEER_PREFIX: Final = 56


def _peer_host(peer: str) -> str:
    """The rate limit's key of a peer: ``ipv4:10.0.0.7:51234`` -> ``ipv4:10.0.0.7`` (one
    bucket per host, not per port); ``ipv6:[2001:db8:1:2::7]:51234`` ->
    ``ipv6:2001:db8:1::/56`` (one per network an attacker could fill with addresses); an
    IPv4 address in IPv6 form counts as that IPv4 host."""
    if peer.startswith("ipv6:[") and "]" in peer:
        text = peer[len("ipv6:[") : peer.index("]")]
        try:
            address = ipaddress.IPv6Address(text.split("%", 1)[0])
        except ValueError:
            return peer
        if address.ipv4_mapped is not None:
            return f"ipv4:{address.ipv4_mapped}"
        network = ipaddress.IPv6Network((address, IPV6_PEER_PREFIX), strict=False)
        return f"ipv6:{network}"
    return peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer


def enrollment_stages(per_peer_per_minute: float, total_per_minute: float) -> tuple[Stage, ...]:
    """The admission order of the enrollment listener: no authentication, a rate limit."""
    return (
        TransportSecurity(),
        SizeCap(),
        RateLimit(per_peer_per_minute, total_per_minute),
        JoiningMachine(),
        Bounds(),
    )


def admission_stages(directory: Directory, trust_domain: str) -> tuple[Stage, ...]:
    """The admission order every public call goes through (see the module docstring)."""
    return (
        TransportSecurity(),
        SizeCap(),
        RefusedCertificates(),
        Authentication(directory, trust_domain),
        Bounds(),
        Authorisation(directory),
    )


def _unauthenticated(message: str) -> Refusal:
    return Refusal(ErrorReason.ERROR_REASON_UNAUTHENTICATED_PRINCIPAL, message)


_CLAIM_REFUSAL_MESSAGES: Final = {
    ClaimRefusal.UNENROLLED: "no enrolled worker identity on the certificate",
    ClaimRefusal.OTHER_WORKER: "the request names another worker",
    ClaimRefusal.OTHER_SESSION: "the session belongs to another worker",
}


def claim_refused(refusal: ClaimRefusal) -> Refusal:
    """The answer to a Worker's claim the audit statement (or the certificate) refused."""
    return Refusal(CLAIM_REFUSAL_REASONS[refusal], _CLAIM_REFUSAL_MESSAGES[refusal])


def _metadata(context: Context, key: str) -> str | None:
    for name, value in context.invocation_metadata() or ():
        if name == key:
            return value if isinstance(value, str) else value.decode("ascii", "replace")
    return None
