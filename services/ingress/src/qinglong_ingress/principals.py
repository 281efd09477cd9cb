"""Who is calling: principals resolved from a verified certificate or a bearer token."""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from enum import StrEnum

from qinglong_protocol import bounds, identities

_BEARER_SCHEME = "Bearer "


class PrincipalKind(StrEnum):
    WORKER = "worker"
    USER = "user"
    AGENT = "agent"
    ANONYMOUS = "anonymous"
    """A machine joining with a one-time token: it has no identity yet (R-ADM-2)."""


class CredentialKind(StrEnum):
    CERTIFICATE = "certificate"
    BEARER_TOKEN = "bearer_token"  # noqa: S105 - a kind name, not a secret
    JOIN_TOKEN = "join_token"  # noqa: S105 - a kind name, not a secret


@dataclass(frozen=True)
class Principal:
    kind: PrincipalKind
    id: str
    """A worker's worker_id, or an operator principal's UUID."""
    name: str
    credential: CredentialKind
    subject: str
    """The certificate's SAN URI, or `bearer` for a token (never the token)."""
    token_id: uuid.UUID | None = None
    """The id of the bearer token that authenticated the call (never the token), for its
    audit row; None for any other credential."""

    @property
    def worker_id(self) -> str | None:
        return self.id if self.kind is PrincipalKind.WORKER else None


#: Who an enrollment call is before control has checked its join token: ingress cannot
#: check it (it holds no identity write and no CA), so the caller stays anonymous.
JOINING_MACHINE = Principal(
    PrincipalKind.ANONYMOUS, "joining-worker", "joining-worker", CredentialKind.JOIN_TOKEN, "join"
)


def worker_uri_prefix(trust_domain: str) -> str:
    return identities.worker_uri(trust_domain, "")


def operator_uri_prefix(trust_domain: str) -> str:
    return identities.operator_uri(trust_domain, "")


def bearer_token_digest(authorization: str) -> str | None:
    """SHA-256 (hex) of a well-formed `Bearer qlo1_…` value; None for anything else.

    The token itself goes no further than this function.
    """
    token = authorization.removeprefix(_BEARER_SCHEME)
    if token == authorization or bounds.OPERATOR_TOKEN_PATTERN.match(token) is None:
        return None
    return hashlib.sha256(token.encode("ascii")).hexdigest()
